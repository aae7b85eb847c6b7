"""Rank skew: how far apart the ranks arrive at a blocking collective after a stretch of compute.

The simulator charges each collective the expected wait for its last rank (``overlapcfg.cost.achievable.Skew``):
a rank's arrival has standard deviation ``sqrt(absolute^2 + (relative x T)^2)`` after ``T`` seconds of compute
since the ranks last synchronized, and the last of ``p`` is ``expected_max_normal(p)`` of those late. This
measures the two terms on the live group, without comparing clocks across hosts:

1. cycle after cycle, back to back as a step runs them, every rank runs the same compute of about ``T`` seconds
   (units of the step's own kind of compute, ``SkewUnit``, repeated), then issues the step's own kind of blocking
   collective (an all-gather of the step's median all-gather size, as the graphs issue it) and times how long it
   waited for it; the end of each collective is where the ranks last synchronized;
2. the rank that arrived first waits longest: per cycle, a rank's wait less the shortest wait of that cycle is how
   much later than it the last rank arrived (the collective's own time cancels); its mean over ranks and cycles is
   ``expected_max_normal(p) x sigma(T)`` (each rank averages the lateness of the last one);
3. at a few lengths ``T`` (none, then longer and longer compute, in whole units), in ``TRIALS`` rounds that take
   every length in turn so a drifting load hits every length alike, a short length several times a round
   (``repeats``); ``sigma(T)^2 = absolute^2 + diffusion T + relative^2 T^2`` is fitted by non-negative least squares
   on ``(1, T, T^2)``;
4. the last rank's own wait (the shortest of a cycle: it found the others there) is the collective alone; after
   the shortest length with compute (the spacing of an unbucketed step's collectives), it gives the wake-up cost
   of an idle link (``Skew.wake``, ``wake_points``): the mean over those cycles less the median with no compute
   before it (collectives queued back to back). The collective fits price a collective's median time alone
   (``collective_fits``); most cycles wake in a tenth of a millisecond and a few take milliseconds (gloo's threads
   waiting for a core), and a step pays the expected value over its many collectives, so the wake-up adds the
   mean's excess over that median. The longer lengths measure the skew only (``wake_points`` says why).

Why the step's own collective, back to back, and many cycles at the short lengths (measured on 2 gloo ranks here,
2026-12-07, 192 cycles at about 0.5 ms of the demo's compute): the wake-up there came to 0.67-0.86 ms with a 16 KB
all-gather back to back, against 0.22 ms with the same all-gather after an all-reduce aligning the ranks, 0.09-0.11
ms with a one-number all-reduce so aligned (this module's probe until then), and 1-37 us with that probe at 12
trials a length. The unbucketed demo step's own collectives, profiled, waited 0.35-0.66 ms each at the median and
1.0-1.1 ms on average: the back-to-back all-gather is the probe that sees what the step pays.

The unit matters: measured on 2 gloo ranks sharing 2 cores, ranks running many small kernels (the demo step's
``1024 x 64 x 64`` matmul and its elementwise kernels) drift apart 2-3x faster than ranks running one ``128^3``
matmul for the same time (mean lateness 1.04 ms against 0.36 ms after 2 ms of compute): each kernel is a point at
which the scheduler can hand the core to another thread. So the unit is the step's own mix (``skew_unit``): its
most frequent matmul shape and, after it, as many of its typical memory-bound kernels as it runs per matmul.

Rank 0 fits the gathered waits; every rank must call ``time_skew`` with the same arguments.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlapcfg import compat
from overlapcfg.cost.achievable import Skew, WakePoint, expected_max_normal
from overlapcfg.cost.measured_fits import SkewSamples
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.fit import fit_nonnegative
from overlapcfg.measuring.kernels import MatmulMix, MatmulShape

__all__ = ["LENGTHS", "MAX_REPEATS", "PROBE_BYTES", "ROUND_SECONDS", "TRIALS", "UNIT_SHAPE", "SkewTimings", "SkewUnit",
           "probe_runner", "repeats", "skew_fit", "skew_unit", "time_skew", "unit_runner"]

LENGTHS = {"cpu": (0.0, 0.0005, 0.002, 0.008, 0.03, 0.1), "gpu": (0.0, 0.0005, 0.002, 0.008, 0.03)}
"""Compute between synchronizations to measure at, seconds (about; the unit's own time rounds them). On a CPU
from half a millisecond: an unbucketed step's collectives come that close together (the demo's 116 collectives,
0.3-1 ms of compute apart)."""
TRIALS = 12
"""Rounds: each round runs every length, a short one several times (``repeats``)."""
ROUND_SECONDS = 0.01
"""Compute each length shorter than this runs per round, in repeats of it (at most ``MAX_REPEATS``): what a step
pays at a blocking collective is a mean over many, and at the short lengths an unbucketed step lives at, that mean
is set by rare waits of milliseconds (gloo's thread waiting for a core). Measured on 2 gloo ranks here, 2026-12-07:
after 0.3-1 ms of the demo's compute, back to back, a 16 KB all-gather's last rank waited 0.25-0.36 ms at the median
and 0.3-1.1 ms on average over 60 cycles; twelve cycles of such a length (one a round) catch one of those waits or
none. With these repeats the shortest lengths get 192 cycles and the calibration about two more seconds."""
MAX_REPEATS = 16
"""The most times a length runs per round (the no-compute reference, whose median the wake-up is counted from)."""
PROBE_BYTES = 16384
"""The probe all-gather's full size when the step's all-gathers are not known (a small transformer layer's
weight)."""


@dataclass(frozen=True, slots=True)
class SkewTimings:
    """Every rank's waits: ``waits[length][trial][rank]``, and the compute each length ran (median, seconds)."""

    group: str
    ranks: int
    compute: tuple[float, ...]
    waits: tuple[tuple[tuple[float, ...], ...], ...]
    unit: str = ""
    """``SkewUnit.describe()`` of the compute run."""


UNIT_SHAPE: MatmulShape = (1, 128, 128, 128)
"""The matmul of the unit when no step is given: small enough that the shortest length is several units."""


@dataclass(frozen=True, slots=True)
class SkewUnit:
    """One unit of the compute ranks drift apart over: a matmul of ``matmul``'s shape, then ``memory_kernels``
    elementwise additions each reading and writing ``memory_bytes`` (0: over the matmul's output), every kernel
    allocating its output as a step's kernels do; and the collective they then meet at, an all-gather of
    ``probe_bytes`` (full size)."""

    matmul: MatmulShape = UNIT_SHAPE
    memory_kernels: int = 1
    memory_bytes: int = 0
    probe_bytes: int = PROBE_BYTES

    def describe(self) -> str:
        batch, m, k, n = self.matmul
        dims = f"{m}x{k}x{n}" if batch == 1 else f"{batch}x{m}x{k}x{n}"
        moved = f" of {self.memory_bytes} bytes" if self.memory_bytes else ""
        return (f"matmul {dims} + {self.memory_kernels} elementwise kernel(s){moved}, "
                f"then a {self.probe_bytes}-byte all-gather")


def _median_by_count(counts: Counter[int]) -> int:
    """The median of the sizes ``counts`` counts (the lower one of an even count); 0 for none."""
    half, seen = (sum(counts.values()) + 1) // 2, 0
    for size in sorted(counts):
        seen += counts[size]
        if seen >= half:
            return size
    return 0


def skew_unit(mix: MatmulMix | None) -> SkewUnit:
    """The step's own kind of compute and collective (see the module docstring): its most frequent matmul shape
    (ties: the smaller, then the first in shape order), and per matmul as many memory-bound kernels as the step
    runs per matmul (rounded; at least 1), each of the step's median size (by count); the probe, an all-gather of
    the step's median all-gather size (by count). Without a step's matmuls: ``UNIT_SHAPE`` and one addition over
    its output; without its all-gathers: ``PROBE_BYTES``."""
    probe = _median_by_count(mix.gathers) if mix is not None and mix.gathers else PROBE_BYTES
    if mix is None or not mix.shapes:
        return SkewUnit(probe_bytes=probe)
    matmul = min(mix.shapes, key=lambda s: (-mix.shapes[s], s[0] * s[1] * s[2] * s[3], s))
    kernels = sum(mix.memory.values())
    if not kernels:
        return SkewUnit(matmul, probe_bytes=probe)
    per_matmul = max(1, round(kernels / sum(mix.shapes.values())))
    return SkewUnit(matmul, per_matmul, _median_by_count(mix.memory), probe)


def unit_runner(spec: SkewUnit, dtype: torch.dtype, clock: Clock) -> Callable[[], None]:
    """One unit of ``spec`` as a function to call: its tensors made once, each call running its kernels."""
    batch, m, k, n = spec.matmul
    a = torch.randn(batch, m, k, dtype=dtype, device=clock.device)
    b = torch.randn(batch, k, n, dtype=dtype, device=clock.device)
    # an addition reads two operands and writes one: ``memory_bytes`` is three tensors of this many elements
    numel = max(1, spec.memory_bytes // (3 * dtype.itemsize)) if spec.memory_bytes else batch * m * n
    x = torch.randn(numel, dtype=dtype, device=clock.device)
    y = torch.randn(numel, dtype=dtype, device=clock.device)

    def unit() -> None:
        torch.bmm(a, b)
        for _ in range(spec.memory_kernels):
            torch.add(x, y)

    return unit


def probe_runner(full_bytes: int, group: dist.ProcessGroup, dtype: torch.dtype,
                 clock: Clock) -> Callable[[], None]:
    """The probe as a function to call: an all-gather of ``full_bytes`` (rounded down to whole elements, one a
    rank at least) issued as the graphs issue it and waited for at once (a blocking collective)."""
    ranks = dist.get_world_size(group)
    shard = torch.zeros(max(1, full_bytes // (dtype.itemsize * ranks)), dtype=dtype, device=clock.device)

    def probe() -> None:
        compat.WAIT_TENSOR(compat.ALL_GATHER_INTO_TENSOR(shard, ranks, group.group_name))
        clock.sync()

    return probe


def repeats(counts: list[int], unit_seconds: float) -> list[int]:
    """Times each length (``counts`` units of ``unit_seconds``) runs per round: as many as fill ``ROUND_SECONDS``
    of compute, from once to ``MAX_REPEATS`` (see ``ROUND_SECONDS``)."""
    return [max(1, min(MAX_REPEATS, int(ROUND_SECONDS / (count * unit_seconds)) if count else MAX_REPEATS))
            for count in counts]


def time_skew(name: str, group: dist.ProcessGroup, *, dtype: torch.dtype, clock: Clock, trials: int = TRIALS,
              unit_spec: SkewUnit | None = None) -> SkewTimings:
    """Waits at the probe all-gather after each length of compute, back to back (see the module docstring); every
    rank of the world returns the same gathered timings."""
    unit_spec = unit_spec or SkewUnit()
    unit = unit_runner(unit_spec, dtype, clock)
    unit()
    clock.sync()
    start = time.perf_counter()
    for _ in range(10):
        unit()
    clock.sync()
    one = max((time.perf_counter() - start) / 10, 1e-7)
    counts = [0 if length == 0 else max(1, round(length / one)) for length in LENGTHS["gpu" if clock.cuda else "cpu"]]
    # every rank runs the same compute, as often: its own unit time would give each rank its own repeats (a hang)
    agreed = torch.tensor([*counts, *repeats(counts, one)], dtype=torch.int64, device=clock.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    counts, per_round = [int(c) for c in agreed.tolist()[:len(counts)]], [int(c) for c in agreed.tolist()[len(counts):]]
    waits: list[list[float]] = [[] for _ in counts]
    computes: list[list[float]] = [[] for _ in counts]
    probe = probe_runner(unit_spec.probe_bytes, group, dtype, clock)
    probe()  # the first synchronization; after it, each probe's end is the next cycle's
    cycles = [(i, count) for i, count in enumerate(counts) for _ in range(per_round[i])]
    for _ in range(trials):
        for i, count in cycles:
            began = time.perf_counter()
            for _ in range(count):
                unit()
            clock.sync()
            arrived = time.perf_counter()
            probe()
            waits[i].append(time.perf_counter() - arrived)
            computes[i].append(arrived - began)
    every: list[tuple[list[list[float]], list[float]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (waits, [statistics.median(c) for c in computes]), group=group)
    ranks = [e for e in every if e is not None]
    gathered = tuple(tuple(tuple(float(r[0][i][t]) for r in ranks) for t in range(trials * per_round[i]))
                     for i in range(len(counts)))
    compute = tuple(max(float(r[1][i]) for r in ranks) for i in range(len(counts)))
    return SkewTimings(name, dist.get_world_size(group), compute, gathered, unit_spec.describe())


def wake_points(timings: SkewTimings) -> tuple[WakePoint, ...]:
    """The wake-up of a link idle through the step's typical spacing of collectives: the mean over cycles of the
    last rank's wait at the shortest length with compute, less its median with no compute before it (the first
    length: collectives back to back, as the collective fits time them). Two points: that reference, at 0 (a
    collective queued behind another pays no wake-up), and the shortest length with compute, at least 0; ``Skew``
    holds the last point for every longer idle.

    Why not the longer lengths (they are timed for the skew; see the module docstring): beside another 2-rank job
    here (2026-12-07), the probe's last rank waited 1.2 ms on average after 0.5 ms of compute, 1.7-2.2 ms after 2 ms
    and 2.1-2.8 ms after 13 ms, while the demo step's own collectives, profiled in turns with the probe on the same
    two ranks, waited 0.5-0.9 ms (the last rank's mean) after gaps of 0.3-1 ms, 0.6-0.7 ms after 1-3 ms and 0.3-0.6
    ms after 3-10 ms: the step does not pay the growth the probe shows under load, and with it the unbucketed
    step's exposed communication was predicted at 1.4-2.1x its measurement (1.2-1.8x with this rule). On a quiet
    machine the probe's wake-up was 0.62 ms after 0.5 ms of compute and no more up to 8 ms (0.85 ms from 30 ms):
    three quiet runs re-predicted with this rule gave the same exposed communication to 1 %."""
    alone = [statistics.fmean(min(ranks) for ranks in trials) for trials in timings.waits]
    typical = statistics.median(min(ranks) for ranks in timings.waits[0])
    reference = timings.compute[0]
    later = [(idle, wait) for idle, wait in zip(timings.compute, alone, strict=True) if idle > reference]
    if not later:
        return (WakePoint(idle=reference, extra=0.0),)
    idle, wait = min(later)
    return WakePoint(idle=reference, extra=0.0), WakePoint(idle=idle, extra=min(max(wait - typical, 0.0), 1.0))


def skew_fit(timings: SkewTimings) -> tuple[Skew, SkewSamples]:
    """The fitted ``Skew`` and its record: per length, sigma = mean lateness of the last rank / E[max of p]."""
    factor = expected_max_normal(timings.ranks)
    sigmas = []
    for trials in timings.waits:
        lateness = [w - min(ranks) for ranks in trials for w in ranks]
        sigmas.append(max(statistics.fmean(lateness) / factor, 1e-9))
    design = [(1.0, t, t * t) for t in timings.compute]
    fit = fit_nonnegative(design, [s * s for s in sigmas])
    variance, diffusion, square = fit.coefficients
    skew = Skew(relative=min(math.sqrt(square), 1.0), absolute=min(math.sqrt(variance), 1.0),
                diffusion=min(diffusion, 1.0), wake=wake_points(timings))
    predicted = [skew.sigma(t) for t in timings.compute]
    residual = math.sqrt(statistics.fmean(((p - s) / s) ** 2 for p, s in zip(predicted, sigmas, strict=True)))
    return skew, SkewSamples(group=timings.group, ranks=timings.ranks, compute_seconds=timings.compute,
                             sigma_seconds=tuple(sigmas), residual=residual, unit=timings.unit or None)


"""Rank skew: how far apart the ranks arrive at a blocking collective after a stretch of compute.

The simulator charges each collective the expected wait for its last rank (``overlapcfg.cost.achievable.Skew``):
a rank's arrival has standard deviation ``sqrt(absolute^2 + (relative x T)^2)`` after ``T`` seconds of compute
since the ranks last synchronized, and the last of ``p`` is ``expected_max_normal(p)`` of those late. This
measures the two terms on the live group, without comparing clocks across hosts:

1. every rank aligns (an all-reduce), runs the same compute of about ``T`` seconds (units of the step's own kind of
   compute, ``SkewUnit``, repeated), then all-reduces one number and times how long it waited in it;
2. the rank that arrived first waits longest: per trial, a rank's wait less the shortest wait of that trial is how
   much later than it the last rank arrived (the collective's own time cancels); its mean over ranks and trials is
   ``expected_max_normal(p) x sigma(T)`` (each rank averages the lateness of the last one);
3. at a few lengths ``T`` (none, then longer and longer compute, in whole units), ``TRIALS`` trials
   each, taken in turns so a drifting load hits every length alike; ``sigma(T)^2 = absolute^2 + diffusion T +
   relative^2 T^2`` is fitted by non-negative least squares on ``(1, T, T^2)``;
4. the last rank's own wait (the shortest of a trial: it found the others there) is the collective alone; after
   ``T`` of compute, it gives the wake-up cost of a link idle that long (``Skew.wake``): the mean over trials per
   length less the median right after the alignment, made non-decreasing. The collective fits price a
   collective's median time alone (``collective_fits``); most trials wake in a tenth of a millisecond and a few
   take milliseconds (gloo's threads waiting for a core), and a step pays the expected value over its many
   collectives, so the wake-up adds the mean's excess over that median. Measured on 2 gloo ranks here, a 16 KB
   all-gather waited at once after the demo's compute took 0.4 ms at the median and 0.85-1.25 ms on average (a
   tenth of them over 1.3-3.6 ms, on both ranks alike), and the last rank's wait after 0.4-82 ms of compute was
   0.1-0.27 ms above its value right after the alignment at the median, 0.15-0.57 ms on average.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlapcfg.cost.achievable import Skew, WakePoint, expected_max_normal
from overlapcfg.cost.measured_fits import SkewSamples
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.fit import fit_nonnegative
from overlapcfg.measuring.kernels import MatmulMix, MatmulShape

__all__ = ["LENGTHS", "TRIALS", "UNIT_SHAPE", "SkewTimings", "SkewUnit", "skew_fit", "skew_unit", "time_skew",
           "unit_runner"]

LENGTHS = {"cpu": (0.0, 0.0005, 0.002, 0.008, 0.03, 0.1), "gpu": (0.0, 0.0005, 0.002, 0.008, 0.03)}
"""Compute between synchronizations to measure at, seconds (about; the unit's own time rounds them). On a CPU
from half a millisecond: an unbucketed step's collectives come that close together (the demo's 116 collectives,
0.3-1 ms of compute apart)."""
TRIALS = 12
"""Trials per length."""


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
    allocating its output as a step's kernels do."""

    matmul: MatmulShape = UNIT_SHAPE
    memory_kernels: int = 1
    memory_bytes: int = 0

    def describe(self) -> str:
        batch, m, k, n = self.matmul
        dims = f"{m}x{k}x{n}" if batch == 1 else f"{batch}x{m}x{k}x{n}"
        moved = f" of {self.memory_bytes} bytes" if self.memory_bytes else ""
        return f"matmul {dims} + {self.memory_kernels} elementwise kernel(s){moved}"


def skew_unit(mix: MatmulMix | None) -> SkewUnit:
    """The step's own kind of compute (see the module docstring): its most frequent matmul shape (ties: the
    smaller, then the first in shape order), and per matmul as many memory-bound kernels as the step runs per
    matmul (rounded; at least 1), each of the step's median size (by count). Without a step's matmuls: ``UNIT_SHAPE``
    and one addition over its output."""
    if mix is None or not mix.shapes:
        return SkewUnit()
    matmul = min(mix.shapes, key=lambda s: (-mix.shapes[s], s[0] * s[1] * s[2] * s[3], s))
    kernels = sum(mix.memory.values())
    if not kernels:
        return SkewUnit(matmul)
    per_matmul = max(1, round(kernels / sum(mix.shapes.values())))
    half, seen, median = (kernels + 1) // 2, 0, 0
    for size in sorted(mix.memory):
        seen += mix.memory[size]
        if seen >= half:
            median = size
            break
    return SkewUnit(matmul, per_matmul, median)


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


def time_skew(name: str, group: dist.ProcessGroup, *, dtype: torch.dtype, clock: Clock, trials: int = TRIALS,
              unit_spec: SkewUnit | None = None) -> SkewTimings:
    """Waits at a one-number all-reduce after each length of compute (see the module docstring); every rank of the
    world returns the same gathered timings."""
    unit_spec = unit_spec or SkewUnit()
    unit = unit_runner(unit_spec, dtype, clock)
    token = torch.zeros(1, device=clock.device)
    unit()
    clock.sync()
    start = time.perf_counter()
    for _ in range(10):
        unit()
    clock.sync()
    one = max((time.perf_counter() - start) / 10, 1e-7)
    counts = [0 if length == 0 else max(1, round(length / one)) for length in LENGTHS["gpu" if clock.cuda else "cpu"]]
    agreed = torch.tensor(counts, dtype=torch.int64, device=clock.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # every rank runs the same compute
    counts = [int(c) for c in agreed.tolist()]
    waits: list[list[float]] = [[] for _ in counts]
    computes: list[list[float]] = [[] for _ in counts]
    for _ in range(trials):
        for i, count in enumerate(counts):
            dist.all_reduce(token, group=group)
            clock.sync()
            began = time.perf_counter()
            for _ in range(count):
                unit()
            clock.sync()
            arrived = time.perf_counter()
            dist.all_reduce(token, group=group)
            clock.sync()
            waits[i].append(time.perf_counter() - arrived)
            computes[i].append(arrived - began)
    every: list[tuple[list[list[float]], list[float]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (waits, [statistics.median(c) for c in computes]), group=group)
    ranks = [e for e in every if e is not None]
    gathered = tuple(tuple(tuple(float(r[0][i][t]) for r in ranks) for t in range(trials)) for i in range(len(counts)))
    compute = tuple(max(float(r[1][i]) for r in ranks) for i in range(len(counts)))
    return SkewTimings(name, dist.get_world_size(group), compute, gathered, unit_spec.describe())


def wake_points(timings: SkewTimings) -> tuple[WakePoint, ...]:
    """Per length, the mean over trials of the last rank's wait, less its median right after the alignment (the
    first length, no compute; what the collective fits price): ``Skew.wake`` (see the module docstring). That first
    point is the reference, 0 (a collective queued behind another pays no wake-up). Made non-decreasing in idle
    time (a longer sleep does not wake faster; a dip is noise) and kept only at strictly increasing lengths."""
    alone = [statistics.fmean(min(ranks) for ranks in trials) for trials in timings.waits]
    typical = statistics.median(min(ranks) for ranks in timings.waits[0])
    points: list[WakePoint] = []
    extra = 0.0
    for idle, wait in sorted(zip(timings.compute, alone, strict=True)):
        # right after the alignment is the reference: a collective queued behind another pays no wake-up
        extra = max(extra, wait - typical, 0.0) if points else 0.0
        if not points or idle > points[-1].idle:
            points.append(WakePoint(idle=idle, extra=min(extra, 1.0)))
    return tuple(points)


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


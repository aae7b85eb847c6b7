"""Contention: how much compute slows while a collective is in flight, and the collective while compute runs.

The simulator's model (``overlapcfg.cost.replay``): while a collective is in flight, compute runs at
``1 / (1 + a)`` of its speed; while compute runs, a collective moves at ``1 / (1 + b)`` of its own; a collective
that compute waits for (or that runs after the compute is done) moves at full speed. On a CPU, gloo's threads and
the compute thread share the cores; on a GPU, NCCL's kernels and the model's share SMs and memory bandwidth.

Per live group (so per kind of link: inside a host, across hosts), every rank in step, ``RUNS`` times:

1. the compute alone, ``C``: a few *units* of the step's own kernels (its largest matmul in its dtype, then an
   elementwise kernel over the matmul's output), as many as take about ``COMPUTE_SHARE`` of the collective;
2. the all-gather alone, ``X``: its own time (issue excluded, as ``overlapcfg.measuring.collective_fits`` times it);
3. both: issue the all-gather, run the same compute (``C'``), then wait for it (blocked for ``W``).

When the all-gather outlasts the compute (the wait blocks), ``C'`` ran entirely under it and the all-gather moved
``C' / (1 + b)`` of its work meanwhile and the rest, ``W``, alone::

    a = C' / C - 1            1 / (1 + b) = (X - W) / C'

The start delay (``Contention.start_delay``; on a CPU only, ``time_start_delay``): after some compute since the
ranks aligned (``DELAY_LEADS``, in turns), a small all-gather (mostly latency, so the rates above hardly enter) is
issued, then the step's own kind of compute runs unit after unit, asking the collective after each whether it is
done; its time in flight less its time waited on at once, less half a unit (it is seen done at the end of the unit
it ended in), is how long it sat before it moved. Measured on 2 gloo ranks sharing 2 cores, the delay is either
next to nothing or 3-4 ms (the communication thread waits for the scheduler to give it a core the compute threads
hold), the same for every size from 16 KB to 1 MB, in a quarter to three quarters of the runs whatever the compute
before it; a 1 MB reduce-scatter waited on after 2 ms of compute had not moved at all. A rate cannot say that, and
the large all-gather above hides it in ``b``. The profile keeps the mean over runs: a step pays the expected delay
once per collective that starts on an idle link. On CUDA the compute is queued, not run, by the host, so polling
between units times nothing; NCCL's kernel starts on its own stream, and no delay is recorded.

A run in which the wait did not block says nothing about ``b`` (the all-gather finished under the compute): the
compute is halved for the next runs. ``a`` and ``b`` are the medians over the usable runs, the largest of any
rank's (a step waits for its slowest rank), and the residual is how far the fitted pair puts ``C'`` and ``C' + W``
from each run.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlapcfg import compat
from overlapcfg.cost.measured_fits import CollectiveFit, Contention, ContentionSamples
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.kernels import MatmulShape

__all__ = ["COMPUTE_SHARE", "MAX_SLOWDOWN", "RUNS", "START_DELAY_BYTES", "ContentionTimings", "contention_fit",
           "time_contention", "time_start_delay"]

RUNS = 7
"""Overlapped runs per group (each with its own compute-alone and collective-alone timing, taken in turns so a
drifting load hits all three alike)."""
COMPUTE_SHARE = 0.5
"""Compute per run, as a share of the all-gather alone: it must end before the all-gather does."""
TARGET_SECONDS = {"cpu": 0.04, "gpu": 0.004}
"""How long the all-gather alone should take: long enough to stand above timer and scheduling noise."""
MAX_SLOWDOWN = 100.0
"""A slowdown is clamped here: a collective that made no visible progress under compute reads as infinitely slow."""
USABLE_WAIT = 0.05
"""A run is usable for ``b`` when its wait blocked for at least this share of the all-gather alone."""


@dataclass(frozen=True, slots=True)
class ContentionTimings:
    """One rank's runs on one group."""

    group: str
    inter_node: bool
    nbytes: int
    comm: tuple[float, ...]
    compute: tuple[float, ...]
    compute_under: tuple[float, ...]
    blocked: tuple[float, ...]
    delay_bytes: int = 0
    """Full size of the small all-gather of the start-delay runs (0: not timed)."""
    delays: tuple[float, ...] = ()
    """Per start-delay run: its time in flight under compute less its time alone, less half a unit."""


def _units(shape: MatmulShape, dtype: torch.dtype, clock: Clock) -> Callable[[], object]:
    """One unit of compute: the matmul, then ``out + out`` (an elementwise kernel over what it wrote)."""
    batch, m, k, n = shape
    a = torch.randn(batch, m, k, dtype=dtype, device=clock.device)
    b = torch.randn(batch, k, n, dtype=dtype, device=clock.device)
    out = torch.empty(batch, m, n, dtype=dtype, device=clock.device)
    summed = torch.empty_like(out)

    def unit() -> None:
        torch.bmm(a, b, out=out)
        torch.add(out, out, out=summed)

    return unit


def _bytes_for(seconds: float, fit: CollectiveFit | None, group_size: int, max_bytes: int, min_bytes: int) -> int:
    """Full-size bytes of an all-gather taking about ``seconds`` by the fit (the largest size without one)."""
    if fit is None:
        return max_bytes
    p = group_size
    volume = max(0.0, seconds - (p - 1) * fit.latency) * fit.bandwidth
    return int(min(max_bytes, max(min_bytes, volume * p / max(p - 1, 1))))


def time_contention(name: str, group: dist.ProcessGroup, *, inter_node: bool, fit: CollectiveFit | None,
                    shape: MatmulShape, dtype: torch.dtype, clock: Clock, max_bytes: int, min_bytes: int = 4096,
                    runs: int = RUNS) -> ContentionTimings:
    """This rank's runs on ``group`` (see the module docstring). Every rank of the world must call it with the same
    arguments, in the same order as for other groups."""
    p = dist.get_world_size(group)
    token = torch.zeros(1, device=clock.device)
    unit = _units(shape, dtype, clock)

    def align() -> None:
        dist.all_reduce(token, group=group)
        clock.sync()

    def alone_compute(count: int) -> float:
        align()
        start = clock.mark()
        for _ in range(count):
            unit()
        return max(clock.seconds(start, clock.mark()), 1e-9)

    unit()  # warm-up
    one = _agreed_seconds(alone_compute(1), clock)
    # Long enough to stand above noise, and at least two units of compute long (one unit must fit under it).
    target = max(TARGET_SECONDS["gpu" if clock.cuda else "cpu"], 2 * one / COMPUTE_SHARE)
    numel = max(p, _bytes_for(target, fit, p, max_bytes, min_bytes) // dtype.itemsize // p * p)
    shard = torch.ones(numel // p, dtype=dtype, device=clock.device)

    def gather() -> torch.Tensor:
        return compat.ALL_GATHER_INTO_TENSOR(shard, p, group.group_name)

    def alone_comm() -> float:
        align()
        start = clock.mark()
        host = time.perf_counter()
        out = gather()
        issued = time.perf_counter() - host if not clock.cuda else 0.0
        compat.WAIT_TENSOR(out)
        return max(clock.seconds(start, clock.mark()) - issued, 1e-9)

    def both(count: int) -> tuple[float, float]:
        align()
        out = gather()
        issued = clock.mark()
        for _ in range(count):
            unit()
        computed = clock.mark()
        compat.WAIT_TENSOR(out)
        done = clock.mark()
        return clock.seconds(issued, computed), clock.seconds(computed, done)

    alone_comm()  # warm-up: buffers, connections
    comm = _agreed_seconds(alone_comm(), clock)
    count = _agreed(max(1, round(COMPUTE_SHARE * comm / one)), clock)
    comms, computes, unders, blocked = [], [], [], []
    for _ in range(runs):
        computes.append(alone_compute(count))
        comms.append(alone_comm())
        under, wait = both(count)
        unders.append(under)
        blocked.append(wait)
        ended_early = _agreed(int(wait < USABLE_WAIT * comms[-1]), clock)
        if ended_early and count > 1:  # the all-gather ended under the compute on some rank: less compute
            count = max(1, count // 2)
    return ContentionTimings(name, inter_node, numel * dtype.itemsize, tuple(comms), tuple(computes), tuple(unders),
                             tuple(blocked))


START_DELAY_BYTES = 65536
"""Full size of the all-gather the start delay is timed with: small, so that its own time is mostly latency."""
START_DELAY_RUNS = 20
DELAY_LEADS = (0.0, 0.0005, 0.001, 0.002, 0.003)
"""Compute run after the alignment before the all-gather is issued, in turns over the runs (seconds): a step issues
collectives at every distance from its last blocking wait."""
MAX_POLL_SECONDS = 0.25
"""Compute run at most while polling: a collective that has not moved by then is waited on (and reads as a
quarter-second delay: a machine too busy to calibrate, which the residuals will say)."""


def time_start_delay(group: dist.ProcessGroup, *, unit: Callable[[], None], dtype: torch.dtype, clock: Clock,
                     nbytes: int = START_DELAY_BYTES, runs: int = START_DELAY_RUNS) -> tuple[int, tuple[float, ...]]:
    """This rank's start-delay runs on ``group`` (see the module docstring): the all-gather's full size and, per
    run, its time in flight under ``unit`` after unit less its time alone, less half a unit (the fit takes the mean
    of the rank whose mean is largest). Every rank of the world must call it with the same arguments; on CUDA it
    times nothing and returns ``(0, ())``."""
    if clock.cuda:
        return 0, ()
    p = dist.get_world_size(group)
    numel = max(p, nbytes // dtype.itemsize // p * p)
    shard = torch.ones(numel // p, dtype=dtype, device=clock.device)
    out = torch.empty(numel, dtype=dtype, device=clock.device)
    token = torch.zeros(1, device=clock.device)
    unit()
    began = time.perf_counter()
    for _ in range(10):
        unit()
    half_unit = (time.perf_counter() - began) / 20
    compat.c10d_all_gather(out, shard, group=group)  # warm-up: buffers, connections
    delays = []
    for run in range(runs):
        dist.all_reduce(token, group=group)
        began = time.perf_counter()
        compat.c10d_all_gather(out, shard, group=group)
        alone = time.perf_counter() - began
        dist.all_reduce(token, group=group)
        lead = time.perf_counter() + DELAY_LEADS[run % len(DELAY_LEADS)]
        while time.perf_counter() < lead:
            unit()
        began = time.perf_counter()
        work = compat.c10d_all_gather(out, shard, group=group, async_op=True)  # the eager all-gather FSDP2 calls
        assert work is not None  # async_op=True returns the collective's handle
        until = began + MAX_POLL_SECONDS
        while not work.is_completed() and time.perf_counter() < until:
            unit()
        work.wait()
        delays.append(max(0.0, time.perf_counter() - began - alone - half_unit))
    return numel * dtype.itemsize, tuple(delays)


def _agreed(value: int, clock: Clock) -> int:
    """The largest of every rank's ``value``: every rank runs the same number of kernels and collectives."""
    t = torch.tensor([value], dtype=torch.int64, device=clock.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _agreed_seconds(value: float, clock: Clock) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=clock.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rates(t: ContentionTimings) -> tuple[list[float], list[float]]:
    """Per run: ``a``, and ``b`` where the run can tell (the wait blocked)."""
    a_runs, b_runs = [], []
    for comm, compute, under, wait in zip(t.comm, t.compute, t.compute_under, t.blocked, strict=True):
        a_runs.append(max(0.0, under / compute - 1))
        if wait < USABLE_WAIT * comm:
            continue
        moved = (comm - wait) / under  # 1 / (1 + b)
        b_runs.append(MAX_SLOWDOWN if moved <= 1 / (1 + MAX_SLOWDOWN) else max(0.0, 1 / moved - 1))
    return a_runs, b_runs


def contention_fit(per_rank: Sequence[ContentionTimings]) -> tuple[Contention, ContentionSamples]:
    """The slowdowns of one group from every rank's runs: per rank the medians, then the largest of the ranks; the
    samples kept are the slowest rank's (the one whose ``a`` was largest)."""
    fits = []
    for t in per_rank:
        a_runs, b_runs = _rates(t)
        fits.append((statistics.median(a_runs), statistics.median(b_runs) if b_runs else None, t))
    a = max(f[0] for f in fits)
    measured_b = [f[1] for f in fits if f[1] is not None]
    b = max(measured_b) if measured_b else 0.0
    worst = max(fits, key=lambda f: f[0])[2]
    delayed = [t for t in per_rank if t.delays]
    latest = max(delayed, key=lambda t: statistics.fmean(t.delays)) if delayed else None
    delay = statistics.fmean(latest.delays) if latest is not None else 0.0
    errors = []
    for comm, compute, under, wait in zip(worst.comm, worst.compute, worst.compute_under, worst.blocked, strict=True):
        predicted_under = compute * (1 + a)
        predicted_total = predicted_under + max(0.0, comm - predicted_under / (1 + b))
        errors += [(predicted_under - under) / under, (predicted_total - (under + wait)) / (under + wait)]
    residual = math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0
    samples = ContentionSamples(group=worst.group, inter_node=worst.inter_node, collective_bytes=worst.nbytes,
                                comm_seconds=statistics.median(worst.comm), compute_seconds=worst.compute,
                                compute_under_comm=worst.compute_under,
                                total_seconds=tuple(u + w for u, w in zip(worst.compute_under, worst.blocked,
                                                                          strict=True)),
                                residual=residual,
                                start_delay_bytes=latest.delay_bytes if latest is not None else None,
                                start_delay_seconds=latest.delays if latest is not None else ())
    return Contention(compute_slowdown=a, comm_slowdown=b, start_delay=min(delay, 1.0)), samples

"""Rank skew: how far apart the ranks arrive at a blocking collective after a stretch of compute.

The simulator charges each collective the expected wait for its last rank (``overlapcfg.cost.achievable.Skew``):
a rank's arrival has standard deviation ``sqrt(absolute^2 + (relative x T)^2)`` after ``T`` seconds of compute
since the ranks last synchronized, and the last of ``p`` is ``expected_max_normal(p)`` of those late. This
measures the two terms on the live group, without comparing clocks across hosts:

1. every rank aligns (an all-reduce), runs the same compute of about ``T`` seconds (the step's largest matmul and an
   elementwise kernel over its output, repeated), then all-reduces one number and times how long it waited in it;
2. the rank that arrived first waits longest: per trial, a rank's wait less the shortest wait of that trial is how
   much later than it the last rank arrived (the collective's own time cancels); its mean over ranks and trials is
   ``expected_max_normal(p) x sigma(T)`` (each rank averages the lateness of the last one);
3. at a few lengths ``T`` (none, then longer and longer compute, in units of a small matmul), ``TRIALS`` trials
   each, taken in turns so a drifting load hits every length alike; ``sigma(T)^2 = absolute^2 + diffusion T +
   relative^2 T^2`` is fitted by non-negative least squares on ``(1, T, T^2)``.

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

from overlapcfg.cost.achievable import Skew, expected_max_normal
from overlapcfg.cost.measured_fits import SkewSamples
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.fit import fit_nonnegative
from overlapcfg.measuring.kernels import MatmulShape

__all__ = ["LENGTHS", "TRIALS", "SkewTimings", "skew_fit", "time_skew"]

LENGTHS = {"cpu": (0.0, 0.002, 0.008, 0.03, 0.1), "gpu": (0.0, 0.0005, 0.002, 0.008, 0.03)}
"""Compute between synchronizations to measure at, seconds (about; the unit's own time rounds them)."""
TRIALS = 12
"""Trials per length."""


@dataclass(frozen=True, slots=True)
class SkewTimings:
    """Every rank's waits: ``waits[length][trial][rank]``, and the compute each length ran (median, seconds)."""

    group: str
    ranks: int
    compute: tuple[float, ...]
    waits: tuple[tuple[tuple[float, ...], ...], ...]


def _unit(shape: MatmulShape, dtype: torch.dtype, clock: Clock) -> Callable[[], None]:
    batch, m, k, n = shape
    a = torch.randn(batch, m, k, dtype=dtype, device=clock.device)
    b = torch.randn(batch, k, n, dtype=dtype, device=clock.device)
    out = torch.empty(batch, m, n, dtype=dtype, device=clock.device)

    def unit() -> None:
        torch.bmm(a, b, out=out)
        torch.add(out, out, out=out)

    return unit


UNIT_SHAPE: MatmulShape = (1, 128, 128, 128)
"""The compute unit lengths are counted in: small enough that the shortest length is several of them."""


def time_skew(name: str, group: dist.ProcessGroup, *, dtype: torch.dtype, clock: Clock, trials: int = TRIALS,
              shape: MatmulShape = UNIT_SHAPE) -> SkewTimings:
    """Waits at a one-number all-reduce after each length of compute (see the module docstring); every rank of the
    world returns the same gathered timings."""
    unit = _unit(shape, dtype, clock)
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
    return SkewTimings(name, dist.get_world_size(group), compute, gathered)


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
                diffusion=min(diffusion, 1.0))
    predicted = [skew.sigma(t) for t in timings.compute]
    residual = math.sqrt(statistics.fmean(((p - s) / s) ** 2 for p, s in zip(predicted, sigmas, strict=True)))
    return skew, SkewSamples(group=timings.group, ranks=timings.ranks, compute_seconds=timings.compute,
                             sigma_seconds=tuple(sigmas), residual=residual)


"""Time collectives on live process groups over log-spaced sizes, and fit the ring model to them per link and kind.

What is timed is what the graphs run: the functional collectives (``_c10d_functional.all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, then ``wait_tensor``), on the group's registered name. Per size, every
rank of every group runs a few repetitions, each after a barrier on its group; per repetition the host clock
gives the *issue* time (until the call returns: gloo does part of some collectives on the caller) and the
``Clock`` the *total* (until the wait is done, on the compute stream); the collective's own time is total minus
issue. A size's number is the median over repetitions of the slowest rank (an ``all_reduce(MAX)`` over the whole
world, which also keeps every rank's loop in step: all ranks decide together whether the budget allows the next
size).

Fits (``overlapcfg.measuring.fit``): per kind of link (inside a host, across hosts) and per kind, one least squares
over the timings of every group on that link, in the ring model's terms, so the fitted latency and bandwidth are
what ``overlapcfg.cost.price.collective_cost`` reads, whatever the group size.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlapcfg import compat
from overlapcfg.cost.measured_fits import CollectiveFit, CollectiveFits, GroupSamples, KindSamples, LinkFits
from overlapcfg.errors import OverlapConfigError
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.fit import LinearFit, fit_nonnegative, ring_terms

__all__ = ["KINDS", "GroupTimings", "KindTimings", "coverage_order", "fit_collectives", "group_hosts", "log_sizes",
           "time_group"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MIN_SIZES = 4
"""Sizes timed per kind whatever the budget: a fit of two unknowns needs a few more points than two."""
REPS = 5
"""Timed repetitions per size at least; short collectives get more, up to ``MAX_REPS`` or ``REP_SECONDS``."""
MAX_REPS = 25
MIN_LATENCY = 1e-9
"""The smallest per-step latency a fit keeps (``overlapcfg.cost.measured_fits.Latency``'s floor)."""
REP_SECONDS = 0.02


def _agreed(value: int, clock: Clock) -> int:
    """The largest of every rank's ``value``: ranks must run the same number of collectives."""
    t = torch.tensor([value], dtype=torch.int64, device=clock.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@dataclass(frozen=True, slots=True)
class KindTimings:
    kind: str
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    """On its own stream: total minus issue, per collective."""
    issue_seconds: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class GroupTimings:
    name: str
    size: int
    inter_node: bool
    kinds: tuple[KindTimings, ...]


def log_sizes(min_bytes: int, max_bytes: int, *, per_octave: int = 2, multiple: int = 1) -> list[int]:
    """Log-spaced byte counts from ``min_bytes`` to ``max_bytes``, each a multiple of ``multiple``, ascending."""
    if max_bytes < min_bytes:
        raise OverlapConfigError(f"log_sizes: max_bytes {max_bytes} < min_bytes {min_bytes}")
    count = max(1, round(per_octave * math.log2(max_bytes / min_bytes))) + 1
    sizes = (min_bytes * (max_bytes / min_bytes) ** (i / max(count - 1, 1)) for i in range(count))
    return sorted({max(multiple, round(s / multiple) * multiple) for s in sizes})


def coverage_order(count: int) -> list[int]:
    """Indices ``0 .. count - 1`` with the range covered first: both ends, then midpoints, then the gaps between
    (``[0, 8, 4, 2, 6, 1, 3, 5, 7]`` for 9). A budget that stops early still leaves timings that span the sizes."""
    if count <= 0:
        return []
    order = [0] if count == 1 else [0, count - 1]
    spans = [(0, count - 1)]
    while spans:
        next_spans = []
        for a, b in spans:
            if b - a > 1:
                mid = (a + b) // 2
                order.append(mid)
                next_spans += [(a, mid), (mid, b)]
        spans = next_spans
    return order


def _functional(kind: str, full: torch.Tensor, group: dist.ProcessGroup) -> Callable[[], torch.Tensor]:
    """The collective as the graphs issue it, on ``full`` (the full-size tensor); returns the unwaited output."""
    p, name = dist.get_world_size(group), group.group_name
    if kind == "all_gather":
        shard = full[: full.numel() // p].clone()
        return lambda: compat.ALL_GATHER_INTO_TENSOR(shard, p, name)
    if kind == "reduce_scatter":
        return lambda: compat.REDUCE_SCATTER_TENSOR(full, "sum", p, name)
    if kind == "all_reduce":
        return lambda: compat.ALL_REDUCE(full, "sum", name)
    raise OverlapConfigError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")


def _once(issue: Callable[[], torch.Tensor], clock: Clock, group: dist.ProcessGroup,
          token: torch.Tensor) -> tuple[float, float]:
    """One collective after the ranks of ``group`` are aligned: ``(issue seconds, seconds on its own stream)``.
    Alone, as a step runs them (between stretches of compute), not back to back: on a CPU, back-to-back collectives
    keep gloo's threads awake and measure a different machine."""
    dist.all_reduce(token, group=group)  # a barrier that works on every backend, on the device's own stream
    clock.sync()
    start = clock.mark()
    host = time.perf_counter()
    out = issue()
    issued = time.perf_counter() - host if not clock.cuda else 0.0  # a GPU's caller only enqueues
    compat.WAIT_TENSOR(out)
    total = clock.seconds(start, clock.mark())
    return issued, max(total - issued, 0.0)


def time_group(name: str, group: dist.ProcessGroup, *, sizes: Sequence[int], dtype: torch.dtype, clock: Clock,
               budget_s: float, inter_node: bool, kinds: Sequence[str] = KINDS,
               progress: Callable[[str, int], None] | None = None) -> GroupTimings:
    """Time each kind over ``sizes`` (full-size bytes) on ``group`` while the kind's share of ``budget_s`` lasts
    (at least ``MIN_SIZES`` sizes), in ``coverage_order``: the ends of the range first. Every rank of the world
    must call it with the same arguments, in the same order as for other groups."""
    p = dist.get_world_size(group)
    token = torch.zeros(1, device=clock.device)
    share = budget_s / max(len(kinds), 1)
    out = []
    for kind in kinds:
        started = time.perf_counter()
        done: list[tuple[int, float, float]] = []
        for nbytes in (sizes[i] for i in coverage_order(len(sizes))):
            numel = max(p, nbytes // dtype.itemsize // p * p)
            issue = _functional(kind, torch.ones(numel, dtype=dtype, device=clock.device), group)
            first = sum(_once(issue, clock, group, token))  # warm-up: buffers, connections
            count = _agreed(max(REPS, min(MAX_REPS, math.ceil(REP_SECONDS / max(first, 1e-6)))), clock)
            reps = [_once(issue, clock, group, token) for _ in range(count)]
            stats = torch.tensor([statistics.median(r[0] for r in reps), statistics.median(r[1] for r in reps),
                                  time.perf_counter() - started], dtype=torch.float64, device=clock.device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank; and one decision for all ranks
            issued, own, elapsed = stats.tolist()
            done.append((numel * dtype.itemsize, max(own, 1e-9), max(issued, 1e-9)))
            if progress is not None:
                progress(f"{name} {kind}", numel * dtype.itemsize)
            if elapsed > share and len(done) >= MIN_SIZES:
                break
        done.sort()
        out.append(KindTimings(kind, *(tuple(x) for x in zip(*done, strict=True))))
    return GroupTimings(name, p, inter_node, tuple(out))


def _fit_kind(kind: str, groups: Sequence[GroupTimings], *, measured_issue: bool,
              ) -> tuple[CollectiveFit, dict[str, tuple[float, float]]]:
    """One fit over every group's timings of ``kind``; per group the residuals ``(collective, issue)``."""
    rows: list[tuple[float, ...]] = []
    issue_rows: list[tuple[float, ...]] = []
    seconds: list[float] = []
    issue_seconds: list[float] = []
    spans: dict[str, tuple[int, int]] = {}
    for g in groups:
        timed = next(k for k in g.kinds if k.kind == kind)
        first = len(rows)
        for nbytes, sec, iss in zip(timed.sizes, timed.seconds, timed.issue_seconds, strict=True):
            rows.append(ring_terms(kind, g.size, nbytes))
            seconds.append(sec)
            issue_rows.append((1.0, float(nbytes)))
            issue_seconds.append(iss)
        spans[g.name] = (first, len(rows))
    link = fit_nonnegative(rows, seconds)
    latency, inverse_bw = link.coefficients
    if inverse_bw <= 0:
        largest = max(max(k.sizes) for g in groups for k in g.kinds if k.kind == kind)
        raise OverlapConfigError(f"calibrate: {kind} times do not grow with size over {len(seconds)} timings up to "
                                 f"{largest} bytes; raise the largest size (calibrate.max_bytes)")
    issue = fit_nonnegative(issue_rows, issue_seconds) if measured_issue else LinearFit((0.0, 0.0), 0.0, 0)
    # A latency pinned at zero is one the timings could not resolve, not a link that answers in no time: the
    # smallest a profile holds (1 ns) stands in.
    fit = CollectiveFit(latency=max(latency, MIN_LATENCY), bandwidth=1.0 / inverse_bw,
                        issue_latency=issue.coefficients[0],
                        issue_bandwidth=1.0 / issue.coefficients[1] if issue.coefficients[1] > 0 else None)
    residuals = {name: (_rms(rows, seconds, link, a, b), _rms(issue_rows, issue_seconds, issue, a, b)
                        if measured_issue else 0.0) for name, (a, b) in spans.items()}
    return fit, residuals


def _rms(rows: Sequence[Sequence[float]], seconds: Sequence[float], fit: LinearFit, a: int, b: int) -> float:
    errors = [(fit.predict(rows[i]) - seconds[i]) / seconds[i] for i in range(a, b)]
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def fit_collectives(groups: Sequence[GroupTimings], *, measured_issue: bool = True,
                    ) -> tuple[CollectiveFits, tuple[GroupSamples, ...]]:
    """The profile's ``collectives`` (per link and kind) and the samples with their residuals, per group."""
    links: dict[bool, dict[str, CollectiveFit]] = {}
    residuals: dict[tuple[str, str], tuple[float, float]] = {}
    for inter in (False, True):
        on_link = [g for g in groups if g.inter_node == inter]
        kinds = list(dict.fromkeys(k.kind for g in on_link for k in g.kinds))
        for kind in kinds:
            having = [g for g in on_link if any(k.kind == kind for k in g.kinds)]
            fit, per_group = _fit_kind(kind, having, measured_issue=measured_issue)
            links.setdefault(inter, {})[kind] = fit
            residuals.update({(name, kind): r for name, r in per_group.items()})
    fits = CollectiveFits(intra_node=LinkFits(**links[False]) if False in links else None,
                          inter_node=LinkFits(**links[True]) if True in links else None)
    samples = tuple(GroupSamples(name=g.name, size=g.size, inter_node=g.inter_node, collectives=tuple(
        KindSamples(kind=k.kind, sizes=k.sizes, seconds=k.seconds, issue_seconds=k.issue_seconds,
                    residual=residuals[(g.name, k.kind)][0], issue_residual=residuals[(g.name, k.kind)][1])
        for k in g.kinds)) for g in groups)
    return fits, samples


def group_hosts(groups: Mapping[str, dist.ProcessGroup], hosts: Sequence[str]) -> dict[str, bool]:
    """Whether each group's ranks span more than one host (``hosts[global rank]``)."""
    return {name: len({hosts[r] for r in dist.get_process_group_ranks(g)}) > 1 for name, g in groups.items()}

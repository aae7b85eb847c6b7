"""Where the manual scheduler places each bucket's collectives: one rule for the compiled-graph scheduler
(``overlapcfg.graph.schedule``, over fx nodes) and the tuner's quick model (``overlapcfg.tuning.quick``, over a
profile's events).

Pure: positions in, order keys and dependencies out. A *position* is where something stands before scheduling: a
node index for the scheduler, a profile position (a node index of the tuner's unit graph) for the tuner. A node
that is not moved keeps the key ``(position, 0, 0)``; the scheduler emits nodes by key, subject to data
dependencies and to the dependencies returned here, and appends each node's own rank to order a moved chain. A
*step* is one bucket's merged collectives of one kind in one direction, placed as a unit.

Forward all-gathers, ``forward_prefetch = 1`` (as torch's ``manual_overlap_bucketing``)::

    before: ag0 w0 c0 ag1 w1 c1 ag2 w2 c2        after: ag0 ag1 w0 c0 ag2 w1 c1 w2 c2

with ``k = 2``: ``ag0 ag1 ag2 w0 c0 w1 c1 w2 c2``; ``k = 0``: each ``ag_i`` right before ``w_i``. Step ``j`` is
keyed ``(wait of its issuer, -1, j)``: just before the wait of the first step whose reach covers it
(``overlapcfg.graph.reach``, where a ``max_inflight_bytes`` cap lowers the reach), and that wait depends on it.
The first step of each direction has nothing before it to prefetch it: unless its own depth is 0, it is keyed
before the first compute node, ``(first_compute, -1, 0)`` (as upstream does), or left where the graph issues it
if that is earlier. Backward all-gathers run the same in backward order. Reduce-scatters,
``reduce_scatter_delay = 1``::

    before: c2 rs2 w2 c1 rs1 w1 c0 rs0 w0          after: c2 rs2 c1 rs1 w2 c0 rs0 w1 w0

Step ``i``'s wait chain is keyed ``(last start of step i + d, 1, i)`` (clipped at the last step) and depends on
that start; sooner where a reader outside the chain needs the result before it. HSDP all-reduces are placed the
same way with ``all_reduce_delay``.

Issue order: the starts of each kind (all-gather, reduce-scatter) keep their relative order within a process
group, so every rank issues the same sequence; a prefetched all-gather may overtake a reduce-scatter issued
before it in the original graph, as in upstream's schedule. One stream serves both kinds in issue order, so an
all-gather prefetched far ahead delays every reduce-scatter issued after it. ``issue_order="reduce_scatter_first"``
issues an all-gather two or more buckets ahead of its issuer just after the next reduce-scatter start instead,
``(that start, 0, 1 + j)``, when that start comes before the previous bucket's wait (backward, ``k = 2``; ``ag3``
waits for ``rs1``)::

    gather_first:          ag3 w1 c1 rs1 ag4 w2 c2 rs2 ...
    reduce_scatter_first:  w1 c1 rs1 ag3 w2 c2 rs2 ag4 ...

Depth-1 graphs have no such all-gather and are the same under both orders.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from overlapcfg.config.policy import IssueOrder
from overlapcfg.graph.reach import prefetch_reach, reach
from overlapcfg.graph.record import DepthDecision
from overlapcfg.kinds import Direction

__all__ = ["Delay", "DelayedStep", "GatherStep", "Key", "Placement", "SortKey", "all_gather_decisions",
           "in_schedule_order", "place_all_gathers", "place_delayed"]

Key = tuple[float, int, int]
"""``(position, tier, order)``: tier -1 just before the node at ``position``, 0 at it (the node itself, or just after
it for ``order > 0``), 1 after everything placed at it; ``order`` the step's place among its kind's steps."""

SortKey = tuple[float, int, int, int]
"""What the nodes (or events) are sorted by: a ``Key`` and a rank among those at the same key (a node's rank in its
moved chain, or its own position when left in graph order)."""


@dataclass(frozen=True, slots=True)
class GatherStep:
    """One bucket's all-gathers in one direction, as the placement rule sees them."""

    bucket: int
    """The caller's index of the bucket (the scheduler's plan index, the tuner's candidate bucket)."""
    name: str
    size: int
    """Unsharded bytes as traced: what ``max_inflight_bytes`` counts."""
    start: float
    """Position of the earliest start: where the graph issues the step."""
    wait: float
    """Position of the first wait: where the bucket starts computing."""


@dataclass(frozen=True, slots=True)
class DelayedStep:
    """One bucket's reduce-scatters (or HSDP all-reduces) in the backward, as the placement rule sees them."""

    bucket: int
    name: str
    first_start: float
    """Position of the earliest start: steps are numbered in this order."""
    issue: float
    """Position of the latest start: a wait delayed to this step is placed just after it."""
    consumer: float | None
    """Position of the first node outside the step's wait chains that reads its result (None: none does)."""


class Placement(NamedTuple):
    """Where an all-gather step's start chain goes. (Named tuples: the tuner makes hundreds per candidate.)"""

    key: Key | None
    """None: left where the graph issues it."""
    before: float | None = None
    """The chain runs before the node at this position (its issuer's wait)."""
    after: float | None = None
    """The chain runs after the node at this position (the reduce-scatter start it is issued after)."""


class Delay(NamedTuple):
    """Where a delayed step's wait chain goes."""

    key: Key
    after: float | None
    """The chain runs after the node at this position (the start it is placed after; None: not delayed)."""
    effective: int
    """The delay as placed."""
    reason: str | None
    """Why ``effective`` is below the requested delay."""


Step = TypeVar("Step", GatherStep, DelayedStep)
T = TypeVar("T")


def in_schedule_order(steps: Iterable[tuple[Step, T]]) -> list[tuple[Step, T]]:
    """``(step, what the caller keeps with it)`` pairs numbered as the scheduler numbers steps: all-gathers in the
    order their buckets compute (first wait), delayed steps in the order they are issued (first start); ties (none
    in a well-formed graph) keep the given order."""
    return sorted(steps, key=lambda pair: pair[0].wait if isinstance(pair[0], GatherStep) else pair[0].first_start)


def place_all_gathers(steps: Sequence[GatherStep], depths: Sequence[int], cap: int | None, *,
                      first_compute: float | None, issue_order: IssueOrder = "gather_first",
                      scatters: Sequence[float] = ()) -> list[Placement]:
    """Place one direction's all-gather steps (in schedule order) asking for ``depths``. ``first_compute``: the
    position of the direction's first compute node (None: none); ``scatters``: the positions of the reduce-scatter
    starts, ascending, which ``issue_order="reduce_scatter_first"`` issues far prefetches after."""
    reached = reach(depths, [s.size for s in steps], cap)
    rs_first = issue_order == "reduce_scatter_first" and bool(scatters)
    out: list[Placement] = []
    issuer = 0
    for j, step in enumerate(steps):
        while reached[issuer] < j:  # reach is monotone and reach[j] >= j, so this stops at j at the latest
            issuer += 1
        if j == 0 and depths[0] > 0:
            # Nothing earlier prefetches it: issue it before the first compute (as upstream does), unless the
            # graph already issues it earlier.
            if first_compute is not None and first_compute <= step.start:
                out.append(Placement((first_compute, -1, 0)))
            else:
                out.append(Placement(None))
            continue
        anchor = steps[issuer].wait
        if rs_first and j > issuer + 1:
            later = _first_between(scatters, anchor, steps[j - 1].wait)
            if later is not None:  # after that reduce-scatter on the stream, still a bucket ahead of its own wait
                out.append(Placement((later, 0, 1 + j), after=later))
                continue
        out.append(Placement((anchor, -1, j), before=anchor if issuer != j else None))
    return out


def all_gather_decisions(steps: Sequence[GatherStep], depths: Sequence[int], cap: int | None,
                         direction: Direction) -> tuple[DepthDecision, ...]:
    """What ``place_all_gathers`` decided for each step, for the pass record: requested vs effective, and why."""
    return prefetch_reach([s.name for s in steps], depths, [s.size for s in steps], cap, direction)[1]


def _first_between(ascending: Sequence[float], low: float, high: float) -> float | None:
    """The first of ``ascending`` strictly between ``low`` and ``high``, if any."""
    i = bisect.bisect_right(ascending, low)
    return ascending[i] if i < len(ascending) and ascending[i] < high else None


def place_delayed(steps: Sequence[DelayedStep], delays: Sequence[int]) -> list[Delay]:
    """Place the delayed steps of one kind (in schedule order) asking for ``delays``."""
    out: list[Delay] = []
    last = len(steps) - 1
    for i, (step, requested) in enumerate(zip(steps, delays, strict=True)):
        target = min(i + requested, last)
        reason = "end of graph" if i + requested > last else None
        while target > i and step.consumer is not None and steps[target].issue > step.consumer:
            target -= 1
            reason = "a consumer of the result needs it earlier"
        anchor = steps[target].issue
        out.append(Delay((anchor, 1, i), anchor if target != i else None, target - i, reason))
    return out

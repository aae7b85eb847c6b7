"""The quick score: replay one grouping and schedule on a ``Profile`` without rewriting a graph.

It is ``overlapcfg.graph.schedule`` and ``overlapcfg.cost.simulator`` run on the profile's events instead of a
graph's nodes, with their own rules, not copies of them:

- grouping (``overlapcfg.tuning.merged.group``, once per grouping): each bucket's units merged per graph and kind
  (sizes and costs added, one latency), its all-gather waiting where its earliest unit waited, its reduce-scatter
  issued where its latest unit was; the steps numbered as the scheduler numbers them
  (``overlapcfg.graph.placement.in_schedule_order``);
- schedule (``score``, here, per candidate): every moved chain at the key the scheduler's placement rule gives it
  (``overlapcfg.graph.placement``), every other event at its own position; then the events in key order on the
  simulator's streams (``overlapcfg.cost.replay``), the fixed nodes between them run as prefix sums. Memory is
  replayed alongside: bytes in flight, and unsharded parameters alive.

Scoring a candidate is a sort of a few events per bucket: about a thousand candidates a second on a 32-layer
model, against seconds for a real ``apply`` + ``simulate``; the tuner re-checks its winner the slow way.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from overlapcfg.config.depths import depth_field
from overlapcfg.config.policy import IssueOrder
from overlapcfg.cost.replay import Memory, Streams
from overlapcfg.graph.placement import DelayedStep, GatherStep, SortKey, place_all_gathers, place_delayed
from overlapcfg.tuning.merged import GraphScore, Grouped, GroupedGraph

__all__ = ["Score", "Stall", "score"]


@dataclass(frozen=True, slots=True)
class Stall:
    """Compute waiting on a collective: in ``graph``, at ``at`` seconds into the step, for ``seconds``."""

    graph: str
    bucket: str
    kind: str
    at: float
    seconds: float


@dataclass(frozen=True, slots=True)
class Score:
    """What the quick model predicts for one candidate (the fields of ``Simulation`` it can derive)."""

    step_seconds: float
    exposed_comm_seconds: float
    compute_seconds: float
    comm_seconds: float
    peak_inflight_bytes: int
    peak_unsharded_param_bytes: int
    lower_bound_seconds: float
    unhidable_bound_seconds: float


# Event codes, in the order the simulator meets them at one key.
_ISSUE, _WAIT, _ALLOC, _FREE = range(4)
_first = operator.itemgetter(0)
"""An event's sort key."""


def score(grouped: Grouped, depths: Mapping[str, Sequence[int]], *, max_inflight_bytes: int | None,
          issue_order: IssueOrder = "gather_first", memory: bool = True, stalls: list[Stall] | None = None) -> Score:
    """Schedule ``grouped`` with per-bucket depths (``depths[field][bucket]``, by depth field) and replay it: each
    graph's all-gathers and reduce-scatters at the depth ``overlapcfg.config.depths.DEPTH_OF`` names for them.

    Each graph is replayed on its own and memoized on the grouping: the forward depends only on the forward
    depths and the cap, the backward only on its own knobs, so a grid over both replays each half once per value.
    ``memory=False`` skips the unsharded-parameter replay (``peak_unsharded_param_bytes`` is then 0): a search
    scores in bulk without it and re-scores what it shows. ``stalls`` (if given) receives every wait that blocked
    compute: where the step loses time.
    """
    parts = []
    for g in grouped.graphs:
        asked = (_asked(depths, g.profile.name, "all_gather", g.gathers_at),
                 _asked(depths, g.profile.name, "reduce_scatter", g.scatters_at))
        key = (*asked, max_inflight_bytes, issue_order if g.reduce_scatters else "", memory)
        part = g.cache.get(key) if stalls is None else None
        if part is None:
            part = _replay(g, grouped, *asked, max_inflight_bytes, issue_order, memory, stalls)
            g.cache[key] = part
        parts.append(part)
    return Score(step_seconds=sum(p.seconds for p in parts) + grouped.optimizer_seconds,
                 exposed_comm_seconds=sum(p.exposed_seconds for p in parts)
                 + grouped.optimizer_seconds - grouped.optimizer_compute,
                 compute_seconds=grouped.compute_seconds, comm_seconds=sum(grouped.comm_seconds.values()),
                 peak_inflight_bytes=max(p.peak_inflight_bytes for p in parts),
                 peak_unsharded_param_bytes=max(p.peak_unsharded_param_bytes for p in parts),
                 lower_bound_seconds=grouped.lower_bound_seconds,
                 unhidable_bound_seconds=grouped.unhidable_bound_seconds)


def _asked(depths: Mapping[str, Sequence[int]], graph: str, kind: str,
           steps: Sequence[GatherStep] | Sequence[DelayedStep]) -> tuple[int, ...]:
    """The depth each step asks for, in schedule order (none asked where the graph has no such step)."""
    if not steps:
        return ()
    name = depth_field(graph, kind)
    if name is None:
        raise AssertionError(f"tune: the {graph} graph has {kind} steps, which no depth schedules")  # a bug check
    values = depths[name]
    return tuple(values[s.bucket] for s in steps)


def _replay(g: GroupedGraph, grouped: Grouped, depths: Sequence[int], delays: Sequence[int], cap: int | None,
            issue_order: IssueOrder, memory: bool, stalls: list[Stall] | None) -> GraphScore:
    """One graph's events in key order on the simulator's streams (``overlapcfg.cost.replay``), the fixed
    compute between them run as prefix sums. ``depths`` and ``delays``: per step, in schedule order."""
    events = _events(g, depths, delays, cap, issue_order, memory)
    events.sort(key=_first)
    prefix = g.profile.prefix
    before, known = g.fixed_before, g.known_before
    streams, mem = Streams(grouped.skew), Memory()
    if g is not grouped.graphs[0]:  # as ``simulate``: the ranks drifted across the work before this graph
        streams.between_graphs(grouped.between_graphs_seconds)
    run, issue, wait = streams.run, streams.issue, streams.wait
    names, ranks = grouped.names, grouped.ranks
    done = 0
    for key, code, payload, bucket in events:
        n = known.get(key)
        if n is None:
            n = before(key)
        if n > done:
            run(prefix[n] - prefix[done])
            done = n
        # ``payload`` (typed Any: no ``cast`` call per event, a function call in the hottest loop): an _ISSUE or
        # _WAIT event carries its collective, a memory event its bytes.
        if code == _ISSUE:
            if payload.kind == "all_gather":
                issue(id(payload), payload.group, payload.seconds, issue_seconds=payload.issue_cost,
                      inflight_bytes=payload.cost_bytes, slowdown=payload.slowdown, ranks=ranks)
                if memory:
                    mem.alloc(payload.buffer_bytes, True)
            else:
                issue(id(payload), payload.group, payload.seconds, issue_seconds=payload.issue_cost,
                      slowdown=payload.slowdown, ranks=ranks)
        elif code == _WAIT:
            at = streams.t
            stall = wait(id(payload))
            if stall > 0 and stalls is not None:
                stalls.append(Stall(g.profile.name, names[bucket], payload.kind, at, stall))
            if payload.wait_cost:  # run(0.0) changes nothing: skipped, it is most waits
                run(payload.wait_cost)
            if memory and payload.kind == "all_gather":
                for nbytes, _ in payload.copies:
                    mem.alloc(nbytes, True)
                if payload.buffer_last < 0:
                    mem.free(payload.buffer_bytes, True)
        elif code == _ALLOC:
            mem.alloc(payload, True)
        else:
            mem.free(payload, True)
    run(prefix[-1] - prefix[done])
    return GraphScore(streams.end_graph(), streams.exposed, streams.peak_inflight, mem.peak_param if memory else 0)


def _events(g: GroupedGraph, depths: Sequence[int], delays: Sequence[int], cap: int | None, issue_order: IssueOrder,
            memory: bool) -> list[tuple[SortKey, int, Any, int]]:
    """Every moved chain at the key ``overlapcfg.graph.placement`` gives it, every other event at its own
    position, plus the memory events of fixed positions."""
    events: list[tuple[SortKey, int, Any, int]] = []
    placed = place_all_gathers(g.gathers_at, depths, cap, first_compute=g.profile.first_compute,
                               issue_order=issue_order, scatters=g.scatter_starts)
    for step, at, p in zip(g.all_gathers, g.gathers_at, placed, strict=True):
        bucket = at.bucket
        for m in step.collectives:
            # Not moved (a direction's first bucket, issued before any compute): each collective where it is.
            key: SortKey = (m.start, 0, 0, 0) if p.key is None else (*p.key, 0)
            events.append((key, _ISSUE, m, bucket))
            events.append(((m.wait, 0, 0, 0), _WAIT, m, bucket))
            if not memory:
                continue
            if m.buffer_last >= 0:
                events.append(((m.buffer_last, 0, 0, 2), _FREE, m.buffer_bytes, bucket))
            events += [((last, 0, 0, 2), _FREE, nbytes, bucket) for nbytes, last in m.copies]
    for scatter, delayed, d in zip(g.reduce_scatters, g.scatters_at, place_delayed(g.scatters_at, delays),
                                   strict=True):
        for m in scatter.collectives:
            events.append(((m.start, 0, 0, 0), _ISSUE, m, delayed.bucket))
            events.append(((*d.key, 0), _WAIT, m, delayed.bucket))
    for position, last, nbytes in g.profile.params if memory else ():
        events.append(((position, 0, 0, 1), _ALLOC, nbytes, -1))
        events.append(((last, 0, 0, 2), _FREE, nbytes, -1))
    return events

"""The grouping half of the quick score (``overlapcfg.tuning.quick``): a profile's units merged into buckets, once
per grouping, into what ``quick.score`` schedules.

``group``: each bucket's units merged per graph and kind (sizes and costs added, one latency, priced by
``overlapcfg.cost.price.collective_cost``), its all-gather waiting where its earliest unit waited, its reduce-scatter
issued where its latest unit was; the steps numbered as the scheduler numbers them
(``overlapcfg.graph.placement.in_schedule_order``). Kinds left unmerged (``OverlapPolicy.unmerged``) stay one
collective per traced collective. What no schedule of the grouping changes (compute with every chain's copies, each
stream's busy time, the communication no schedule hides) is worked out here once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from overlapcfg.cost.achievable import Skew
from overlapcfg.cost.price import collective_cost
from overlapcfg.cost.replay import NO_CONTENTION, Slowdown
from overlapcfg.graph.placement import DelayedStep, GatherStep, SortKey, in_schedule_order
from overlapcfg.tuning.profile import GraphProfile, Profile, UnitCollective

__all__ = ["GraphScore", "Grouped", "GroupedGraph", "Merged", "Step", "group"]


@dataclass(frozen=True, slots=True)
class Merged:
    """One bucket's collective of one kind and key in one graph: its units' records added up."""

    kind: str
    group: str
    cost_bytes: int
    traced_bytes: int
    seconds: float
    issue_cost: float
    """The copy-in chain's seconds plus the collective's own issue time (calibrated profiles), on the compute
    stream before the collective starts."""
    wait_cost: float
    start: float
    wait: float
    consumer: float | None
    buffer_bytes: int
    buffer_last: float
    """Where the buffer is freed: after the copy-out at the wait (-1), or after the last reader of a parameter
    left as a view of it."""
    copies: tuple[tuple[int, float], ...]
    """``(bytes, last reader)`` of each parameter copied out of the buffer (none for a lone parameter)."""
    slowdown: Slowdown = NO_CONTENTION
    """Its link's contention (``overlapcfg.cost.price.collective_cost``: its ``slowdown``)."""


At = TypeVar("At", GatherStep, DelayedStep)


@dataclass(frozen=True, slots=True)
class Step(Generic[At]):
    """The merged collectives of one bucket, one kind, in one graph, scheduled as a unit; ``at`` is the step as
    the placement rule (``overlapcfg.graph.placement``) sees it."""

    collectives: tuple[Merged, ...]
    at: At

    @property
    def bucket(self) -> int:
        return self.at.bucket


def _gather(bucket: int, name: str, collectives: Sequence[Merged]) -> Step[GatherStep]:
    """Issued where its earliest collective was; its bucket computes from the first wait."""
    return Step(tuple(collectives), GatherStep(bucket, name, sum(c.traced_bytes for c in collectives),
                                               min(c.start for c in collectives), min(c.wait for c in collectives)))


def _scatter(bucket: int, name: str, collectives: Sequence[Merged]) -> Step[DelayedStep]:
    """Issued where its latest unit was (each merged collective is); its result is first read at the consumer."""
    starts = [c.start for c in collectives]
    consumer = min((c.consumer for c in collectives if c.consumer is not None), default=None)
    return Step(tuple(collectives), DelayedStep(bucket, name, min(starts), max(starts), consumer))


def _in_schedule_order(steps: list[Step[At]]) -> tuple[Step[At], ...]:
    return tuple(step for _, step in in_schedule_order((s.at, s) for s in steps))


@dataclass(frozen=True, slots=True)
class GroupedGraph:
    """One graph of a grouping: its buckets' steps in scheduling order, and what no schedule changes."""

    profile: GraphProfile
    all_gathers: tuple[Step[GatherStep], ...]
    """In the order their buckets compute (first wait)."""
    reduce_scatters: tuple[Step[DelayedStep], ...]
    """In the order they are issued."""
    compute_seconds: float
    """Fixed compute plus every chain's copies: the same under every schedule of this grouping."""
    unhidable_seconds: float
    """The first all-gather's time beyond the compute that may run before its wait, plus the last
    reduce-scatter's beyond the compute that may run after its start: no schedule of this grouping hides them."""
    scatter_starts: tuple[float, ...]
    """Where each merged reduce-scatter is issued, ascending."""
    gathers_at: tuple[GatherStep, ...]
    """``all_gathers`` as the placement rule sees them."""
    scatters_at: tuple[DelayedStep, ...]
    """``reduce_scatters`` as the placement rule sees them."""
    cache: dict[tuple[object, ...], GraphScore] = field(default_factory=dict, compare=False, repr=False)
    """Replays already made, by the knobs this graph reads."""
    _before: dict[SortKey, int] = field(default_factory=dict, compare=False, repr=False)

    def fixed_before(self, key: SortKey) -> int:
        """How many fixed nodes run before an event at ``key`` (a fixed node at position p has key (p, 0, 0, 0)),
        memoized (``known_before``): a grouping's events fall on a few hundred positions."""
        n = self._before.get(key)
        if n is None:
            fixed = self.profile.fixed
            n = self.profile.fixed_before(key[0])
            if n < len(fixed) and fixed[n] == key[0] and key[1:] > (0, 0, 0):
                n += 1
            self._before[key] = n
        return n

    @property
    def known_before(self) -> dict[SortKey, int]:
        """``fixed_before``'s answers so far, by key: a replay looks a key up here before calling it."""
        return self._before


@dataclass(frozen=True, slots=True)
class Grouped:
    """A grouping of units into buckets, merged per graph: what ``score`` schedules."""

    names: tuple[str, ...]
    graphs: tuple[GroupedGraph, ...]
    comm_seconds: dict[str, float]
    """Busy time of each stream (process group): the same under every schedule."""
    skew: Skew | None = None
    """The profile's rank skew (``overlapcfg.cost.replay``), replayed with the ranks of the search."""
    ranks: int = 1
    optimizer_seconds: float = 0.0
    """The phase after the backward (``Profile.optimizer_seconds``): added to every schedule's step."""
    optimizer_compute: float = 0.0
    """Its compute; the rest is the gradient norm's all-reduce, exposed."""
    between_graphs_seconds: float = 0.0
    """The step's work between consecutive graphs, outside them (``Pricing.between_graphs_seconds``): every graph
    after the first starts with the ranks that much further apart."""

    @property
    def compute_seconds(self) -> float:
        return sum(g.compute_seconds for g in self.graphs) + self.optimizer_compute

    @property
    def lower_bound_seconds(self) -> float:
        """max(compute, busiest stream): no schedule of any kind beats it."""
        return max(self.compute_seconds, max(self.comm_seconds.values(), default=0.0))

    @property
    def unhidable_bound_seconds(self) -> float:
        """max(compute + what no schedule of this grouping can hide, busiest stream)."""
        return max(self.compute_seconds + sum(g.unhidable_seconds for g in self.graphs),
                   max(self.comm_seconds.values(), default=0.0))


@dataclass(frozen=True, slots=True)
class GraphScore:
    """One graph replayed from an idle start (each graph starts once every stream is idle, so graphs add up):
    ``quick.score``'s result per graph, memoized on its ``GroupedGraph``."""

    seconds: float
    exposed_seconds: float
    peak_inflight_bytes: int
    peak_unsharded_param_bytes: int


@functools.cache
def _stays_a_view(shape: tuple[int, ...], group_size: int, total: int) -> bool:
    """Whether the merge helpers' ``reshape`` of a parameter's slice of a bucket buffer holding ``total`` elements
    per rank is a view (else it copies). Asked of torch itself, on a meta tensor laid out like the buffer."""
    numel = math.prod(shape) // group_size
    piece = torch.empty((group_size, total), device="meta")[:, :numel]
    try:
        piece.view(shape)
    except RuntimeError:
        return False
    return True


def _merge(units: Sequence[UnitCollective], profile: Profile) -> Merged:
    first = units[0]
    nbytes = sum(u.cost_bytes for u in units)
    kind = first.kind
    params = [p for u in units for p in u.params]
    total = sum(p.numel for p in params) // first.group_size
    views = [p for p in params if _stays_a_view(p.shape, first.group_size, total)]
    copied = [p for p in params if p not in views]
    priced = collective_cost(kind, nbytes, profile.hardware, profile.world_size)
    return Merged(
        kind=kind, group=first.group, cost_bytes=nbytes, traced_bytes=sum(u.traced_bytes for u in units),
        seconds=priced.seconds, issue_cost=sum(u.issue_cost for u in units) + priced.issue_seconds,
        wait_cost=sum(u.wait_cost for u in units) + sum(p.copy_seconds for p in copied),
        start=(max if kind == "reduce_scatter" else min)(u.start for u in units),
        wait=min(u.wait for u in units),
        consumer=min((u.consumer for u in units if u.consumer is not None), default=None),
        buffer_bytes=sum(u.buffer_bytes for u in units),
        buffer_last=max(p.last_reader for p in views) if views else -1.0,
        copies=tuple((p.bytes, p.last_reader) for p in copied),
        slowdown=priced.slowdown)


def _as_traced(units: Sequence[UnitCollective], profile: Profile) -> list[Merged]:
    """An unmerged kind (``OverlapPolicy.unmerged``): each traced collective of the units on its own, with the
    traced nodes of its chains only (no copy into or out of a bucket buffer); an all-gather's output is the
    parameter itself, alive until that parameter's last reader."""
    out = []
    for u in units:
        sources = u.sources or ((u.cost_bytes, u.traced_bytes),)
        lasts = [p.last_reader for p in u.params]
        for i, (cost_bytes, traced_bytes) in enumerate(sources):
            last = lasts[i] if len(lasts) == len(sources) else max(lasts, default=-1.0)
            priced = collective_cost(u.kind, cost_bytes, profile.hardware, profile.world_size)
            out.append(Merged(
                kind=u.kind, group=u.group, cost_bytes=cost_bytes, traced_bytes=traced_bytes,
                seconds=priced.seconds, issue_cost=(u.raw_issue_cost if i == 0 else 0.0) + priced.issue_seconds,
                wait_cost=u.raw_wait_cost if i == 0 else 0.0, start=u.start, wait=u.wait, consumer=u.consumer,
                buffer_bytes=cost_bytes if u.kind == "all_gather" else 0,
                buffer_last=last if u.kind == "all_gather" else -1.0, copies=(), slowdown=priced.slowdown))
    return out


def group(profile: Profile, unit_bucket: Sequence[int], names: Sequence[str],
          unmerged: Collection[str] = ()) -> Grouped:
    """Merge ``profile``'s units into buckets: ``unit_bucket[u]`` is the bucket of unit ``u``; kinds in
    ``unmerged`` stay one collective per traced collective (``OverlapPolicy.unmerged``)."""
    if len(unit_bucket) != len(profile.units):
        raise AssertionError(f"tune: {len(unit_bucket)} bucket indices for {len(profile.units)} units")
    graphs = []
    busy: dict[str, float] = {}
    for g in profile.graphs:
        by_key: dict[tuple[int, str, str], list[UnitCollective]] = {}
        for c in g.collectives:
            by_key.setdefault((unit_bucket[c.unit], c.kind, c.key), []).append(c)
        steps: dict[tuple[str, int], list[Merged]] = {}
        for (bucket, kind, _), units in by_key.items():
            for merged in (_as_traced(units, profile) if kind in unmerged else [_merge(units, profile)]):
                steps.setdefault((kind, bucket), []).append(merged)
                busy[merged.group] = busy.get(merged.group, 0.0) + merged.seconds
        gathers = _in_schedule_order([_gather(b, names[b], ms) for (k, b), ms in steps.items() if k == "all_gather"])
        scatters = _in_schedule_order([_scatter(b, names[b], ms) for (k, b), ms in steps.items()
                                       if k == "reduce_scatter"])
        merged_steps: list[Step[GatherStep] | Step[DelayedStep]] = [*gathers, *scatters]
        chains = sum(c.issue_cost + c.wait_cost for s in merged_steps for c in s.collectives)
        compute = g.prefix[-1] + chains
        hidden = _unhidable(g, gathers, scatters)
        graphs.append(GroupedGraph(g, gathers, scatters, compute, hidden,
                                   tuple(sorted(m.start for s in scatters for m in s.collectives)),
                                   tuple(s.at for s in gathers), tuple(s.at for s in scatters)))
    between = profile.pricing.between_graphs_seconds if profile.pricing is not None else None
    return Grouped(tuple(names), tuple(graphs), busy, profile.hardware.skew, profile.world_size,
                   profile.optimizer_seconds, profile.optimizer_compute, between or 0.0)


def _unhidable(g: GraphProfile, gathers: Sequence[Step[GatherStep]], scatters: Sequence[Step[DelayedStep]]) -> float:
    """Communication no schedule of this grouping hides: the first all-gather beyond everything that could run
    before its wait (fixed compute there, and the copy-ins of every other all-gather, which prefetching may move
    there), and the last reduce-scatter beyond everything that could run after its start (fixed compute there,
    the other reduce-scatters' wait chains, and the all-gathers waited there). The graph cannot start computing
    before the one, nor end before the other; each graph starts once the previous one's streams are idle."""
    out = 0.0
    if gathers:
        first = gathers[0]
        before = g.compute_between(float("-inf"), first.at.wait) + sum(
            c.issue_cost for s in gathers[1:] for c in s.collectives)
        out += max(0.0, sum(c.seconds for c in first.collectives) - before)
    if scatters:
        last = scatters[-1]
        issued = last.at.issue
        after = g.compute_between(issued, float("inf")) + sum(
            c.wait_cost for s in scatters[:-1] for c in s.collectives) + sum(
            c.issue_cost + c.wait_cost for s in gathers if s.at.wait > issued for c in s.collectives)
        out += max(0.0, sum(c.seconds for c in last.collectives) - after)
    return out

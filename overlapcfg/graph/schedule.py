"""The manual scheduler: place each bucket's merged collectives at the depth its policy asks for.

It does not move compute. It gives every node a sort key (its position) and re-keys only collective chains,
then emits the graph in key order subject to data dependencies (Kahn's algorithm on a heap of keys), so the
result is a topological order by construction and identical on every rank.

Where each bucket's collectives go (depths, caps, issue order, with examples) is ``overlapcfg.graph.placement``,
the rule the tuner's quick model replays too. This module reads the graph for it (steps, their positions, the
first compute, the readers of a reduce-scatter's result) and applies what it returns: a step's start chain is its
start and the copy-in feeding only it (``exclusive_ancestors``), a wait chain the waits and what reads only them
(``exclusive_descendants``).

HSDP all-reduces (the replicate-group half of a gradient's reduction, chained with its reduce-scatter in
either order) are placed like reduce-scatters with ``all_reduce_delay``; whichever half of a chain comes second
is issued as soon as its input is ready (right after the first half's wait), so the two delays add up::

    AR -> RS, both delays 1:  c1 ar1 c0 ar0 w(ar1) rs1 w(ar0) rs0 w(rs1) w(rs0)

Every placement is also a hard ordering edge of the emission below, so a requested delay is never cut short by
a chained start that is emitted later than its original position. In-place writes (a whole-step graph's
optimizer) are ordered against the reads of what they write, for emission only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from overlapcfg.config.policy import IssueOrder
from overlapcfg.graph import placement
from overlapcfg.graph.collectives import positions
from overlapcfg.graph.merge import MergedCollective
from overlapcfg.graph.ops import is_collective_start, is_compute_node, may_alias_input, node_direction, written_inputs
from overlapcfg.graph.placement import SortKey
from overlapcfg.graph.record import DepthDecision
from overlapcfg.kinds import Direction
from overlapcfg.resolve import ResolvedPlan

__all__ = ["ScheduleResult", "Step", "exclusive_ancestors", "exclusive_descendants", "schedule_manual"]


@dataclass(frozen=True, slots=True)
class Step:
    """The merged collectives of one bucket in one direction and kind, scheduled as a unit."""

    bucket: int
    direction: Direction
    kind: str
    collectives: tuple[MergedCollective, ...]

    @property
    def unsharded_bytes(self) -> int:
        return sum(c.unsharded_bytes for c in self.collectives)


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    decisions: tuple[DepthDecision, ...]
    overlap_deps: tuple[tuple[fx.Node, tuple[fx.Node, ...]], ...]
    """``(node, must-run-after)`` pairs, for ``insert_overlap_deps``; graph order."""


def _steps(merged: Sequence[MergedCollective], kind: str, direction: Direction) -> list[Step]:
    """One step per bucket, in the order of ``merged`` (``overlapcfg.graph.placement`` numbers them)."""
    by_bucket: dict[int, list[MergedCollective]] = {}
    for m in merged:
        if m.kind == kind and m.direction == direction:
            by_bucket.setdefault(m.bucket, []).append(m)
    return [Step(b, direction, kind, tuple(ms)) for b, ms in by_bucket.items()]


def exclusive_ancestors(start: fx.Node, index: dict[fx.Node, int]) -> list[fx.Node]:
    """``start`` and the computed nodes that feed only it (the copy-in of a merged all-gather), graph order."""
    chain = {start}
    heap = [(-index[n], n.name, n) for n in start.all_input_nodes]
    heapq.heapify(heap)
    seen = set()
    while heap:
        _, _, node = heapq.heappop(heap)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if all(u in chain for u in node.users):
            chain.add(node)
            for inp in node.all_input_nodes:
                heapq.heappush(heap, (-index[inp], inp.name, inp))
    return sorted(chain, key=index.__getitem__)


def exclusive_descendants(waits: Sequence[fx.Node], index: dict[fx.Node, int]) -> list[fx.Node]:
    """The waits and the nodes that read only them, breadth first from the waits (siblings in graph order), up to
    but not including another collective's start (an HSDP chain's second half is placed on its own).

    Breadth-first, not graph order: a moved chain is emitted in this order, as upstream's
    ``_collect_nodes_must_be_after`` moves it. The two differ once the chain holds nodes that predate the merge,
    such as the per-parameter casts after a bf16 reduce-scatter of fp32 shards (``reduce_dtype`` = bf16)::

        graph order:    wait split view_a view_b cast(view_b) cast(view_a)   (the casts' original order)
        breadth-first:  wait split view_a view_b cast(view_a) cast(view_b)   (the merged buffer's layout)
    """
    chain = set(waits)
    queue = sorted(waits, key=index.__getitem__)
    i = 0
    while i < len(queue):
        for user in sorted(queue[i].users, key=index.__getitem__):
            if user.op != "output" and user not in chain and not is_collective_start(user) \
                    and all(x in chain for x in user.all_input_nodes):
                chain.add(user)
                queue.append(user)
        i += 1
    return queue


def _depth(plan: ResolvedPlan, step: Step) -> int:
    """The depth the step's bucket asks for its direction and kind (``overlapcfg.config.depths.DEPTH_OF``)."""
    return plan.buckets[step.bucket].depth(step.direction, step.kind)


def schedule_manual(gm: fx.GraphModule, plan: ResolvedPlan, merged: Sequence[MergedCollective],
                    max_inflight_bytes: int | None, issue_order: IssueOrder = "gather_first") -> ScheduleResult:
    """Reorder ``gm.graph`` in place; the caller lints and recompiles."""
    graph = gm.graph
    nodes = list(graph.nodes)
    index = positions(graph)
    keys: dict[fx.Node, SortKey] = {n: (i, 0, 0, 0) for n, i in index.items()}
    deps: dict[fx.Node, list[fx.Node]] = {}
    records: list[DepthDecision] = []
    directions = {m.direction for m in merged if m.kind == "all_gather"}
    chained = _chained_starts(merged, index)
    # A reduce-scatter chained after an HSDP all-reduce is issued when that all-reduce's (delayed) wait is done,
    # not at its position here: tying a prefetch to it could close a cycle through the delay.
    scatters = sorted(index[m.start] for m in merged if m.kind == "reduce_scatter" and m.start not in chained)
    for direction in ("forward", "backward"):
        steps = _steps(merged, "all_gather", direction)
        # A joint graph holds both directions: the first backward bucket is hoisted before the first backward
        # compute, not to the start of the forward. In aot's separate graphs (one direction each), as upstream:
        # before the graph's first compute node.
        first_compute = next((n for n in graph.nodes if is_compute_node(n)
                              and (len(directions) < 2 or node_direction(n) == direction)), None)
        records += _place_all_gathers(plan, steps, max_inflight_bytes, nodes, index, first_compute, keys, deps,
                                      issue_order, scatters)
    for kind in ("reduce_scatter", "all_reduce"):
        records += _place_delayed(plan, _steps(merged, kind, "backward"), nodes, index, keys, deps, chained)
    for start in chained:  # the second half of an HSDP chain: issued as soon as the first half's result is ready
        keys[start] = (-1, 0, 0, index[start])
    _reorder(graph, keys, deps, _writes_in_place(graph, index))
    order = positions(graph)
    overlap_deps = tuple(sorted(((n, tuple(d)) for n, d in deps.items()), key=lambda item: order[item[0]]))
    return ScheduleResult(tuple(records), overlap_deps)


def _place_all_gathers(plan: ResolvedPlan, steps: Sequence[Step], cap: int | None, nodes: Sequence[fx.Node],
                       index: dict[fx.Node, int], first_compute: fx.Node | None, keys: dict[fx.Node, SortKey],
                       deps: dict[fx.Node, list[fx.Node]], issue_order: IssueOrder,
                       scatters: Sequence[int]) -> tuple[DepthDecision, ...]:
    """Key each step's start chain where ``overlapcfg.graph.placement`` places it, its dependencies as edges;
    ``scatters``: the reduce-scatter starts' positions, ascending."""
    if not steps:
        return ()
    ordered = placement.in_schedule_order(
        (placement.GatherStep(s.bucket, plan.buckets[s.bucket].name, s.unsharded_bytes,
                              min(index[c.start] for c in s.collectives),
                              min(index[w] for c in s.collectives for w in c.waits)), s) for s in steps)
    placed, steps = [a for a, _ in ordered], [s for _, s in ordered]
    depths = [_depth(plan, s) for s in steps]
    placements = placement.place_all_gathers(placed, depths, cap, issue_order=issue_order, scatters=scatters,
                                             first_compute=None if first_compute is None else index[first_compute])
    for step, p in zip(steps, placements, strict=True):
        if p.key is None:
            continue
        for c in step.collectives:
            for node in exclusive_ancestors(c.start, index):
                keys[node] = (*p.key, index[node])
            if p.after is not None:
                deps.setdefault(c.start, []).append(nodes[int(p.after)])
            if p.before is not None:
                deps.setdefault(nodes[int(p.before)], []).append(c.start)
    return placement.all_gather_decisions(placed, depths, cap, steps[0].direction)


def _chained_starts(merged: Sequence[MergedCollective], index: dict[fx.Node, int]) -> set[fx.Node]:
    """Starts of merged backward collectives that read another merged collective's result (the second half of an
    HSDP chain: the reduce-scatter after an all-reduce, or the all-reduce after a reduce-scatter)."""
    waits = {w: m for m in merged if m.direction == "backward" and m.kind != "all_gather" for w in m.waits}
    chained: set[fx.Node] = set()
    for m in merged:
        if m.direction != "backward" or m.kind == "all_gather":
            continue
        for node in exclusive_ancestors(m.start, index):
            for inp in node.all_input_nodes:
                found = _first_wait_above(inp, waits)
                if found is not None and found is not m:
                    chained.add(m.start)
    return chained


def _first_wait_above(node: fx.Node, waits: dict[fx.Node, MergedCollective]) -> MergedCollective | None:
    """The merged collective whose wait ``node`` is, or is read from through single-input ops (split, views)."""
    for _ in range(8):
        if node in waits:
            return waits[node]
        if node.op != "call_function" or len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    return None


def _place_delayed(plan: ResolvedPlan, steps: Sequence[Step], nodes: Sequence[fx.Node], index: dict[fx.Node, int],
                   keys: dict[fx.Node, SortKey], deps: dict[fx.Node, list[fx.Node]],
                   chained: set[fx.Node]) -> list[DepthDecision]:
    """Key each step's wait chain where ``overlapcfg.graph.placement`` places it (reduce-scatters with
    ``reduce_scatter_delay``, HSDP all-reduces with ``all_reduce_delay``). A chained start that reads the result
    is not a consumer that needs it early: it is issued right after, wherever that is."""
    chains = {s.bucket: [exclusive_descendants(c.waits, index) for c in s.collectives] for s in steps}
    unordered = []
    for step in steps:
        members = {n for chain in chains[step.bucket] for n in chain}
        outside = [index[u] for n in members for u in n.users
                   if u.op != "output" and u not in members and u not in chained]
        starts = [index[c.start] for c in step.collectives]
        unordered.append((placement.DelayedStep(step.bucket, plan.buckets[step.bucket].name, min(starts),
                                                max(starts), min(outside) if outside else None), step))
    ordered = placement.in_schedule_order(unordered)
    placed, steps = [a for a, _ in ordered], [s for _, s in ordered]
    requested = [_depth(plan, s) for s in steps]
    records: list[DepthDecision] = []
    for i, (step, p) in enumerate(zip(steps, placement.place_delayed(placed, requested), strict=True)):
        # A delayed chain is moved as a block in breadth-first order; one left after its own start keeps graph
        # order (upstream moves only delayed waits, so both match ``manual_overlap_bucketing`` at d = 1).
        moved = [n for chain in chains[step.bucket] for n in chain]
        rank = {n: r for r, n in enumerate(moved)} if p.after is not None else index
        for node in moved:
            keys[node] = (*p.key, rank[node])
        if p.after is not None:
            for c in step.collectives:
                deps.setdefault(c.waits[0], []).append(nodes[int(p.after)])
        records.append(_decision(plan.buckets[step.bucket].name, "backward", step.kind, i, requested[i],
                                  p.effective, 0, p.reason))
    return records


def _writes_in_place(graph: fx.Graph, index: dict[fx.Node, int]) -> dict[fx.Node, list[fx.Node]]:
    """``(node, must-run-after)`` edges ordering every in-place write after the reads of its target that came
    before it, and before those after it (graph order).

    A whole-step graph with the optimizer traced in updates the parameters and the optimizer's moments in place
    (``_foreach_addcdiv_(params, ...)``); data edges alone would let a read of a parameter move past the update of
    that parameter. Reads are the other users of the written node and of the nodes whose storage it shares (views
    of a graph input, an in-place op's result). Emission only: these are not overlap decisions, so they are not
    handed to ``insert_overlap_deps`` (inductor orders mutations itself).
    """
    edges: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        written = written_inputs(node) if node.op == "call_function" else ()
        for target in written:
            aliases = [target, *(u for u in target.users if may_alias_input(u))]
            readers = sorted({u for a in aliases for u in a.users} - {node}, key=index.__getitem__)
            for reader in readers:
                if reader.op == "output":
                    continue
                if index[reader] < index[node]:
                    edges.setdefault(node, []).append(reader)
                else:
                    edges.setdefault(reader, []).append(node)
    return edges


def _reorder(graph: fx.Graph, keys: dict[fx.Node, SortKey], deps: dict[fx.Node, list[fx.Node]],
             writes: dict[fx.Node, list[fx.Node]] | None = None) -> None:
    """Emit nodes by smallest key among those whose inputs and ``deps`` / ``writes`` (must-run-after) are placed: a
    stable, deterministic topological sort in which every placement decision also holds as an edge."""
    nodes = list(graph.nodes)
    writes = writes or {}
    must: dict[fx.Node, set[fx.Node]] = {}  # only the few nodes with ordering edges: one set per node is 12k sets
    for n in dict.fromkeys([*deps, *writes]):
        edges = {*deps.get(n, ()), *writes.get(n, ())} - set(n.all_input_nodes)
        if edges:
            must[n] = edges
    pending = dict.fromkeys(nodes, 0)  # inputs not yet placed: each input lists its reader once among its users
    for n in nodes:
        for user in n.users:
            pending[user] += 1
    after: dict[fx.Node, list[fx.Node]] = {}
    for node, befores in must.items():
        pending[node] += len(befores)
        for before in befores:
            after.setdefault(before, []).append(node)
    heap = [(keys[n], n.name, n) for n in nodes if pending[n] == 0]
    heapq.heapify(heap)
    order: list[fx.Node] = []
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        node = pop(heap)[2]
        order.append(node)
        for users in (node.users, after.get(node, ())):
            for user in users:
                left = pending[user] - 1
                pending[user] = left
                if not left:
                    push(heap, (keys[user], user.name, user))
    if len(order) != len(nodes):
        raise AssertionError(f"overlapcfg scheduler: {len(nodes) - len(order)} nodes left unplaced (a cycle?)")
    placeholders = [n for n in order if n.op == "placeholder"]
    rest = [n for n in order if n.op not in ("placeholder", "output")]
    cursor = placeholders[-1] if placeholders else None
    if cursor is None:
        first = rest[0] if rest else None
        if first is None:
            return
        graph_first = next(iter(graph.nodes))
        if graph_first is not first:
            graph_first.prepend(first)
        cursor, rest = first, rest[1:]
    for node in rest:
        if cursor.next is not node:
            cursor.append(node)
        cursor = node


def _decision(bucket: str, direction: str, kind: str, position: int, requested: int, effective: int,
              inflight_bytes: int, reason: str | None = None) -> DepthDecision:
    return DepthDecision(bucket=bucket, direction=direction, kind=kind, position=position, requested=requested,
                         effective=effective, inflight_bytes=inflight_bytes, reason=reason)

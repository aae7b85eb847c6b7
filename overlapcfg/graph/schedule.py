"""The manual scheduler: place each bucket's merged collectives at the depth its policy asks for.

It does not move compute. It gives every node a sort key (its position) and re-keys only collective chains,
then emits the graph in key order subject to data dependencies (Kahn's algorithm on a heap of keys), so the
result is a topological order by construction and identical on every rank.

Forward all-gathers, ``forward_prefetch = 1`` (as torch's ``manual_overlap_bucketing``)::

    before: ag0 w0 c0 ag1 w1 c1 ag2 w2 c2        after: ag0 ag1 w0 c0 ag2 w1 c1 w2 c2

with ``k = 2``: ``ag0 ag1 ag2 w0 c0 w1 c1 w2 c2``; ``k = 0``: each ``ag_i`` right before ``w_i``. The first
bucket of each direction has nothing before it to prefetch it: unless its own depth is 0, it is issued before
the graph's first compute node (as upstream does), or where the graph issues it if that is earlier.
Backward all-gathers run the same in backward order. Reduce-scatters, ``reduce_scatter_delay = 1``::

    before: c2 rs2 w2 c1 rs1 w1 c0 rs0 w0          after: c2 rs2 c1 rs1 w2 c0 rs0 w1 w0

HSDP all-reduces (the replicate-group half of a gradient's reduction, chained with its reduce-scatter in
either order) are placed like reduce-scatters with ``all_reduce_delay``; whichever half of a chain comes second
is issued as soon as its input is ready (right after the first half's wait), so the two delays add up::

    AR -> RS, both delays 1:  c1 ar1 c0 ar0 w(ar1) rs1 w(ar0) rs0 w(rs1) w(rs0)

Every placement is also a hard ordering edge of the emission below, so a requested delay is never cut short by
a chained start that is emitted later than its original position.

A ``max_inflight_bytes`` cap lowers the all-gather reach where the unsharded bytes issued but not yet waited
would exceed it; the step record says where and why.

Issue order: the starts of each kind (all-gather, reduce-scatter) keep their relative order within a process
group, so every rank issues the same sequence; a prefetched all-gather may overtake a reduce-scatter issued
before it in the original graph, as in upstream's schedule. One stream serves both kinds in issue order, so an
all-gather prefetched far ahead delays every reduce-scatter issued after it. ``issue_order="reduce_scatter_first"``
issues an all-gather two or more buckets ahead of its issuer just after the next reduce-scatter start instead,
when that start comes before the previous bucket's wait (backward, ``k = 2``; ``ag3`` waits for ``rs1``)::

    gather_first:          ag3 w1 c1 rs1 ag4 w2 c2 rs2 ...
    reduce_scatter_first:  w1 c1 rs1 ag3 w2 c2 rs2 ag4 ...

Depth-1 graphs have no such all-gather and are the same under both orders.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from overlapcfg.config.policy import IssueOrder
from overlapcfg.graph.collectives import positions
from overlapcfg.graph.merge import MergedCollective
from overlapcfg.graph.ops import is_collective_start, is_compute_node, may_alias_input, node_direction, written_inputs
from overlapcfg.graph.reach import prefetch_reach
from overlapcfg.graph.record import DepthDecision, Direction
from overlapcfg.resolve import ResolvedPlan

__all__ = ["ScheduleResult", "Step", "exclusive_ancestors", "schedule_manual"]

Key = tuple[int, int, int, int]


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


def _steps(merged: Sequence[MergedCollective], kind: str, direction: Direction,
           index: dict[fx.Node, int]) -> list[Step]:
    by_bucket: dict[int, list[MergedCollective]] = {}
    for m in merged:
        if m.kind == kind and m.direction == direction:
            by_bucket.setdefault(m.bucket, []).append(m)
    # All-gathers in the order their buckets compute (first wait); reduce-scatters in the order they are issued.
    def anchor(ms: list[MergedCollective]) -> int:
        return min(index[w] for m in ms for w in m.waits) if kind == "all_gather" else min(index[m.start]
                                                                                            for m in ms)
    ordered = sorted(by_bucket.items(), key=lambda item: anchor(item[1]))
    return [Step(b, direction, kind, tuple(ms)) for b, ms in ordered]


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


def _exclusive_descendants(waits: Sequence[fx.Node], index: dict[fx.Node, int]) -> list[fx.Node]:
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
    bucket = plan.buckets[step.bucket]
    if step.kind == "reduce_scatter":
        return bucket.reduce_scatter_delay
    if step.kind == "all_reduce":
        return bucket.all_reduce_delay
    return bucket.forward_prefetch if step.direction == "forward" else bucket.backward_prefetch


def _all_gather_reach(plan: ResolvedPlan, steps: Sequence[Step],
                      cap: int | None) -> tuple[tuple[int, ...], tuple[DepthDecision, ...]]:
    """``reach[i]``: the last step issued by the time step i waits (``overlapcfg.graph.reach``)."""
    if not steps:
        return (), ()
    return prefetch_reach([plan.buckets[s.bucket].name for s in steps], [_depth(plan, s) for s in steps],
                          [s.unsharded_bytes for s in steps], cap, steps[0].direction)


def schedule_manual(gm: fx.GraphModule, plan: ResolvedPlan, merged: Sequence[MergedCollective],
                    max_inflight_bytes: int | None, issue_order: IssueOrder = "gather_first") -> ScheduleResult:
    """Reorder ``gm.graph`` in place; the caller lints and recompiles."""
    graph = gm.graph
    index = positions(graph)
    keys: dict[fx.Node, Key] = {n: (i, 0, 0, 0) for n, i in index.items()}
    deps: dict[fx.Node, list[fx.Node]] = {}
    records: list[DepthDecision] = []
    directions = {m.direction for m in merged if m.kind == "all_gather"}
    chained = _chained_starts(merged, index)
    for direction in ("forward", "backward"):
        steps = _steps(merged, "all_gather", direction, index)
        # A joint graph holds both directions: the first backward bucket is hoisted before the first backward
        # compute, not to the start of the forward. In aot's separate graphs (one direction each), as upstream:
        # before the graph's first compute node.
        first_compute = next((n for n in graph.nodes if is_compute_node(n)
                              and (len(directions) < 2 or node_direction(n) == direction)), None)
        # A reduce-scatter chained after an HSDP all-reduce is issued when that all-reduce's (delayed) wait is
        # done, not at its position here: tying a prefetch to it could close a cycle through the delay.
        scatters = sorted((m.start for m in merged if m.kind == "reduce_scatter" and m.start not in chained),
                          key=index.__getitem__) if issue_order == "reduce_scatter_first" else []
        records += _place_all_gathers(plan, steps, max_inflight_bytes, index, first_compute, keys, deps, scatters)
    for kind in ("reduce_scatter", "all_reduce"):
        records += _place_delayed(plan, _steps(merged, kind, "backward", index), index, keys, deps, chained)
    for start in chained:  # the second half of an HSDP chain: issued as soon as the first half's result is ready
        keys[start] = (-1, 0, 0, index[start])
    _reorder(graph, keys, deps, _writes_in_place(graph, index))
    order = positions(graph)
    overlap_deps = tuple(sorted(((n, tuple(d)) for n, d in deps.items()), key=lambda item: order[item[0]]))
    return ScheduleResult(tuple(records), overlap_deps)


def _place_all_gathers(plan: ResolvedPlan, steps: Sequence[Step], cap: int | None, index: dict[fx.Node, int],
                       first_compute: fx.Node | None, keys: dict[fx.Node, Key],
                       deps: dict[fx.Node, list[fx.Node]], scatters: Sequence[fx.Node] = ()) -> list[DepthDecision]:
    """Key each step's start chain just before the wait of the first step whose reach covers it. With
    ``scatters`` (reduce-scatter starts in graph order, ``issue_order="reduce_scatter_first"``), a step reached two
    or more buckets ahead is keyed instead just after the first of those reduce-scatters issued between that wait
    and the previous step's wait, if there is one: still a bucket ahead of its own wait."""
    reach, records = _all_gather_reach(plan, steps, cap)
    issuer = 0
    for j, step in enumerate(steps):
        while reach[issuer] < j:  # reach is monotone and reach[j] >= j, so this stops at j at the latest
            issuer += 1
        if j == 0 and _depth(plan, step) > 0:
            # Nothing earlier prefetches it: issue it before the graph's first compute, as upstream does.
            anchor = first_compute
            if anchor is None or index[anchor] > min(index[c.start] for c in step.collectives):
                continue
        else:
            anchor = min((w for c in steps[issuer].collectives for w in c.waits), key=index.__getitem__)
            if j > issuer + 1 and scatters:
                previous = min((w for c in steps[j - 1].collectives for w in c.waits), key=index.__getitem__)
                later = [s for s in scatters if index[anchor] < index[s] < index[previous]]
                if later:  # after that reduce-scatter on the stream, and still a bucket ahead of its own wait
                    for c in step.collectives:
                        for node in exclusive_ancestors(c.start, index):
                            keys[node] = (index[later[0]], 0, 1 + j, index[node])
                        deps.setdefault(c.start, []).append(later[0])
                    continue
        for c in step.collectives:
            for node in exclusive_ancestors(c.start, index):
                keys[node] = (index[anchor], -1, j, index[node])
            if issuer != j:
                deps.setdefault(anchor, []).append(c.start)
    return list(records)


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


def _place_delayed(plan: ResolvedPlan, steps: Sequence[Step], index: dict[fx.Node, int], keys: dict[fx.Node, Key],
                   deps: dict[fx.Node, list[fx.Node]], chained: set[fx.Node]) -> list[DepthDecision]:
    """Key each step's wait chain just after the start of the step ``d`` later (sooner if a consumer needs it);
    reduce-scatters with ``reduce_scatter_delay``, HSDP all-reduces with ``all_reduce_delay``. A chained start
    that reads the result is not a consumer that needs it early: it is issued right after, wherever that is."""
    records: list[DepthDecision] = []
    last = len(steps) - 1

    def issue_point(step: Step) -> fx.Node:
        return max((c.start for c in step.collectives), key=index.__getitem__)

    for i, step in enumerate(steps):
        requested = _depth(plan, step)
        target = min(i + requested, last)
        chains = [_exclusive_descendants(c.waits, index) for c in step.collectives]
        members = {n for chain in chains for n in chain}
        outside = [index[u] for n in members for u in n.users
                   if u.op != "output" and u not in members and u not in chained]
        reason = "end of graph" if i + requested > last else None
        while target > i and outside and index[issue_point(steps[target])] > min(outside):
            target -= 1
            reason = "a consumer of the result needs it earlier"
        anchor = issue_point(steps[target])
        # A delayed chain is moved as a block in breadth-first order; one left after its own start keeps graph
        # order (upstream moves only delayed waits, so both match ``manual_overlap_bucketing`` at d = 1).
        moved = [n for chain in chains for n in chain]
        rank = {n: r for r, n in enumerate(moved)} if target != i else index
        for node in moved:
            keys[node] = (index[anchor], 1, i, rank[node])
        if target != i:
            for c in step.collectives:
                deps.setdefault(c.waits[0], []).append(anchor)
        records.append(_decision(plan.buckets[step.bucket].name, "backward", step.kind, i, requested,
                                  target - i, 0, reason))
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


def _reorder(graph: fx.Graph, keys: dict[fx.Node, Key], deps: dict[fx.Node, list[fx.Node]],
             writes: dict[fx.Node, list[fx.Node]] | None = None) -> None:
    """Emit nodes by smallest key among those whose inputs and ``deps`` / ``writes`` (must-run-after) are placed: a
    stable, deterministic topological sort in which every placement decision also holds as an edge."""
    nodes = list(graph.nodes)
    must = {n: {*deps.get(n, ()), *(writes or {}).get(n, ())} - set(n.all_input_nodes) for n in nodes}
    pending = {n: len(n.all_input_nodes) + len(must[n]) for n in nodes}
    after: dict[fx.Node, list[fx.Node]] = {}
    for node, befores in must.items():
        for before in befores:
            after.setdefault(before, []).append(node)
    heap = [(keys[n], n.name, n) for n in nodes if pending[n] == 0]
    heapq.heapify(heap)
    order: list[fx.Node] = []
    while heap:
        _, _, node = heapq.heappop(heap)
        order.append(node)
        for user in (*node.users, *after.get(node, ())):
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(heap, (keys[user], user.name, user))
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

"""The bucketer: merge the FSDP collectives of each bucket into one collective per (direction, kind, group key).

Each group of collectives is replaced by the trace of its merge function (``overlapcfg.graph.bucket_fns``: copy-in,
one collective, its wait, copy-out), spliced in where ``manual_overlap_bucketing`` places upstream's merge
(``overlapcfg.graph.stamp``): at depth 1 the graph is, on torch 2.13, upstream's node for node, and on every
supported release it is the graph torch 2.13's bucketing emits (``tests/graph/test_merge_across_releases.py``).
Traces are kept by signature: identical layers trace once, for every graph, config and capture of the same shapes
(another capture's stamps get fake values of its own mode). Written by overlapcfg; upstream's pass is the
reference its output is compared with, not its source.

Before (one bucket, two parameters)::

    ag_a -> wait_a -> use_a ... ag_b -> wait_b -> use_b

After::

    pre_bucket_all_gather(a, b) -> ag_ab -> wait_ab -> split -> use_a ... use_b
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.config.policy import BucketMode
from overlapcfg.graph.bucket_fns import bucket_dtype, group_key, group_name_of, merge_fn
from overlapcfg.graph.collectives import Collective, positions
from overlapcfg.graph.meta import MergedMark, mark_merged
from overlapcfg.graph.ops import started_by
from overlapcfg.graph.stamp import populate_meta, sort_region, splice, traces_used
from overlapcfg.kinds import CollectiveKind, Direction
from overlapcfg.resolve import ResolvedPlan

__all__ = ["MergedCollective", "attribute", "fold_repeated_waits", "merge_buckets"]

logger = logging.getLogger(__name__)

_INHERITED_META = ("autograd_backward", "partitioner_tag")


@dataclass(frozen=True, slots=True)
class MergedCollective:
    """One collective after bucketing: the bucket it serves and the original collectives it replaced."""

    bucket: int
    """Index into ``ResolvedPlan.buckets``."""
    direction: Direction
    kind: CollectiveKind
    start: fx.Node
    waits: tuple[fx.Node, ...]
    group: str
    sources: tuple[str, ...]
    """Names of the replaced collective start nodes, graph order."""
    unsharded_bytes: int


def attribute(collectives: Sequence[Collective], plan: ResolvedPlan) -> tuple[list[tuple[int, Collective]],
                                                                              list[Collective]]:
    """Split data-parallel collectives (FSDP all-gathers and reduce-scatters, HSDP all-reduces) into
    ``(bucket index, collective)`` pairs and those in no bucket (graph order)."""
    covered: list[tuple[int, Collective]] = []
    uncovered: list[Collective] = []
    for c in collectives:
        if not c.fsdp:
            continue
        index = plan.bucket_index(c.module_fqn) if c.module_fqn is not None else None
        if index is None:
            uncovered.append(c)
        else:
            covered.append((index, c))
    return covered, uncovered


def _module_rank(plan: ResolvedPlan, index: int, fqn: str | None) -> int:
    """Position, within its bucket, of the plan module holding ``fqn`` (the root holds everything)."""
    for rank, module in enumerate(plan.buckets[index].modules):
        if fqn is not None and (module in ("", fqn) or fqn.startswith(module + ".")):
            return rank
    return len(plan.buckets[index].modules)


GroupKey: TypeAlias = tuple[int, Direction, CollectiveKind, tuple[object, ...]]
"""``(bucket, direction, kind, what merging needs equal)``: the collectives merged into one."""


def _groups(covered: Sequence[tuple[int, Collective]], plan: ResolvedPlan,
            mode: BucketMode) -> dict[GroupKey, list[Collective]]:
    # Upstream collects a bucket's nodes module by module in plan order, each module's in graph order; that
    # order decides which group merges first (node names) and the layout of the merged buffer. We use the same
    # so that, at depth 1, our graph is upstream's node for node.
    groups: dict[GroupKey, list[Collective]] = {}
    ordered = sorted(covered, key=lambda item: (item[0], _module_rank(plan, item[0], item[1].module_fqn)))
    for index, c in ordered:  # sorted() is stable: graph order within one module
        key = (index, c.direction, c.kind, group_key(c.start, c.kind, mode))
        groups.setdefault(key, []).append(c)
    return groups


def merge_buckets(gm: fx.GraphModule, covered: Sequence[tuple[int, Collective]], plan: ResolvedPlan,
                  mode: BucketMode, *, fresh_fake_values: bool = False,
                  unmerged: Collection[str] = ()) -> list[MergedCollective]:
    """Merge each group in place; returns the merged collectives in graph order of their starts.

    ``fresh_fake_values``: give every merged node its own fake tensor (see ``overlapcfg.graph.stamp``).
    ``unmerged``: kinds left as traced (``OverlapPolicy.unmerged``): each of their collectives is returned as a
    merged collective of one, marked with its bucket for the scheduler, with no node added or removed.
    """
    graph = gm.graph
    merged: list[MergedCollective] = []
    # Merging inserts and erases nodes but never reorders the original ones, so one index serves every group.
    original = positions(graph)
    with traces_used() as cache:
        # Reduce-scatters before all-reduces: an HSDP chain (either order) is only a valid graph again once both of
        # its halves are merged, and merging the all-reduces last inserts them where both orders end up valid.
        groups = sorted(_groups(covered, plan, mode).items(), key=lambda item: item[0][2] == "all_reduce")
        for (index, direction, kind, _), group in groups:
            if kind in unmerged:
                merged += [_as_is(index, direction, kind, c) for c in group]
            else:
                merged.append(_merge_group(graph, original, index, direction, kind, group, mode, fresh_fake_values))
    logger.debug("merged %d groups with %d distinct merge traces", len(merged), len(cache))
    index_of = positions(graph)
    merged.sort(key=lambda m: index_of[m.start])
    return merged


def fold_repeated_waits(graph: fx.Graph, c: Collective) -> int:
    """Where ``c`` is waited more than once, its first wait (graph order) serves every reader; where the graph also
    returns ``c``'s result unwaited, it returns the first wait instead. Returns how many waits and returns changed.

    ``wait_tensor`` returns its argument, so the waits of one collective and its raw result are one tensor and the
    graph means the same after. Repeated waits happen where the tracer's CSE merged two equal collectives: in the
    parallel attention + MLP blocks of GPT-NeoX and Phi, the attention output projection's and the MLP's bias
    gradients are the same sum, so one reduce-scatter serves both, waited once per gradient; torch 2.14 also waits
    a tied embedding's all-gather once per use. An unwaited return is torch 2.14's forward saving a tied weight's
    all-gather for the backward as the collective's raw result (the backward waits it again). The merge takes one
    reader per collective, its wait (as torch's merge helpers do, which assert it). Only waits of the collective's
    own result are folded: a coalesced collective's waits read its outputs one each."""
    waits = [w for w in c.waits if w.args and w.args[0] is c.start and w.graph is graph]
    if not waits:
        return 0
    first, rest = waits[0], waits[1:]
    if rest:  # which wait comes first: a walk of the graph, paid only where there is more than one
        index = {n: i for i, n in enumerate(graph.nodes) if n in waits}
        first, *rest = sorted(waits, key=index.__getitem__)
    for wait in rest:
        wait.replace_all_uses_with(first)
        graph.erase_node(wait)
    returned = [u for u in c.start.users if u.op == "output"]
    for output in returned:
        output.replace_input_with(c.start, first)
    return len(rest) + len(returned)


def _as_is(bucket: int, direction: Direction, kind: CollectiveKind, c: Collective) -> MergedCollective:
    """``c`` left as traced, marked as its bucket's (the scheduler moves it with the bucket)."""
    waits = tuple(w for w in c.waits if w.graph is c.start.graph and started_by(w) is c.start)
    if not waits:
        raise AssertionError(f"overlapcfg merge: collective {c.start.name} has no wait in the graph")
    sources = (c.start.name,)
    mark_merged(c.start, MergedMark(bucket, kind, direction, "start", sources))
    for wait in waits:
        mark_merged(wait, MergedMark(bucket, kind, direction, "wait", sources))
    return MergedCollective(bucket, direction, kind, c.start, waits, c.group, sources, c.unsharded_bytes)


def _merge_group(graph: fx.Graph, original: dict[fx.Node, int], bucket: int, direction: Direction,
                 kind: CollectiveKind, group: list[Collective], mode: BucketMode, fresh: bool) -> MergedCollective:
    starts = [c.start for c in group]
    order = original.__getitem__
    first = min(starts, key=order)
    last = max(starts, key=order)
    nbytes = sum(c.unsharded_bytes for c in group)
    if kind == "all_gather":  # issued where the first was, waited where the first was waited
        first_wait = min((next(w for w in c.waits if w in original) for c in group), key=order)  # folded: gone
        new_nodes = _merge(graph, kind, starts, mode, insert_before=first.next, wait_at=first_wait, fresh=fresh)
    else:  # reduce-scatters, and HSDP all-reduces: one flat collective once the last input is ready
        new_nodes = _merge(graph, kind, starts, mode, insert_before=last.next, wait_at=None, fresh=fresh)
    # The merge copies module stacks and stack traces to the new nodes; which side of autograd they are on matters
    # to us (and to later passes) as much.
    for key in _INHERITED_META:
        if key in group[0].start.meta:
            for n in new_nodes:
                n.meta.setdefault(key, group[0].start.meta[key])
    waits = tuple(n for n in new_nodes if started_by(n) is not None)
    if not waits:
        raise AssertionError(f"overlapcfg merge: no wait among the nodes merged for {[n.name for n in starts]}")
    start = started_by(waits[0])
    if start is None:  # a bug check: waits were chosen as the nodes a start is found for
        raise AssertionError(f"overlapcfg merge: the wait {waits[0].name} of the merged bucket has no start")
    sources = tuple(s.name for s in starts)
    mark_merged(start, MergedMark(bucket, kind, direction, "start", sources))
    for wait in waits:
        mark_merged(wait, MergedMark(bucket, kind, direction, "wait", sources))
    return MergedCollective(bucket, direction, kind, start, waits, group[0].group, sources, nbytes)


def _absorbed_cast(start: fx.Node) -> fx.Node | None:
    """The cast feeding an all-gather alone (mixed precision: the shard is cast, then gathered), which the merged
    copy-in takes over: it copies the uncast shard into a slot of the gathered dtype."""
    source = start.args[0]
    if (isinstance(source, fx.Node) and source.op == "call_function" and len(source.users) == 1
            and source.target in (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)):
        return source
    return None


def _merge(graph: fx.Graph, kind: CollectiveKind, starts: Sequence[fx.Node], mode: BucketMode, *,
           insert_before: fx.Node, wait_at: fx.Node | None, fresh: bool) -> list[fx.Node]:
    """Replace the collectives ``starts`` (one group key; each waited once) by one merged collective stamped before
    ``insert_before``; with ``wait_at``, its wait and everything after it go before ``wait_at``. Returns the new
    nodes. As upstream's ``process_collective_bucket`` does it, so the graphs are the same on torch 2.13."""
    inputs: list[fx.Node] = []
    waits: list[fx.Node] = []
    casts: list[fx.Node | None] = []
    for start in starts:
        if len(start.users) != 1:
            raise AssertionError(f"overlapcfg merge: {start.name} has {len(start.users)} readers, not its one wait")
        waits.append(next(iter(start.users)))
        cast = _absorbed_cast(start) if kind == "all_gather" else None
        casts.append(cast)
        source = cast.args[0] if cast is not None else start.args[0]
        if not isinstance(source, fx.Node):
            raise AssertionError(f"overlapcfg merge: {start.name} collects {source!r}, not a node")
        inputs.append(source)
    args, group = _trace_args(kind, starts, [n.meta["val"] for n in inputs])
    graph_inputs = inputs + ([group] if isinstance(group, fx.Node) else [])
    _, new_nodes = splice(graph, merge_fn(kind, mode), args, insert_before, graph_inputs, waits, fresh=fresh)
    if wait_at is not None:
        first_wait = next((i for i, n in enumerate(new_nodes) if n.target is compat.WAIT_TENSOR), None)
        if first_wait is not None:
            for node in new_nodes[first_wait:]:
                wait_at.prepend(node)
    populate_meta(starts, new_nodes)
    for start, wait, cast in zip(starts, waits, casts, strict=True):
        graph.erase_node(wait)
        graph.erase_node(start)
        if cast is not None:
            graph.erase_node(cast)
    sort_region(graph, new_nodes, graph_inputs)
    return new_nodes


def _trace_args(kind: CollectiveKind, starts: Sequence[fx.Node],
                values: list[object]) -> tuple[tuple[object, ...], object]:
    """The merge function's arguments for these collectives (``bucket_fns``' signatures), and their group argument
    (a name, or a node in compile-on-one-rank graphs). Every collective must agree on the group and, for
    reductions, the reduce op, dtype and device: a group key guarantees it, and a mismatch is a bug."""
    first = starts[0]
    group = first.args[-1]
    group_value = group.meta["val"] if isinstance(group, fx.Node) else group
    name = group_name_of(group)
    if any(group_name_of(s.args[-1]) != name or s.args[1:-1] != first.args[1:-1] for s in starts):
        raise AssertionError(f"overlapcfg merge: {[s.name for s in starts]} differ in group or arguments")
    if kind == "all_gather":
        _, group_size, _ = first.args
        dtypes = [s.meta["val"].dtype for s in starts]
        return (values, group_value, group_size, bucket_dtype(dtypes), dtypes, compat.rank_in_group(name)), group
    val = first.meta["val"]
    if any(s.meta["val"].dtype != val.dtype or s.meta["val"].device != val.device for s in starts):
        raise AssertionError(f"overlapcfg merge: {[s.name for s in starts]} differ in dtype or device")
    if kind == "reduce_scatter":
        _, reduce_op, group_size, _ = first.args
        return (values, group_value, group_size, reduce_op), group
    _, reduce_op, _ = first.args
    return (values, group_value, reduce_op), group

"""Splice a traced function into a graph in place of some of its nodes: how a merged bucket lands in the graph.

``splice`` traces the function (``overlapcfg.graph.bucket_fns``) on the fake values of the nodes it replaces,
stamps the traced nodes in before a given node, points the readers of the replaced outputs at the new ones and
repairs the readers' fake metadata where a new output's layout differs (a merged all-gather's pieces after the
first sit at an offset of the flat buffer, so a view of one has another storage offset).

Three things keep it linear in graph size, where a generic splice is quadratic or slow per bucket:

- **One trace per signature.** Buckets of identical layers have identical signatures (shapes, strides,
  offsets, dtypes, group, rank); their trace is made once and kept (``overlapcfg.graph.traces``), so later
  buckets, the backward that re-gathers the forward's buckets, a second config on the same step and another
  capture of the same shapes stamp it again. A graph of another capture (another fake mode) never sees the trace's
  fake values: its stamps get values of its own mode.
- **Fresh fake values without re-running ops.** Stamped nodes of identical buckets would share the trace's fake
  tensors; that is harmless where the graph runs as it is, but inductor tells buffers apart by storage, so with
  ``fresh=True`` each stamp gets fake tensors of its own, the trace's layouts laid on new storages
  (``overlapcfg.graph.fresh_values``).
- **Bookkeeping once per bucket.** Provenance records (``from_node``) are built once per bucket, not once per new
  node; the output node, which reads every reduce-scattered gradient, is rewritten once per bucket; the region
  sort does not walk back to the placeholders.

Written by overlapcfg; no upstream code. What it must produce (the nodes, their order, users and fake metadata,
the metadata keys inductor's bucketing sets) is upstream's merge's output on torch 2.13, which
``tests/graph/test_merge_speed_invariants.py`` and ``tests/graph/test_merge_across_releases.py`` compare against.
The region sort is Kahn's topological sort with the original position as priority (``_stable_sort``).
"""

from __future__ import annotations

import functools
import heapq
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch import fx
from torch.fx.traceback import NodeSource, NodeSourceAction

from overlapcfg import compat
from overlapcfg.graph.fresh_values import fresh_values
from overlapcfg.graph.traces import forget_traces, trace_of, traces_used

__all__ = ["forget_traces", "populate_meta", "sort_region", "splice", "traces_used"]

def splice(g: fx.Graph, fn: Callable[..., object], inps: Sequence[object], insert_before: fx.Node,
           g_fn_inps: Sequence[fx.Node], g_fn_outs: Sequence[fx.Node], *,
           fresh: bool) -> tuple[dict[fx.Node, fx.Node], list[fx.Node]]:
    """Stamp the trace of ``fn(*inps)`` before ``insert_before``, its placeholders bound to ``g_fn_inps``, and make
    the readers of ``g_fn_outs`` read its outputs instead. Returns ``(old output -> new output, new nodes)``.

    ``fresh``: every new node gets fake values of its own (what a compiler that reads them needs), also where the
    trace was made for another bucket."""
    trace, made_now = trace_of(fn, inps)
    fn_g = trace.gm.graph
    # The trace's own fake values serve the stamp that made it, and later stamps of its own capture unless the
    # caller wants fresh ones; a trace made in another capture is always stamped with values of this one's mode.
    own = trace.mode is compat.detect_fake_mode(inps)
    values = fresh_values(trace.gm, trace.recipe(), g_fn_inps) if not made_now and (fresh or not own) else None
    env: dict[fx.Node, fx.Node] = dict(zip(trace.placeholders, g_fn_inps, strict=False))
    new_outs: list[fx.Node] = []
    new_nodes: list[fx.Node] = []
    copy_node = g.node_copy if _first_stamp(g, fn_g) else functools.partial(compat.copy_node_checked_before, g)
    with g.inserting_before(insert_before):
        for node in fn_g.nodes:
            if node.op == "placeholder":
                continue
            copied = copy_node(node, env.__getitem__)
            env[node] = copied
            if node.op == "output":
                new_outs = list(cast("Sequence[fx.Node]", copied.args[0]))  # the output node's one argument
                g.erase_node(copied)
                continue
            if values is not None and node in values:
                copied.meta["val"] = values[node]
            new_nodes.append(copied)
    replacements = dict(zip(g_fn_outs, new_outs, strict=True))
    changed_readers: list[fx.Node] = []
    for old, new in replacements.items():
        if not _same_layout(old.meta.get("val"), new.meta.get("val")):
            changed_readers += old.users
    _rewire(g, replacements)
    repair_readers(changed_readers)
    return replacements, new_nodes


# --- the readers of replaced outputs -----------------------------------------------------------------------------


def _same_layout(lhs: object, rhs: object) -> bool:
    lhs_leaves, lhs_spec = compat.tree_flatten(lhs)
    rhs_leaves, rhs_spec = compat.tree_flatten(rhs)
    if lhs_spec != rhs_spec:
        return False
    for a, b in zip(lhs_leaves, rhs_leaves, strict=True):
        a_tensor, b_tensor = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
        if a_tensor != b_tensor:
            return False
        if a_tensor and not (a.dtype == b.dtype and a.device == b.device and a.layout == b.layout
                             and compat.statically_equal(
                                 (*a.shape, *a.stride(), a.storage_offset()),
                                 (*b.shape, *b.stride(), b.storage_offset()))):
            return False
    return True


def repair_readers(readers: Sequence[fx.Node]) -> None:
    """Re-run ``readers`` on their inputs' fake values and keep each new value whose layout differs, then their
    readers, and so on: a replacement with another layout (a piece of a flat buffer at an offset) changes the
    strides or offset a view of it has. A reader whose op cannot be re-run on fake values keeps the value it had
    (the merge does not fail over a reader's metadata; ``compat.run_under_fake_mode`` logs it at DEBUG).

    A work list in first-come order: a node is queued once at a time, and again if an input of it changes after it
    was recomputed, so every value ends computed from its inputs' final values whatever the order of arrival."""
    pending = dict.fromkeys(n for n in readers if n.op == "call_function")
    while pending:
        node = next(iter(pending))
        del pending[node]
        current = node.meta.get("val")
        args = compat.tree_map(_value_of, node.args)
        kwargs = compat.tree_map(_value_of, node.kwargs)
        value = compat.run_under_fake_mode(cast("Callable[..., object]", node.target), args, kwargs, current)
        if value is None or _same_layout(current, value):
            continue
        node.meta["val"] = value
        for user in node.users:
            if user.op == "call_function":
                pending[user] = None


def _value_of(arg: object) -> object:
    return arg.meta.get("val", arg) if isinstance(arg, fx.Node) else arg


# --- stamping, rewiring, provenance, order ------------------------------------------------------------------------

_STAMPED: weakref.WeakKeyDictionary[fx.Graph, weakref.WeakSet[fx.Graph]] = weakref.WeakKeyDictionary()
"""Graph -> the traced graphs stamped into it so far (``_first_stamp``)."""


def _first_stamp(g: fx.Graph, traced: fx.Graph) -> bool:
    """Whether ``traced`` is stamped into ``g`` for the first time (then ``node_copy`` copies it, with its checks),
    or again (then ``compat.copy_node_checked_before`` does, without them). Always the first where ``g``'s module
    has node-creation hooks: they must see every node as ``create_node`` makes it."""
    if compat.has_node_creation_hooks(g.owning_module):
        return True
    seen = _STAMPED.setdefault(g, weakref.WeakSet())
    if traced in seen:
        return False
    seen.add(traced)
    return True


def _rewire(g: fx.Graph, replacements: dict[fx.Node, fx.Node]) -> None:
    """``old.replace_all_uses_with(new)`` for each pair in order, with the output node's rewrites folded into one:
    each rewrite of the output maps all its arguments (~600 in a 64-layer backward), which made merging quadratic.
    Rewriting it when the last pair would gives every node the same users in the same order."""
    module = g.owning_module
    output = next(iter(g.find_nodes(op="output")), None)
    last = max((i for i, old in enumerate(replacements) if output in old.users), default=None)
    if last is None or compat.has_replace_hooks(module):  # hooks see each rewrite
        for old, new in replacements.items():
            old.replace_all_uses_with(new)
        return
    for i, (old, new) in enumerate(replacements.items()):
        for user in list(old.users):
            if user is not output:
                user.replace_input_with(old, new)
            elif i == last:
                output.args = fx.map_arg(output.args, lambda n: replacements.get(n, n))
                if output.kwargs:
                    output.kwargs = fx.map_arg(output.kwargs, lambda n: replacements.get(n, n))


_PROVENANCE_KEYS: tuple[tuple[str, object], ...] = (("nn_module_stack", ""), ("fwd_nn_module_stack", ""),
                                                    ("stack_trace", ""), ("custom", {}))


def populate_meta(sources: Sequence[fx.Node], new_nodes: Sequence[fx.Node]) -> None:
    """What the new nodes came from, as inductor's bucketing records it: the first source's module stacks, stack
    trace and ``custom`` metadata, every source's under ``bucketing_<key>_sources``, and a ``from_node`` record per
    source (inductor's provenance tracking reads it). Each source's record is made once and shared (records are
    never mutated); each node gets its own list and set objects."""
    if not sources:
        return
    first = sources[0].meta
    from_node = [NodeSource(n, "bucketing_pass", [NodeSourceAction.CREATE, NodeSourceAction.REPLACE])
                 for n in sources]
    per_key: list[tuple[str, str, object, list[object] | compat.OrderedSet[object]]] = []
    for key, default in _PROVENANCE_KEYS:
        values = [n.meta.get(key, default) for n in sources if n.meta.get(key, default)]
        collected = compat.OrderedSet(values) if key == "stack_trace" else values
        per_key.append((key, f"bucketing_{key}_sources", first.get(key, default), collected))
    for n in new_nodes:  # keys in the order inductor's bucketing sets them
        meta = n.meta
        for key, source_key, value, collected in per_key:
            meta[key] = value
            meta[source_key] = collected.copy()
        meta["from_node"] = list(from_node)


def sort_region(g: fx.Graph, new_nodes: Sequence[fx.Node], inputs: Sequence[fx.Node]) -> None:
    """Order the smallest stretch of the graph spanning ``new_nodes`` and their inputs so every node follows its
    inputs, moving as little as possible (a stable topological sort of the stretch).

    Needed where a bucket is stamped before one of its inputs is computed (an all-gather stamped after the first of
    its collectives reads a parameter cast that comes later). Placeholders head the graph and never move, so the
    search for the stretch's start stops at them: linear, where searching the whole graph for each bucket of
    parameters was quadratic."""
    new = set(new_nodes)
    unplaced = {n for n in inputs if n not in new and n.op != "placeholder"}
    if new_nodes and unplaced:
        start = _farthest_input(new_nodes[0], "prev", ("placeholder", "root"), unplaced)
        end = _farthest_input(new_nodes[-1], "next", ("output", "root"), unplaced)
        if start is not end:
            _stable_sort(list(_stretch(start, end)))


def _farthest_input(end: fx.Node, direction: str, stops: tuple[str, ...], unplaced: set[fx.Node]) -> fx.Node:
    """Step from ``end`` towards ``direction`` (``prev``/``next``) while some of ``unplaced`` are still unmet and no
    ``stops`` node is reached; each met node leaves ``unplaced`` (so the walk the other way looks only for the
    rest). The farthest one met, or ``end`` itself."""
    farthest = end
    cursor = getattr(end, direction)
    while unplaced and cursor.op not in stops:
        if cursor in unplaced:
            unplaced.discard(cursor)
            farthest = cursor
        cursor = getattr(cursor, direction)
    return farthest


def _stretch(first: fx.Node, last: fx.Node) -> Iterator[fx.Node]:
    cursor = first
    while True:
        yield cursor
        if cursor is last:
            return
        cursor = cursor.next


def _stable_sort(region: list[fx.Node]) -> None:
    """Reorder ``region`` (consecutive nodes) so each node follows its inputs inside it; a node already after its
    inputs keeps its place relative to the nodes before it. Nodes outside the region count as ready.

    Kahn's algorithm with the original position as priority: among the nodes whose inputs are all placed, the one
    that came first is placed next. That is a topological order, and the one closest to the original: where the
    region is already ordered nothing moves."""
    position = {n: i for i, n in enumerate(region)}
    waiting_on: dict[fx.Node, int] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    ready: list[int] = []
    for node in region:
        inside = [i for i in dict.fromkeys(node.all_input_nodes) if i in position]
        waiting_on[node] = len(inside)
        for i in inside:
            readers.setdefault(i, []).append(node)
        if not inside:
            heapq.heappush(ready, position[node])
    placed: list[fx.Node] = []
    while ready:
        node = region[heapq.heappop(ready)]
        placed.append(node)
        for reader in readers.get(node, ()):
            waiting_on[reader] -= 1
            if waiting_on[reader] == 0:
                heapq.heappush(ready, position[reader])
    if len(placed) != len(region):
        raise AssertionError("overlapcfg merge: the region to reorder has a cycle")
    anchor = region[0].prev
    for node in placed:
        if anchor.next is not node:
            anchor.append(node)
        anchor = node

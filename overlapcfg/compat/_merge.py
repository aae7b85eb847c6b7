"""Upstream's bucket merge, made cheaper without changing what it produces: ``cached_merge_traces``.

``torch._inductor.fx_passes.bucketing.process_collective_bucket`` merges one bucket: it traces the merge function
with ``make_fx``, stamps the traced nodes into the graph, points the old waits' readers at the new outputs, repairs
the readers' fake metadata, copies provenance metadata onto the new nodes and sorts the region. Each of these is
generic work done again for every bucket; inside ``cached_merge_traces`` the helpers it calls are swapped for
versions that give the same graph (nodes, names, order, arguments, users, metadata) in less time. Reached as
``overlapcfg.compat.cached_merge_traces``, like the rest of ``overlapcfg.compat``.

What each swap saves on a 64-layer backward graph (12k nodes, 131 buckets) is said where it is made.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable, Iterator

import torch as _torch
from torch import fx as _fx
from torch._guards import detect_fake_mode
from torch._inductor.fx_passes import bucketing as _bucketing
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.traceback import NodeSource, NodeSourceAction
from torch.utils._ordered_set import OrderedSet
from torch.utils._pytree import tree_leaves

__all__ = ["cached_merge_traces", "forget_merge_traces"]


def _trace_key(fn: object, inps: tuple[object, ...]) -> tuple[object, ...]:
    def key(x: object) -> object:
        if isinstance(x, _torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device), x.storage_offset())
        if isinstance(x, (list, tuple)):
            return tuple(key(y) for y in x)
        return x

    return (fn, key(inps))


_TRACES_ATTR = "_overlapcfg_merge_traces"
"""Where a fake mode keeps upstream's traced merge functions by signature (``_trace_key``).

Per fake mode, not per call: the graphs of one capture share one fake mode (aot_autograd's forward and backward,
and the copies a job applies several configs to), so a backward that re-gathers the forward's buckets, a second
config on the same step and an ``explain`` after an ``apply`` stamp traces made once. Graphs of another capture
have another fake mode and never see these traces (their fake values belong to this one). Kept on the fake mode
itself, not in a table keyed by it: the traces' fake values refer to their mode, so a table would keep every mode
alive for good, while an attribute makes one cycle the collector frees with the mode."""
_MODES_WITH_TRACES: weakref.WeakSet[object] = weakref.WeakSet()


def _traces_of(mode: object) -> dict[tuple[object, ...], object]:
    traces = getattr(mode, _TRACES_ATTR, None)
    if traces is None:
        traces = {}
        setattr(mode, _TRACES_ATTR, traces)
        _MODES_WITH_TRACES.add(mode)
    return traces


def forget_merge_traces() -> None:
    """Drop every memoized merge trace: the next merge traces as the first did (``benchmarks/pass_speed.py`` times
    each run cold, as upstream's pass always runs)."""
    for mode in list(_MODES_WITH_TRACES):
        getattr(mode, _TRACES_ATTR, {}).clear()


@contextlib.contextmanager
def cached_merge_traces(*, fresh_fake_values: bool = False) -> Iterator[set[tuple[object, ...]]]:
    """Within the block, upstream's merge helpers do the same work faster (same ops, same order, same metadata).

    ``bucketing._trace(fn, inps)`` runs ``make_fx`` on the merge function for every bucket; buckets of identical
    layers have identical signatures (shapes, strides, dtypes, group, rank), so the traced ``GraphModule`` is the
    same and is stamped into the graph by ``node_copy`` as before. Traces are kept per fake mode (``_TRACES_ATTR``),
    so later merges of the same capture reuse them too. Stamped nodes of identical buckets then share their
    ``meta["val"]`` fake tensors (same shapes, strides and dtypes, one storage): harmless when the graph runs
    as it is, but inductor tells buffers apart by storage, so ``fresh_fake_values=True`` (what the inductor routes
    use) re-runs the traced ops on each bucket's own inputs, at about 10 ms per bucket. The other helpers are
    swapped for equivalent linear-time versions: ``_populate_node_meta_once``, ``sort_region`` and
    ``_insert_traced`` (the stamping, the rewiring and the fake metadata repair). Restored on exit, even on error.
    Yields the signatures merged in the block (how many distinct traces it needed).
    """
    original_trace, original_meta = _bucketing._trace, _bucketing._populate_node_meta
    original_sort, original_insert = _bucketing._sort_bucket_region, _bucketing._insert_fn_trace_before_node
    used: set[tuple[object, ...]] = set()

    def traced(fn: object, inps: tuple[object, ...]) -> object:
        k = _trace_key(fn, inps)
        used.add(k)
        mode = detect_fake_mode(inps)
        cache = _traces_of(mode) if mode is not None else {}
        if k not in cache:
            cache[k] = original_trace(fn, inps)
            return cache[k]
        gm = cache[k]
        if fresh_fake_values:
            # Re-run the traced ops on this bucket's own fake inputs, so its nodes get their own fake values
            # (storages) as a fresh trace would give them: inductor tells buffers apart by them.
            FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*tree_leaves(inps))
        return gm

    def sort_region(g: object, new_nodes: list[object], inputs: list[object]) -> None:
        # Placeholders head the graph, so they never need moving; but upstream's region walk searches for them
        # too, back to the top of the graph, for every bucket of parameters: quadratic in graph size. Leaving
        # them out of the search gives the same order in linear time.
        original_sort(g, new_nodes, [n for n in inputs if getattr(n, "op", None) != "placeholder"])

    _bucketing._trace = traced
    _bucketing._populate_node_meta = _populate_node_meta_once
    _bucketing._sort_bucket_region = sort_region
    _bucketing._insert_fn_trace_before_node = _insert_traced
    try:
        yield used
    finally:
        _bucketing._trace = original_trace
        _bucketing._populate_node_meta = original_meta
        _bucketing._sort_bucket_region = original_sort
        _bucketing._insert_fn_trace_before_node = original_insert


def _insert_traced(g: _fx.Graph, fn_to_trace: object, inps: object, insert_before_node: _fx.Node,
                   g_fn_inps: list[_fx.Node],
                   g_fn_outs: list[_fx.Node]) -> tuple[dict[_fx.Node, _fx.Node], list[_fx.Node]]:
    """Upstream's ``_insert_fn_trace_before_node`` (trace, stamp the traced nodes before ``insert_before_node``,
    point the readers of ``g_fn_outs`` at the new outputs, repair their fake metadata), with two differences that
    leave the same graph:

    - The graph's output node, where it reads the old outputs (a backward graph returns every reduce-scattered
      gradient), is rewritten once per bucket instead of once per output. Each rewrite maps all of the output's
      arguments (~600 in a 64-layer backward), which made the merge quadratic. Rewriting it at the moment upstream
      rewrites it for the last time gives every node the same users in the same order (a rewrite moves the output
      node to the end of all its inputs' users).
    - The fake metadata repair starts only from readers of outputs whose metadata changed. Upstream re-runs every
      reader under the fake mode and keeps the new value where its metadata differs; a reader whose input's
      replacement has the same shape, strides, offset and dtype computes the same metadata again (a fake kernel
      sees nothing else). About a third need it (a merged all-gather's pieces after the first sit at an offset in
      the flat buffer), and the repair was ~100 ms of the 64-layer merge (a third to a half of it).
    """
    fn_g = _bucketing._trace(fn_to_trace, inps).graph
    env: dict[_fx.Node, object] = dict(zip(fn_g.find_nodes(op="placeholder"), g_fn_inps, strict=False))
    new_outs: list[_fx.Node] = []
    new_nodes: list[_fx.Node] = []
    copy_node = g.node_copy if _first_stamp(g, fn_g) else functools.partial(_stamp, g)
    with g.inserting_before(insert_before_node):
        for node in fn_g.nodes:
            if node.op == "placeholder":
                continue
            copied = copy_node(node, env.__getitem__)
            env[node] = copied
            if node.op == "output":
                new_outs = copied.args[0]  # type: ignore[assignment]
                g.erase_node(copied)
            else:
                new_nodes.append(copied)
    replacements = dict(zip(g_fn_outs, new_outs, strict=False))
    old_values = [(old, old.meta.get("val")) for old in g_fn_outs]
    changed_readers: list[_fx.Node] = []
    for old, value in old_values:
        readers = list(old.users)
        if not _bucketing._same_metadata(value, replacements[old].meta.get("val")):
            changed_readers += readers
    _rewire(g, replacements)
    _bucketing._recompute_changed_user_metadata(changed_readers)
    return replacements, new_nodes


_STAMPED: weakref.WeakKeyDictionary[_fx.Graph, weakref.WeakSet[_fx.Graph]] = weakref.WeakKeyDictionary()
"""Graph -> the traced merge graphs stamped into it so far (``_first_stamp``)."""


def _first_stamp(g: _fx.Graph, traced: _fx.Graph) -> bool:
    """Whether ``traced`` is stamped into ``g`` for the first time (then ``node_copy`` copies it, with its checks),
    or again (then ``_stamp`` does, without them). Always the first where ``g``'s module has node-creation hooks:
    they must see every node as ``create_node`` makes it."""
    if getattr(g.owning_module, "_create_node_hooks", None):
        return True
    seen = _STAMPED.setdefault(g, weakref.WeakSet())
    if traced in seen:
        return False
    seen.add(traced)
    return True


def _stamp(g: _fx.Graph, node: _fx.Node, arg_transform: Callable[[_fx.Node], object]) -> _fx.Node:
    """``g.node_copy(node, arg_transform)`` for a traced merge graph stamped into ``g`` before, without
    ``create_node``'s scan of every argument for raw symbolic values (torch 2.13: a ``pytree`` walk, 80% of
    ``create_node``'s time on a merge's long argument lists). The arguments are the first stamp's, which
    ``node_copy`` scanned, with other nodes in place of nodes: a scan would find what it found then. The node is
    created without arguments and given them through the ``args``/``kwargs`` setters, which do the bookkeeping
    ``Node.__init__`` does with them (inputs, users)."""
    args = _fx.map_arg(node.args, arg_transform)
    kwargs = _fx.map_arg(node.kwargs, arg_transform)
    copied = g.create_node(node.op, node.target, name=node.name, type_expr=node.type)
    if args:
        copied.args = args
    if kwargs:
        copied.kwargs = kwargs
    copied.meta = copy.copy(node.meta)
    return copied


def _rewire(g: _fx.Graph, replacements: dict[_fx.Node, _fx.Node]) -> None:
    """``old.replace_all_uses_with(new)`` for each pair in order, with the output node's rewrites folded into one."""
    module = g.owning_module
    output = next(iter(g.find_nodes(op="output")), None)
    last = max((i for i, old in enumerate(replacements) if output in old.users), default=None)
    if last is None or getattr(module, "_replace_hooks", None):  # hooks see each rewrite: upstream's way
        for old, new in replacements.items():
            old.replace_all_uses_with(new)
        return
    for i, (old, new) in enumerate(replacements.items()):
        for user in list(old.users):
            if user is not output:
                user._replace_input_with(old, new)
            elif i == last:
                output.args = _fx.map_arg(output.args, lambda n: replacements.get(n, n))
                if output.kwargs:
                    output.kwargs = _fx.map_arg(output.kwargs, lambda n: replacements.get(n, n))


def _populate_node_meta_once(bucket_nodes: list[_fx.Node], new_nodes: list[_fx.Node]) -> None:
    """Upstream's ``_populate_node_meta`` with the same result, built once per bucket instead of once per node.

    Upstream makes a ``NodeSource`` (which deep-copies the source's whole ``from_node`` history) for every
    (new node, source node) pair: about 40k deep copies on a 64-layer backward graph, most of the merge's time.
    Here each source's ``NodeSource`` is made once and the per-key source lists once; every new node gets its own
    list and set objects (copies, not rebuilt element by element) holding those shared, never-mutated records.
    """
    if not bucket_nodes:
        return
    first = bucket_nodes[0].meta
    keys = (("nn_module_stack", ""), ("fwd_nn_module_stack", ""), ("stack_trace", ""), ("custom", {}))
    sources: dict[str, list[object] | OrderedSet[object]] = {}
    for key, default in keys:
        values = [n.meta.get(key, default) for n in bucket_nodes if n.meta.get(key, default)]
        sources[key] = OrderedSet(values) if key == "stack_trace" else values
    firsts = [(key, f"bucketing_{key}_sources", first.get(key, default), sources[key]) for key, default in keys]
    actions = [NodeSourceAction.CREATE, NodeSourceAction.REPLACE]
    from_node = [NodeSource(n, "bucketing_pass", actions) for n in bucket_nodes]
    for n in new_nodes:
        meta = n.meta
        for key, source_key, value, src in firsts:
            meta[key] = value
            meta[source_key] = src.copy()
        meta["from_node"] = list(from_node)

"""Breakages of correctly bucketed graphs: each changes one thing a buggy bucketer or scheduler could, and returns
regexes the verifier's message must match (the node, parameter or gradient at fault).

``BREAKAGES`` lists each with the graph (forward, backward) and the config family (``merged``, ``partial``,
``coalesced``, ``stepped``) it applies to. Used by the negative controls on traced demo graphs
(``tests/graph/test_verify_negative.py``) and on synthetic graphs (``tests/graph/test_properties.py``): one list, so
every graph family meets the same breakages.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx

from overlapcfg import compat

_aten = torch.ops.aten

Breaker = Callable[[fx.GraphModule], list[str]]
"""Breaks a graph in place; returns regexes that must each match the verification message."""


# --- finding things in a bucketed graph --------------------------------------------------------------------

def _calls(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _wait(start: fx.Node) -> fx.Node:
    (wait,) = [u for u in start.users if u.target is compat.WAIT_TENSOR]
    return wait


def _merged_all_gather(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """A merged all-gather of a transformer layer: (start, wait, parameters in its copy-in, buffer order)."""
    for start in _calls(gm, compat.ALL_GATHER_INTO_TENSOR_OUT):
        copy_in = start.kwargs["out"]
        if copy_in.target is compat.pre_bucket_all_gather and len(copy_in.args[0]) > 2:
            return start, _wait(start), list(copy_in.args[0])
    raise AssertionError("no merged all-gather of a layer")


def _merged_reduce_scatter(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """A merged reduce-scatter of a transformer layer: (start, wait, gradients in its copy-in)."""
    for start in _calls(gm, compat.REDUCE_SCATTER_TENSOR):
        copy_in = start.args[0]
        if copy_in.target is compat.pre_bucket_reduce_scatter and len(copy_in.args[0]) > 2:
            return start, _wait(start), list(copy_in.args[0])
    raise AssertionError("no merged reduce-scatter of a layer")


def _plain(gm: fx.GraphModule, target: object) -> fx.Node:
    """The first unmerged collective (its input is no bucket copy-in)."""
    for start in _calls(gm, target):
        source = start.args[0]
        if source.target not in (compat.pre_bucket_reduce_scatter, _aten.slice.Tensor):
            return start
    raise AssertionError(f"no plain {target}")


def _same_shape_pair(nodes: list[fx.Node], target: object = None) -> tuple[fx.Node, fx.Node]:
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            if a.meta["val"].shape == b.meta["val"].shape and (target is None or a.target is b.target is target):
                return a, b
    raise AssertionError("no two same-shaped nodes")


def _insert_after(node: fx.Node, target: object, args: tuple[object, ...], like: fx.Node) -> fx.Node:
    with node.graph.inserting_after(node):
        new = node.graph.call_function(target, args)
    new.meta["val"] = like.meta["val"]
    return new


def _set_arg(node: fx.Node, i: int, value: object) -> None:
    args = list(node.args)
    args[i] = value
    node.args = tuple(args)


def _copy_collective(start: fx.Node) -> tuple[fx.Node, fx.Node]:
    """A second start + wait doing exactly what ``start`` does, inserted after its wait, read by nobody."""
    wait = _wait(start)
    graph = start.graph
    with graph.inserting_after(wait):
        dup = graph.node_copy(start)
    with graph.inserting_after(dup):
        dup_wait = graph.node_copy(wait, lambda n: dup if n is start else n)
    return dup, dup_wait


# --- the breakages -------------------------------------------------------------------------------------------

def plain_all_gather_group_renamed(gm: fx.GraphModule) -> list[str]:
    start = _plain(gm, compat.ALL_GATHER_INTO_TENSOR)
    _set_arg(start, 2, "1")
    param = start.args[0].name
    return [rf"parameter {param}: all-gathered in group '1' of 2 by {start.name}, was group '0' of 2"]


def plain_reduce_scatter_group_renamed(gm: fx.GraphModule) -> list[str]:
    start = _plain(gm, compat.REDUCE_SCATTER_TENSOR)
    _set_arg(start, 3, "1")
    return [rf"gradient \S+: reduce-scattered in group '1' of 2, op sum, float32 by {start.name}, "
            rf"was group '0' of 2, op sum, float32"]


def merged_all_gather_group_renamed(gm: fx.GraphModule) -> list[str]:
    start, _, params = _merged_all_gather(gm)
    _set_arg(start, 2, "1")
    return [rf"parameter {p.name}: all-gathered in group '1' of 2 by {start.name}, was group '0' of 2"
            for p in params]


def merged_reduce_scatter_group_renamed(gm: fx.GraphModule) -> list[str]:
    start, _, grads = _merged_reduce_scatter(gm)
    _set_arg(start, 3, "1")
    return [rf"gradient {g.name}: reduce-scattered in group '1' of 2, op sum, float32 by {start.name}"
            for g in grads if g.target is _aten.t.default]


def all_gather_group_size_4(gm: fx.GraphModule) -> list[str]:
    start, _, params = _merged_all_gather(gm)
    _set_arg(start, 1, 4)
    return [rf"parameter {params[0].name}: all-gathered in group '0' of 4 by {start.name}, was group '0' of 2"]


def reduce_scatter_group_size_4(gm: fx.GraphModule) -> list[str]:
    start, _, grads = _merged_reduce_scatter(gm)
    _set_arg(start, 2, 4)
    g = next(g for g in grads if g.target is _aten.t.default)
    return [rf"gradient {g.name}: reduce-scattered in group '0' of 4, op sum, float32 by {start.name}"]


def reduce_op_sum_to_avg(gm: fx.GraphModule) -> list[str]:
    start, _, grads = _merged_reduce_scatter(gm)
    _set_arg(start, 1, "avg")
    g = next(g for g in grads if g.target is _aten.t.default)
    return [rf"gradient {g.name}: reduce-scattered in group '0' of 2, op avg, float32 by {start.name}, "
            rf"was group '0' of 2, op sum, float32"]


def parameters_swapped_in_copy_in(gm: fx.GraphModule) -> list[str]:
    start, _, params = _merged_all_gather(gm)
    a, b = _same_shape_pair(params)
    copy_in = start.kwargs["out"]
    copy_in.args = ([b if p is a else a if p is b else p for p in params], *copy_in.args[1:])
    return [rf"reads float32\[[0-9, ]+\] = all_gather\[group '0', 2 ranks\]\({b.name}\); "
            rf"before it read float32\[[0-9, ]+\] = all_gather\[group '0', 2 ranks\]\({a.name}\)"]


def slices_swapped_after_wait(gm: fx.GraphModule) -> list[str]:
    _, wait, params = _merged_all_gather(gm)
    (view,) = wait.users
    (split,) = view.users
    a, b = _same_shape_pair(list(split.users))
    ia, ib = a.args[1], b.args[1]
    _set_arg(a, 1, ib)
    _set_arg(b, 1, ia)
    pa, pb = params[ia].name, params[ib].name
    return [rf"reads [^;]* = all_gather\[group '0', 2 ranks\]\({pb}\); before it read .* = "
            rf"all_gather\[group '0', 2 ranks\]\({pa}\)"]


def parameter_doubled_before_merged_gather(gm: fx.GraphModule) -> list[str]:
    start, _, params = _merged_all_gather(gm)
    p = params[1]
    doubled = _insert_after(p, _aten.mul.Tensor, (p, 2), like=p)
    copy_in = start.kwargs["out"]
    copy_in.args = ([doubled if q is p else q for q in params], *copy_in.args[1:])
    return [rf"{doubled.name} \(aten.mul.Tensor\) is new", rf"parameter {p.name} is no longer all-gathered in forward",
            rf"reads [^;]* = all_gather\[group '0', 2 ranks\]\({doubled.name}\)"]


def parameter_doubled_before_plain_gather(gm: fx.GraphModule) -> list[str]:
    start = _plain(gm, compat.ALL_GATHER_INTO_TENSOR)
    p = start.args[0]
    doubled = _insert_after(p, _aten.mul.Tensor, (p, 2), like=p)
    _set_arg(start, 0, doubled)
    return [rf"{doubled.name} \(aten.mul.Tensor\) is new", rf"parameter {p.name} is no longer all-gathered in forward"]


def all_gather_lost(gm: fx.GraphModule) -> list[str]:
    """The wait reads the local copy-in slot instead of the gathered buffer: no communication at all."""
    start, wait, params = _merged_all_gather(gm)
    wait.args = (start.args[0],)
    gm.graph.erase_node(start)
    return [rf"parameter {p.name} is no longer all-gathered in forward" for p in params]


def extra_all_gather_of_a_parameter(gm: fx.GraphModule) -> list[str]:
    _, wait, params = _merged_all_gather(gm)
    p = params[0]
    extra = _insert_after(wait, compat.ALL_GATHER_INTO_TENSOR, (p, 2, "0"), like=p)
    _insert_after(extra, compat.WAIT_TENSOR, (extra,), like=p)
    return [rf"parameter {p.name} is all-gathered 2 times in forward \(by [^)]*{extra.name}"]


def wait_removed(gm: fx.GraphModule) -> list[str]:
    start, wait, _ = _merged_all_gather(gm)
    wait.replace_all_uses_with(start)
    gm.graph.erase_node(wait)
    return [rf"{start.name}: expected exactly one wait_tensor, found 0", rf"{start.name}: read before its wait by"]


def wait_moved_before_start(gm: fx.GraphModule) -> list[str]:
    start, wait, _ = _merged_all_gather(gm)
    start.prepend(wait)
    return [rf"{wait.name}: waits on {start.name} before it is issued"]


def result_read_before_wait(gm: fx.GraphModule) -> list[str]:
    start, wait, _ = _merged_all_gather(gm)
    (reader,) = wait.users
    reader.replace_input_with(wait, start)
    return [rf"{start.name}: read before its wait by {reader.name}"]


def out_buffer_read_before_wait(gm: fx.GraphModule) -> list[str]:
    start, _, _ = _merged_all_gather(gm)
    buffer = start.kwargs["out"]
    early = _insert_after(start, _aten.clone.default, (buffer,), like=buffer)
    return [rf"{start.name}: output buffer {buffer.name} read before the wait by {early.name}"]


def gradients_swapped_to_outputs(gm: fx.GraphModule) -> list[str]:
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    nodes = [(i, v) for i, v in enumerate(outs) if isinstance(v, fx.Node) and "val" in v.meta]
    (a, va), (b, vb) = next(((x, y) for j, x in enumerate(nodes) for y in nodes[j + 1:]
                              if x[1].meta["val"].shape == y[1].meta["val"].shape))
    outs[a], outs[b] = vb, va
    output.args = (tuple(outs),)
    return [rf"graph output {a} is now the reduce-scattered gradient of \S+, which it was not",
            rf"graph output {b} is now the reduce-scattered gradient of \S+, which it was not"]


def reduce_scatter_of_the_wrong_node(gm: fx.GraphModule) -> list[str]:
    start, _, grads = _merged_reduce_scatter(gm)
    right, wrong = _same_shape_pair(grads, _aten.t.default)
    copy_in = start.args[0]
    copy_in.args = ([wrong if g is right else g for g in grads], *copy_in.args[1:])
    return [rf"gradient {right.name} is no longer reduce-scattered in backward",
            rf"gradient {wrong.name} is reduce-scattered 2 times in backward",
            rf"graph output \d+ is now the reduce-scattered gradient of {wrong.name}, which it was not "
            rf"\(it was {right.name}'s\)"]


def gathered_dtype_changed(gm: fx.GraphModule) -> list[str]:
    start, _, params = _merged_all_gather(gm)
    copy_in = start.kwargs["out"]
    position = [a.name for a in copy_in.target._schema.arguments].index("out_dtype_ints")  # 3, or 4 on torch 2.11
    ints = list(copy_in.args[position])
    ints[0] = compat.bucket_dtype_table.index(torch.bfloat16)
    _set_arg(copy_in, position, ints)
    p = params[0].name
    return [rf"parameter {p}: other data is all-gathered in forward \(by {start.name}\): as bfloat16\({p}\), "
            rf"was {p}"]


def plain_gather_cast_to_bfloat16(gm: fx.GraphModule) -> list[str]:
    start = _plain(gm, compat.ALL_GATHER_INTO_TENSOR)
    p = start.args[0]
    cast = _insert_after(p, torch.ops.prims.convert_element_type.default, (p, torch.bfloat16), like=p)
    cast.meta["val"] = p.meta["val"].to(torch.bfloat16)
    _set_arg(start, 0, cast)
    return [rf"parameter {p.name}: other data is all-gathered in forward \(by {start.name}\): "
            rf"as bfloat16\({p.name}\), was {p.name}",
            rf"reads bfloat16\[[0-9, ]+\] = all_gather\[group '0', 2 ranks\]\(bfloat16\({p.name}\)\)"]


def reduce_scatter_dropped(gm: fx.GraphModule) -> list[str]:
    """The wait reads this rank's chunk of the copy-in: nothing is reduced across ranks."""
    start, wait, grads = _merged_reduce_scatter(gm)
    copy_in = start.args[0]
    chunk = _insert_after(copy_in, _aten.slice.Tensor, (copy_in, 0, 0, copy_in.meta["val"].numel() // 2),
                          like=start)
    wait.args = (chunk,)
    gm.graph.erase_node(start)
    g = next(g for g in grads if g.target is _aten.t.default)
    return [rf"gradient {g.name} is no longer reduce-scattered in backward",
            rf"graph output \d+ is no longer the reduce-scattered gradient of {g.name}"]


def reduce_scatter_duplicated(gm: fx.GraphModule) -> list[str]:
    start = _plain(gm, compat.REDUCE_SCATTER_TENSOR)
    dup, _ = _copy_collective(start)
    return [rf"gradient \S+ is reduce-scattered 2 times in backward \(by {start.name}, {dup.name}\), was 1"]


def merged_reduce_scatter_duplicated(gm: fx.GraphModule) -> list[str]:
    start, _, grads = _merged_reduce_scatter(gm)
    dup, _ = _copy_collective(start)
    return [rf"gradient {g.name} is reduce-scattered 2 times in backward \(by {start.name}, {dup.name}\)"
            for g in grads if g.target is _aten.t.default]


def coalesced_outputs_swapped(gm: fx.GraphModule) -> list[str]:
    """``bucket_mode: coalesced``: two same-shaped results of a coalesced reduce-scatter handed to each other's
    outputs (the getitems after the wait swap their index)."""
    start = next(s for s in _calls(gm, compat.REDUCE_SCATTER_TENSOR_COALESCED) if len(s.args[0]) > 2)
    items = sorted((u for u in start.users if u.target is operator.getitem), key=lambda n: n.args[1])
    a, b = _same_shape_pair(items)
    ia, ib = a.args[1], b.args[1]
    _set_arg(a, 1, ib)
    _set_arg(b, 1, ia)
    return [r"graph output \d+ is now the reduce-scattered gradient of \S+, which it was not"]


def consumer_rewired_to_another_slice(gm: fx.GraphModule) -> list[str]:
    """One consumer (not the whole slot) reads the same-shaped neighbouring parameter's slice."""
    _, wait, params = _merged_all_gather(gm)
    (view,) = wait.users
    (split,) = view.users
    a, b = _same_shape_pair(list(split.users))
    end_a, end_b = _copy_out_end(a), _copy_out_end(b)
    reader = next(iter(end_a.users))
    reader.replace_input_with(end_a, end_b)
    pa, pb = params[a.args[1]].name, params[b.args[1]].name
    return [rf"{reader.name} \(\S+\) args\[\d\]: reads [^;]* = all_gather\[group '0', 2 ranks\]\({pb}\); "
            rf"before it read .* = all_gather\[group '0', 2 ranks\]\({pa}\)"]


def _copy_out_end(node: fx.Node) -> fx.Node:
    """Follow a split slice through the copy-out views to the node compute reads."""
    while len(node.users) == 1 and next(iter(node.users)).target in _COPY_OUT:
        node = next(iter(node.users))
    return node


_COPY_OUT = (_aten.view.dtype, _aten.alias.default, _aten.clone.default, _aten._unsafe_view.default,
             _aten.view.default)
"""The ops of a merged all-gather's copy-out (torch 2.14's merge also puts an ``alias`` after the dtype view)."""


# --- writes and identity ----------------------------------------------------------------------------------------

_GATHERED = r"all_gather\[group '[^']+', \d+ ranks\]"
"""A gathered parameter in messages, on any group (the write breakages also run on mesh graphs)."""


def _after_split(gm: fx.GraphModule) -> tuple[fx.Node, list[fx.Node], fx.Node, fx.Node]:
    """A merged all-gather's copy-out: (split, parameters in buffer order, two same-shaped slices of it)."""
    _, wait, params = _merged_all_gather(gm)
    (view,) = wait.users
    (split,) = view.users
    a, b = _same_shape_pair(sorted(split.users, key=lambda n: n.args[1]))
    return split, params, a, b


def copy_into_a_gathered_slice(gm: fx.GraphModule) -> list[str]:
    """``copy_(slice_a, slice_b)`` right after the split: every reader of ``a`` now reads ``b``'s parameter."""
    _, params, a, b = _after_split(gm)
    last = max(a, b, key=lambda n: list(gm.graph.nodes).index(n))
    _insert_after(last, _aten.copy_.default, (a, b), like=a)
    pa, pb = params[a.args[1]].name, params[b.args[1]].name
    return [rf"reads [^;]* = {_GATHERED}\({pb}\); before it read .* = {_GATHERED}\({pa}\)"]


def in_place_op_into_a_gathered_slice(gm: fx.GraphModule) -> list[str]:
    """``mul_(slice, 2)``: an op whose schema marks ``self`` written; its readers read the product."""
    _, params, a, b = _after_split(gm)
    last = max(a, b, key=lambda n: list(gm.graph.nodes).index(n))
    doubled = _insert_after(last, _aten.mul_.Tensor, (a, 2.0), like=a)
    return [rf"{doubled.name} \(aten.mul_.Tensor\) is new",
            rf"reads [^;]* = {doubled.name}; before it read .* = {_GATHERED}\({params[a.args[1]].name}\)"]


def _same_shaped_parameters(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node]:
    _, _, params = _merged_all_gather(gm)
    return _same_shape_pair(params)


def copy_into_a_parameter_shard(gm: fx.GraphModule) -> list[str]:
    """``copy_(p, q)`` at the end of the graph: nothing reads ``p`` after it, but the step leaves ``q``'s bytes in
    ``p``'s shard for every later step."""
    p, q = _same_shaped_parameters(gm)
    output = next(iter(gm.graph.find_nodes(op="output")))
    _insert_after(output.prev, _aten.copy_.default, (p, q), like=p)
    return [rf"graph input \d+ \({p.name}\) is now written: the graph leaves float32\[[0-9, ]+\] = {q.name} in it"]


def copy_into_a_parameter_shard_before_its_gather(gm: fx.GraphModule) -> list[str]:
    start, _, params = _merged_all_gather(gm)
    p, q = _same_shape_pair(params)
    copy_in = start.kwargs["out"]
    with gm.graph.inserting_before(copy_in):
        overwrite = gm.graph.call_function(_aten.copy_.default, (p, q))
    overwrite.meta["val"] = p.meta["val"]
    return [rf"parameter {p.name} is no longer all-gathered in forward",
            rf"graph input \d+ \({p.name}\) is now written"]


def reader_moved_after_an_in_place_write(gm: fx.GraphModule) -> list[str]:
    """On a ``stepped`` graph: the reader of a shard moved past the shard's in-place update."""
    reader = next(n for n in gm.graph.nodes if n.name == "decay_0")
    writer = next(n for n in gm.graph.nodes if n.name == "update_0")
    writer.append(reader)
    p = reader.args[0].name
    return [rf"decay_0 \(aten.mul.Tensor\) args\[0\]: reads float32\[[0-9, ]+\] = update_0; before it read "
            rf"float32\[[0-9, ]+\] = {p}"]


def in_place_write_moved_before_the_gather(gm: fx.GraphModule) -> list[str]:
    """On a ``stepped`` graph: a shard's update moved before the copy-in that gathers it (write before read)."""
    writer = next(n for n in gm.graph.nodes if n.name == "update_0")
    p = writer.args[0]
    copy_in = next(u for u in p.users if u.target in (compat.pre_bucket_all_gather, compat.ALL_GATHER_INTO_TENSOR))
    copy_in.prepend(writer)
    return [rf"parameter {p.name} is no longer all-gathered in \w+",
            r"decay_0 \(aten.mul.Tensor\) args\[0\]: reads float32\[[0-9, ]+\] = update_0"]


def inputs_swapped_under_their_names(gm: fx.GraphModule) -> list[str]:
    """Two adjacent same-shaped placeholders trade places, names kept: callers pass inputs by position."""
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    i, a, b = next((i, a, b) for i, (a, b) in enumerate(itertools.pairwise(inputs))
                   if a.meta["val"].shape == b.meta["val"].shape and a.users and b.users)
    a.prepend(b)
    return [rf"graph input {b.name} is now input {i}, was input {i + 1}: inputs are passed by position, so it "
            rf"receives what {a.name} did", rf"graph input {a.name} is now input {i + 1}, was input {i}"]


def foreach_group_index_dropped(gm: fx.GraphModule) -> list[str]:
    """``_pre_bucket_all_gather(..., foreach_group_indices)`` loses one index: that slot is never copied in."""
    copy_in = next(n for n in _calls(gm, compat.pre_bucket_all_gather)
                   if compat.pre_bucket_all_gather_arguments(n.args, n.kwargs).get("foreach_group_indices"))
    position = len(copy_in.args) - 1  # the schema's last argument (torch 2.11 has one more before it than 2.13)
    groups = list(copy_in.args[position])
    dropped = next(i for i in groups if i >= 0)
    groups.remove(dropped)
    _set_arg(copy_in, position, groups)
    p = copy_in.args[0][dropped].name
    return [rf"parameter {p} is no longer all-gathered", rf"reads [^;]*uninitialized\({copy_in.name}\)"]


def next_all_gather_into_a_buffer_still_read(gm: fx.GraphModule) -> list[str]:
    """Bucket k+1's all-gather fills bucket k's (same-sized) buffer, issued before k's wait and readers."""
    starts = _calls(gm, compat.ALL_GATHER_INTO_TENSOR_OUT)
    first, then = next((a, b) for a, b in itertools.pairwise(starts)
                       if a.kwargs["out"].meta["val"].shape == b.kwargs["out"].meta["val"].shape)
    then.kwargs = {**then.kwargs, "out": first.kwargs["out"]}
    return [rf"{then.name}: writes into the output buffer of {first.name} while it is in flight",
            rf"reads [^;]* = {_GATHERED}\(\w+\); before it read"]


def gradient_written_while_its_reduce_scatter_is_in_flight(gm: fx.GraphModule) -> list[str]:
    start, _, _ = _merged_reduce_scatter(gm)
    copy_in = start.args[0]
    zeroed = _insert_after(start, _aten.mul_.Tensor, (copy_in, 0.0), like=copy_in)
    return [rf"{zeroed.name}: writes into the input of {start.name} while it is in flight"]


BREAKAGES: list[Any] = [
    ("forward", "partial", plain_all_gather_group_renamed),
    ("backward", "partial", plain_reduce_scatter_group_renamed),
    ("forward", "merged", merged_all_gather_group_renamed),
    ("backward", "merged", merged_reduce_scatter_group_renamed),
    ("forward", "merged", all_gather_group_size_4),
    ("backward", "merged", reduce_scatter_group_size_4),
    ("backward", "merged", reduce_op_sum_to_avg),
    ("forward", "merged", parameters_swapped_in_copy_in),
    ("backward", "merged", parameters_swapped_in_copy_in),
    ("forward", "merged", slices_swapped_after_wait),
    ("forward", "merged", consumer_rewired_to_another_slice),
    ("forward", "merged", parameter_doubled_before_merged_gather),
    ("forward", "partial", parameter_doubled_before_plain_gather),
    ("forward", "merged", all_gather_lost),
    ("forward", "merged", extra_all_gather_of_a_parameter),
    ("forward", "merged", wait_removed),
    ("backward", "merged", wait_moved_before_start),
    ("forward", "merged", result_read_before_wait),
    ("forward", "merged", out_buffer_read_before_wait),
    ("backward", "merged", gradients_swapped_to_outputs),
    ("backward", "merged", reduce_scatter_of_the_wrong_node),
    ("forward", "merged", gathered_dtype_changed),
    ("forward", "partial", plain_gather_cast_to_bfloat16),
    ("backward", "merged", reduce_scatter_dropped),
    ("backward", "partial", reduce_scatter_duplicated),
    ("backward", "merged", merged_reduce_scatter_duplicated),
    pytest.param("backward", "coalesced", coalesced_outputs_swapped),
    ("forward", "merged", copy_into_a_gathered_slice),
    ("backward", "merged", copy_into_a_gathered_slice),
    ("forward", "merged", in_place_op_into_a_gathered_slice),
    ("forward", "merged", copy_into_a_parameter_shard),
    ("backward", "merged", copy_into_a_parameter_shard),
    ("forward", "merged", copy_into_a_parameter_shard_before_its_gather),
    ("forward", "stepped", reader_moved_after_an_in_place_write),
    ("backward", "stepped", reader_moved_after_an_in_place_write),
    ("forward", "stepped", in_place_write_moved_before_the_gather),
    ("forward", "merged", inputs_swapped_under_their_names),
    ("backward", "merged", inputs_swapped_under_their_names),
    ("forward", "merged", foreach_group_index_dropped),
    ("forward", "merged", next_all_gather_into_a_buffer_still_read),
    ("backward", "merged", gradient_written_while_its_reduce_scatter_is_in_flight),
]

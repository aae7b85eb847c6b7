"""Which collectives are FSDP's, read from the graph: parameter inputs by structure and evidence, never by their
names; gradients wherever they end (outputs, an optimizer's in-place update); shared weights' partial gradients.

Small graphs built by hand (milliseconds), shaped like what torchtitan's graph trainer and aot_autograd emit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.errors import OverlapConfigError, UnsupportedGraphError
from overlapcfg.graph.attribution import module_fqn
from overlapcfg.graph.collectives import find_collectives
from overlapcfg.passes import apply
from tests.support.synthetic import backward_graph, forward_graph, with_fake_values

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
DIM = 4


class _Graph:
    """A hand-built graph with ``meta["val"]``, torchtitan's ``custom.module_fqn`` and ``autograd_backward`` tags."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.inputs: list[tuple[fx.Node, tuple[int, ...]]] = []

    def input(self, name: str, shape: tuple[int, ...]) -> fx.Node:
        node = self.graph.placeholder(name)
        self.inputs.append((node, shape))
        return node

    def call(self, target: object, args: tuple[object, ...], fqn: str, backward: bool = False) -> fx.Node:
        node = self.graph.call_function(target, args)  # type: ignore[arg-type]
        node.meta["custom"] = {"module_fqn": fqn}
        if backward:
            node.meta["autograd_backward"] = True
        return node

    def gather(self, shard: fx.Node, fqn: str, backward: bool = False) -> fx.Node:
        start = self.call(_c10d.all_gather_into_tensor.default, (shard, 2, "0"), fqn, backward)
        return self.call(_c10d.wait_tensor.default, (start,), fqn, backward)

    def scatter(self, grad: fx.Node, fqn: str) -> fx.Node:
        start = self.call(_c10d.reduce_scatter_tensor.default, (grad, "sum", 2, "0"), fqn, True)
        return self.call(_c10d.wait_tensor.default, (start,), fqn, True)

    def finish(self, outputs: Sequence[fx.Node]) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return with_fake_values(fx.GraphModule(torch.nn.Module(), self.graph), self.inputs)


def _whole_step(update: Callable[[_Graph, list[fx.Node], list[fx.Node]], list[fx.Node]]) -> fx.GraphModule:
    """A whole step of two linear layers ``l0``, ``l1`` whose inputs are named ``arg0_1 ...`` (no descriptors):
    forward all-gathers, a loss, backward reduce-scatters, and ``update(g, shards, grads)``'s outputs."""
    g = _Graph()
    shards = [g.input(f"arg{2 * i}_1", (DIM // 2, DIM)) for i in range(2)]
    x = g.input("arg4_1", (2, DIM))
    h = x
    saved = []
    for i, shard in enumerate(shards):
        w = g.gather(shard, f"l{i}")
        saved.append((h, w))
        h = g.call(_aten.mm.default, (h, g.call(_aten.t.default, (w,), f"l{i}")), f"l{i}")
    loss = g.call(_aten.sum.default, (h,), "loss")
    gy = g.call(_aten.ones_like.default, (h,), "loss", backward=True)
    grads: list[fx.Node] = [x, x]
    for i in reversed(range(2)):
        hin, w = saved[i]
        grad = g.call(_aten.mm.default, (g.call(_aten.t.default, (gy,), f"l{i}", True), hin), f"l{i}", True)
        grads[i] = g.scatter(grad, f"l{i}")
        gy = g.call(_aten.mm.default, (gy, w), f"l{i}", True)
    return g.finish([loss, *update(g, shards, grads)])


def _roles(gm: fx.GraphModule) -> list[tuple[str, str, str | None]]:
    return [(c.kind, c.role, c.module_fqn) for c in find_collectives(gm.graph, module_fqn)]


def test_whole_step_inputs_are_parameters_by_structure_whatever_their_names() -> None:
    """Regression: torchtitan's whole-step graphs name inputs ``arg0_1 ...`` and carry no descriptors; a gathered
    input was recognized only by an aot descriptor or a ``primals_`` name, so every all-gather was "other"."""
    gm = _whole_step(lambda g, shards, grads: grads)
    assert _roles(gm) == [("all_gather", "fsdp_all_gather", "l0"), ("all_gather", "fsdp_all_gather", "l1"),
                          ("reduce_scatter", "fsdp_reduce_scatter", "l1"),
                          ("reduce_scatter", "fsdp_reduce_scatter", "l0")]


def test_gradients_consumed_by_an_optimizer_update_traced_into_the_step_are_gradients() -> None:
    """Regression: with the optimizer traced in, a gradient feeds an in-place update of the step's state instead
    of an output; its reduce-scatter was "other" (and the pass warned about FSDP2)."""
    def sgd(g: _Graph, shards: list[fx.Node], grads: list[fx.Node]) -> list[fx.Node]:
        g.call(_aten._foreach_add_.List, (shards, grads), "optim")
        return []

    gm = _whole_step(sgd)
    assert [role for _, role, _ in _roles(gm)] == ["fsdp_all_gather"] * 2 + ["fsdp_reduce_scatter"] * 2
    with compat.fake_process_group(2):
        final = apply(gm, load_config({"strategy": "manual", "plan": {"buckets": [["l0", "l1"]]}}),
                      graph_kind="joint")
    assert final.meta["overlapcfg"].after.total_fsdp == 2  # one all-gather, one reduce-scatter


def test_an_activation_reduction_that_feeds_more_compute_is_not_a_gradient() -> None:
    """The other half of the rule: a reduce-scatter whose result feeds compute (a matmul) on its way to an update
    is an activation's reduction (sequence parallel), not a gradient."""
    def through_compute(g: _Graph, shards: list[fx.Node], grads: list[fx.Node]) -> list[fx.Node]:
        mixed = g.call(_aten.mm.default, (g.call(_aten.t.default, (grads[0],), "l0", True), grads[0]), "l0", True)
        g.call(_aten.add_.Tensor, (shards[0], g.call(_aten.sum.default, (mixed,), "l0", True)), "optim")
        return [grads[1]]

    roles = _roles(_whole_step(through_compute))
    assert roles[2:] == [("reduce_scatter", "fsdp_reduce_scatter", "l1"), ("reduce_scatter", "other", None)]


def test_an_input_the_tracers_state_list_does_not_name_is_never_a_parameter() -> None:
    gm = _whole_step(lambda g, shards, grads: grads)
    found = find_collectives(gm.graph, module_fqn, state_inputs={"arg0_1": "l0.weight"})
    assert [(c.kind, c.fsdp, c.params) for c in found if c.kind == "all_gather"] == [
        ("all_gather", True, ("l0.weight",)), ("all_gather", False, ())]


def test_three_partial_gradients_of_one_weight_are_fsdp_and_owned_by_its_first_user() -> None:
    """Regression: T5/BART share one embedding between encoder, decoder and head: its gradient is
    ``add(add(rs_a, rs_b), rs_c)``. Only two-way sums were recognized; now every partial is FSDP's, owned by the
    module whose partial backward issues last (the first user in forward)."""
    g = _Graph()
    tangent = g.input("tangents_1", (2, DIM))
    saved = g.input("saved", (2, DIM))
    waits = []
    for fqn in ("head", "decoder.embed", "encoder.embed"):  # backward order: the first user's gradient comes last
        grad = g.call(_aten.mm.default, (g.call(_aten.t.default, (tangent,), fqn, True), saved), fqn, True)
        waits.append(g.scatter(grad, fqn))
    total = g.call(_aten.add.Tensor, (g.call(_aten.add.Tensor, (waits[0], waits[1]), "head", True), waits[2]),
                   "head", True)
    gm = g.finish([total])
    assert _roles(gm) == [("reduce_scatter", "fsdp_reduce_scatter", "encoder.embed")] * 3


def _chunked_head(chunks: int, accumulate: Callable[[_Graph, list[fx.Node]], fx.Node]) -> fx.GraphModule:
    """A whole step shaped like torchtitan's chunked loss: ``head``'s weight gathered once, the head run on
    ``chunks`` sequence chunks, each chunk's weight gradient reduce-scattered on its own (as the trace of
    ``chunk_loss.backward()`` per chunk has it) and the partials combined by ``accumulate`` into the returned
    gradient; then ``norm``'s gradient."""
    g = _Graph()
    shard = g.input("arg0_1", (DIM // 2, DIM))
    norm_shard = g.input("arg1_1", (DIM // 2,))
    hidden = g.input("arg2_1", (2, DIM))
    w = g.gather(shard, "head")
    norm_w = g.gather(norm_shard, "norm")
    h = g.call(_aten.mul.Tensor, (hidden, norm_w), "norm")
    waits = []
    for _ in range(chunks):
        logits = g.call(_aten.mm.default, (h, g.call(_aten.t.default, (w,), "head")), "head")
        gy = g.call(_aten.ones_like.default, (logits,), "loss", backward=True)
        grad = g.call(_aten.mm.default, (g.call(_aten.t.default, (gy,), "head", True), h), "head", True)
        waits.append(g.scatter(grad, "head"))
    norm_grad = g.scatter(g.call(_aten.mul.Tensor, (norm_w, norm_w), "norm", True), "norm")
    return g.finish([accumulate(g, waits), norm_grad])


def _in_place_sum(g: _Graph, waits: list[fx.Node]) -> fx.Node:
    """``add_(add_(w0, w1), w2) ...``: what a trace of per-chunk ``.grad`` accumulation leaves."""
    total = waits[0]
    for wait in waits[1:]:
        total = g.call(_aten.add_.Tensor, (total, wait), "head", True)
    return total


HEAD_PLAN = {"buckets": [["norm", "head"]], "require_full_coverage": True}


def test_per_chunk_partial_gradients_accumulated_in_place_are_the_heads_fsdp_reduce_scatters() -> None:
    """Regression (torchtitan's chunked loss): ``lm_head``'s weight gradient is reduce-scattered once per chunk and
    the partials summed in place (``add_``). They were "other": unbucketed, uncounted, and the bucket said ``bw RS
    1 -> 1`` under ``require_full_coverage``. Now all 8 are the head's FSDP reduce-scatters, merged with the norm's
    into the bucket's one reduce-scatter, and the record says what merging them holds."""
    gm = _chunked_head(8, _in_place_sum)
    assert _roles(gm)[2:] == [("reduce_scatter", "fsdp_reduce_scatter", "head")] * 8 + [
        ("reduce_scatter", "fsdp_reduce_scatter", "norm")]
    with compat.fake_process_group(2):
        final = apply(gm, load_config({"strategy": "manual", "plan": HEAD_PLAN}), graph_kind="joint")
    record = final.meta["overlapcfg"]
    assert record.before.get("backward", "reduce_scatter") == 9 and record.before.other == 0
    assert record.after.get("backward", "reduce_scatter") == 1 and record.uncovered == ()
    change = record.buckets[0].changes("backward", "reduce_scatter")
    assert change is not None and (change.before, change.after) == (9, 1)
    held = [n for n in record.notes if "8 reduce-scatters are partial gradients of one parameter of 'head'" in n]
    assert len(held) == 1 and f"({8 * DIM * DIM * 4:,} bytes)" in held[0], record.notes


def test_a_sum_that_also_adds_something_else_is_no_partial_sum() -> None:
    """Only waits (and sums of them) make a partial-gradient sum: a partial added to an activation is not one."""
    def with_extra(g: _Graph, waits: list[fx.Node]) -> fx.Node:
        return g.call(_aten.add_.Tensor, (_in_place_sum(g, waits), g.inputs[2][0]), "head", True)

    roles = [role for _, role, _ in _roles(_chunked_head(3, with_extra))]
    assert roles[2:5] == ["other"] * 3


def test_a_reduce_scatter_on_an_fsdp_group_that_ends_nowhere_known_is_uncovered_and_refused() -> None:
    """Coverage counts every collective: a reduce-scatter on the group FSDP uses, whose result feeds no compute
    (no activation's) yet ends nowhere overlapcfg recognizes as a gradient (here: added to a term computed from the
    shard before it is returned), is counted as uncovered with the cause, and ``require_full_coverage`` refuses the
    graph instead of leaving it silently unbucketed."""
    def decayed(g: _Graph, waits: list[fx.Node]) -> fx.Node:
        decay = g.call(_aten.mul.Tensor, (g.inputs[0][0], 0.1), "head", True)
        return g.call(_aten.add.Tensor, (waits[0], decay), "head", True)

    gm = _chunked_head(1, decayed)
    found = find_collectives(gm.graph, module_fqn)
    odd = [c for c in found if c.kind == "reduce_scatter" and not c.fsdp]
    assert len(odd) == 1 and odd[0].unattributed and "do not end as a parameter's gradient" in odd[0].unattributed
    with compat.fake_process_group(2):
        with pytest.raises(OverlapConfigError, match=r"require_full_coverage: 1 reduce-scatter\(s\) look like FSDP "
                                                     r"gradient reductions"):
            apply(_chunked_head(1, decayed), load_config({"strategy": "manual", "plan": HEAD_PLAN}),
                  graph_kind="joint")
        lenient = {"strategy": "manual", "plan": {"buckets": [["norm", "head"]]}}
        record = apply(gm, load_config(lenient), graph_kind="joint").meta["overlapcfg"]
    assert [u.node for u in record.uncovered] == [odd[0].start.name]
    assert any(n.startswith("overlapcfg: 1 reduce-scatters look like FSDP gradient reductions") for n in record.notes)


def _without_descriptors(gm: fx.GraphModule) -> fx.GraphModule:
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta.pop("desc", None)
    return gm


LAYERS = [[1, 2], [2]]
PLAN = {"buckets": ["layers.*"]}


def test_a_backward_graph_without_descriptors_counts_its_regathers_as_uncovered_and_says_why() -> None:
    """A split backward graph's inputs are saved tensors: without aot's descriptors a saved parameter cannot be
    told from a saved activation, so its re-gathers are not guessed to be FSDP's. They are left alone but counted
    as uncovered with that cause, so ``strict`` and ``require_full_coverage`` refuse the graph loudly."""
    syn = backward_graph(LAYERS, regather=True)
    gm = _without_descriptors(syn.gm)
    with compat.fake_process_group(2):
        final = apply(gm, load_config({"strategy": "manual", "plan": PLAN}), graph_kind="backward",
                      module_fqns=syn.module_fqns)
        record = final.meta["overlapcfg"]
        assert len(record.uncovered) == 3 and record.before.get("backward", "all_gather") == 0
        assert any("look like FSDP parameter gathers" in n and "no aot descriptors" in n for n in record.notes)
        with pytest.raises(UnsupportedGraphError, match=r"3 all-gathers look like FSDP parameter gathers.*strict"):
            apply(_without_descriptors(backward_graph(LAYERS, regather=True).gm),
                  load_config({"strategy": "manual", "plan": PLAN, "strict": True}), graph_kind="backward",
                  module_fqns=syn.module_fqns)
        with pytest.raises(OverlapConfigError, match=r"require_full_coverage: 3 all-gather\(s\) look like FSDP"):
            apply(_without_descriptors(backward_graph(LAYERS, regather=True).gm),
                  load_config({"strategy": "manual", "plan": {**PLAN, "require_full_coverage": True}}),
                  graph_kind="backward", module_fqns=syn.module_fqns)


def test_forward_graph_inputs_need_no_descriptors_or_aot_names() -> None:
    syn = forward_graph(LAYERS)
    for node in syn.gm.graph.find_nodes(op="placeholder"):
        node.name = node.name.replace("primals_", "arg")
    assert [c.role for c in find_collectives(syn.gm.graph, module_fqn)] == ["fsdp_all_gather"] * 3

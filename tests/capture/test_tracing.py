"""Tracing a 2-layer SimpleFSDP Llama: exact collective counts, correct owners, metadata the scheduler relies on,
determinism, meta-device tracing, and passes applied through ``compile_with_pass``."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import fx

from overlapcfg.capture import shard_module
from overlapcfg.compat import fake_process_group
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.tracing import (
    GraphPass,
    StepBackend,
    TracedStep,
    compile_with_pass,
    demo_batch,
    trace_train_step,
    train_step,
)
from overlapcfg.graph.attribution import stack_module_fqn
from tests.support.traces import traced_step

pytestmark = pytest.mark.slow
CFG = LlamaConfig(n_layers=2)
_c10d = torch.ops._c10d_functional


def _expected_params() -> list[tuple[str, str]]:
    """(module FQN, parameter FQN) for every parameter, straight from an unsharded model."""
    return [(name.rpartition(".")[0], name) for name, _ in Llama(CFG).named_parameters()]


def _full_shapes() -> dict[str, torch.Size]:
    return {name: p.shape for name, p in Llama(CFG).named_parameters()}


@pytest.fixture(scope="module")
def traced() -> TracedStep:
    """The suite's shared trace of this model (``tests.support.traces``): the same call, made once per process."""
    return traced_step(CFG.n_layers, reshard_after_forward=False)


@pytest.fixture(scope="module")
def traced_reshard() -> TracedStep:
    return traced_step(CFG.n_layers, reshard_after_forward=True)


def _owners(step: TracedStep, graph: str, kind: str) -> list[tuple[str, str]]:
    return [(c.module_fqn, c.param_fqn) for c in step.collectives_in(graph, kind)]  # type: ignore[arg-type]


def _count(gm: fx.GraphModule, target: object) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


def test_forward_all_gathers_and_backward_reduce_scatters_one_per_parameter(traced: TracedStep) -> None:
    expected = _expected_params()
    assert len(expected) == 1 + 9 * 2 + 2
    assert _count(traced.forward, _c10d.all_gather_into_tensor.default) == len(expected)
    assert _count(traced.backward, _c10d.reduce_scatter_tensor.default) == len(expected)
    assert _count(traced.backward, _c10d.all_gather_into_tensor.default) == 0  # full weights saved for backward
    assert _count(traced.forward, _c10d.reduce_scatter_tensor.default) == 0
    assert sorted(_owners(traced, "forward", "all_gather")) == sorted(expected)
    assert sorted(_owners(traced, "backward", "reduce_scatter")) == sorted(expected)


def test_reshard_after_forward_regathers_every_weight_backward_needs(traced_reshard: TracedStep) -> None:
    expected = _expected_params()
    # An embedding's backward needs only the token ids, so its weight is the one not gathered again.
    regathered = [pair for pair in expected if pair[0] != "tok_embeddings"]
    assert _count(traced_reshard.backward, _c10d.all_gather_into_tensor.default) == len(regathered)
    assert sorted(_owners(traced_reshard, "backward", "all_gather")) == sorted(regathered)
    assert sorted(_owners(traced_reshard, "forward", "all_gather")) == sorted(expected)
    assert sorted(_owners(traced_reshard, "backward", "reduce_scatter")) == sorted(expected)


@pytest.mark.parametrize("which", ["traced", "traced_reshard"])
def test_records_agree_with_shapes_and_module_stacks(which: str, request: pytest.FixtureRequest) -> None:
    """Three independent sources agree: our descriptor-based records, tensor shapes, and the module stacks."""
    step: TracedStep = request.getfixturevalue(which)
    shapes = _full_shapes()
    for rec in step.collectives:
        gm = step.graph(rec.graph)
        node = next(n for n in gm.graph.nodes if n.name == rec.node)
        full = shapes[rec.param_fqn]
        shard = torch.Size((full[0] // 2, *full[1:]))
        out_shape, in_shape = (full, shard) if rec.kind == "all_gather" else (shard, full)
        assert node.meta["val"].shape == out_shape, rec
        assert node.args[0].meta["val"].shape == in_shape, rec
        assert stack_module_fqn(node) == rec.module_fqn, rec
        assert node.meta["overlapcfg"]["owner"] == rec
        wait = next(iter(node.users))
        assert wait.name == rec.wait and wait.target == _c10d.wait_tensor.default


def test_reduce_scatters_sum_over_ranks(traced: TracedStep) -> None:
    ops = {n.args[1] for n in traced.backward.graph.find_nodes(
        op="call_function", target=_c10d.reduce_scatter_tensor.default)}
    assert ops == {"sum"}


def test_collective_metadata_the_scheduler_can_rely_on(traced_reshard: TracedStep) -> None:
    ag, rs = _c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default
    fw_ag = traced_reshard.forward.graph.find_nodes(op="call_function", target=ag)
    bw_ag = traced_reshard.backward.graph.find_nodes(op="call_function", target=ag)
    bw_rs = traced_reshard.backward.graph.find_nodes(op="call_function", target=rs)
    innermost = next(reversed(fw_ag[1].meta["nn_module_stack"].values()))[0]
    assert innermost == "L['self'].layers.0.attention_norm.parametrizations.weight.0"
    assert all("nn_module_stack" in n.meta and "val" in n.meta for n in fw_ag + bw_ag)
    # Backward recomputed gathers are copies of forward nodes: same stack, tagged as forward by the partitioner.
    assert all(n.meta["partitioner_tag"] == "is_forward" for n in bw_ag)
    # Reduce-scatters come from autograd: no nn_module_stack, only the forward stack they are the gradient of.
    assert all("nn_module_stack" not in n.meta and "fwd_nn_module_stack" in n.meta for n in bw_rs)


def test_module_fqns_and_param_owners_are_in_model_order(traced: TracedStep) -> None:
    model_modules = [n for n, _ in Llama(CFG).named_modules() if n]
    assert list(traced.module_fqns) == model_modules
    assert list(traced.param_fqns) == [p for _, p in _expected_params()]
    assert traced.param_owners[:3] == ("tok_embeddings", "layers.0.attention_norm", "layers.0.attention.wq")
    assert traced.param_owners[-2:] == ("norm", "output")
    assert all(".parametrizations" not in m for m in traced.module_fqns)


def test_collectives_are_listed_in_graph_order(traced: TracedStep) -> None:
    for graph in ("forward", "backward"):
        order = {n.name: i for i, n in enumerate(traced.graph(graph).graph.nodes)}
        names = [c.node for c in traced.collectives_in(graph)]
        assert names == sorted(names, key=order.__getitem__)
    # forward gathers follow execution: SwiGLU computes w3 before w2, unlike the definition order
    fw = [c.module_fqn for c in traced.collectives_in("forward")]
    assert fw.index("layers.0.feed_forward.w3") < fw.index("layers.0.feed_forward.w2")


def test_module_fqn_fn_attributes_collectives_without_any_metadata(traced: TracedStep) -> None:
    lookup = traced.module_fqn_fn("backward")
    rs = traced.collectives_in("backward", "reduce_scatter")[0]
    bare = fx.Graph()
    start = bare.placeholder(rs.node)  # same name, no meta
    other = bare.placeholder("unrelated")
    assert lookup(start) == rs.module_fqn
    assert lookup(other) is None


def test_tracing_twice_gives_identical_graphs(traced: TracedStep) -> None:
    again = trace_train_step(CFG, world_size=2, rank=0)
    for graph in ("forward", "backward"):
        first = [(n.name, str(n.target)) for n in traced.graph(graph).graph.nodes]
        assert first == [(n.name, str(n.target)) for n in again.graph(graph).graph.nodes]
    assert again.collectives == traced.collectives


def test_meta_device_tracing_keeps_the_callers_model_unsharded() -> None:
    model = Llama(LlamaConfig(n_layers=1, dim=128, n_heads=8, ffn_hidden=256), device="meta")
    step = trace_train_step(model, world_size=4, rank=2, device="meta")
    assert len(step.collectives_in("forward", "all_gather")) == 1 + 9 + 2
    assert not any("parametrizations" in n for n, _ in model.named_parameters())
    shard = step.forward.graph.find_nodes(op="placeholder")[0].meta["val"]
    assert shard.shape == (256 // 4, 128)


def test_compile_with_pass_applies_passes_to_both_graphs_before_running() -> None:
    seen: list[tuple[str, int]] = []

    def counting(name: str) -> GraphPass:
        def graph_pass(gm: fx.GraphModule) -> fx.GraphModule:
            seen.append((name, sum(1 for n in gm.graph.nodes if "overlapcfg" in n.meta)))
            return gm
        return graph_pass

    model = shard_module(Llama(CFG), world_size=2, rank=0)
    backend = StepBackend(counting("forward"), counting("backward"))
    tokens, targets = demo_batch(CFG.vocab_size)
    with fake_process_group(2, 0):
        loss, grads = train_step(compile_with_pass(model, backend=backend), tokens, targets)
    n = len(_expected_params())
    assert seen == [("forward", 2 * n), ("backward", 2 * n)]  # each start and its wait annotated
    assert loss.shape == () and len(grads) == n
    assert collections.Counter(c.kind for c in backend.collectives["backward"]) == {"reduce_scatter": n}

"""No path to silent corruption: re-bucketing is refused, failures leave the graph as it was, activation gathers
are not taken for FSDP's, unattributable collectives fail a coverage requirement, and a pass that cannot reach
anything says so."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import fx

from overlapcfg import load_config
from overlapcfg.compat import fake_process_group
from overlapcfg.config import contracts
from overlapcfg.demo.tracing import TracedStep
from overlapcfg.errors import OverlapConfigError, UnsupportedGraphError
from overlapcfg.graph.collectives import find_collectives, is_parameter_gather
from overlapcfg.graph.merge import merge_buckets
from overlapcfg.graph.parameters import graph_inputs
from overlapcfg.passes import PassOptions, apply, pipeline
from overlapcfg.strategies import StrategyResult, register_strategy

pytestmark = pytest.mark.slow  # the demo step is traced once per session (conftest)


def _apply(step: TracedStep, gm: fx.GraphModule, cfg: dict[str, Any], **kw: Any) -> fx.GraphModule:
    with fake_process_group(step.world_size, step.rank):
        return apply(gm, load_config(cfg), module_fqn_fn=step.module_fqn_fn("forward"), module_fqns=step.module_fqns,
                     graph_kind="forward", **kw)


def test_re_bucketing_an_applied_graph_is_refused_and_changes_nothing(traced_4l: TracedStep) -> None:
    """Issue: apply(llama_layers) then apply(single_bucket) silently read one layer's slice twice."""
    gm = _apply(traced_4l, copy.deepcopy(traced_4l.forward), {"plan": "llama_layers"})
    code = gm.code
    with pytest.raises(UnsupportedGraphError, match="already bucketed"):
        _apply(traced_4l, gm, {"plan": "single_bucket"})
    assert gm.code == code


def test_a_graph_bucketed_by_torch_is_refused_too(traced_2l: TracedStep) -> None:
    gm = _apply(traced_2l, copy.deepcopy(traced_2l.forward), {"strategy": "torch_manual", "plan": "llama_layers"})
    with pytest.raises(UnsupportedGraphError, match="already bucketed"):
        _apply(traced_2l, gm, {"plan": "llama_layers"})


@pytest.fixture
def failing_strategy() -> Iterator[str]:
    """A strategy that merges every bucket, then fails: the pass must put the graph back."""
    saved_contracts = dict(contracts._CONTRACTS)

    @register_strategy("merge_then_fail")
    def run(gm: fx.GraphModule, ctx: Any) -> StrategyResult:
        merge_buckets(gm, ctx.covered, ctx.plan, "custom_ops")
        raise RuntimeError("strategy failed half-way")

    yield "merge_then_fail"
    contracts._CONTRACTS.clear()
    contracts._CONTRACTS.update(saved_contracts)


def test_a_failing_strategy_leaves_the_graph_untouched(traced_2l: TracedStep, failing_strategy: str) -> None:
    gm = copy.deepcopy(traced_2l.forward)
    code, nodes = gm.code, len(gm.graph.nodes)
    with pytest.raises(RuntimeError, match="half-way"):
        _apply(traced_2l, gm, {"strategy": failing_strategy, "plan": "llama_layers"})
    gm.graph.lint()
    assert (gm.code, len(gm.graph.nodes)) == (code, nodes)
    assert "overlapcfg" not in gm.meta


def test_an_activation_gather_is_not_taken_for_an_fsdp_gather(traced_2l: TracedStep) -> None:
    """A sequence-parallel gather of the embedding output has parameters among its inputs' ancestors, but
    compute between them: it is left alone, and the pass around it still works."""
    gm = copy.deepcopy(traced_2l.forward)
    graph = gm.graph
    embedding = next(n for n in graph.nodes if n.target == torch.ops.aten.embedding.default)
    with graph.inserting_after(embedding):
        gather = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default,
                                     (embedding, 2, "0"))
        gather.meta["val"] = torch.empty((2 * embedding.meta["val"].shape[0], *embedding.meta["val"].shape[1:]))
    with graph.inserting_after(gather):
        wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (gather,))
        wait.meta["val"] = gather.meta["val"]
    output = next(iter(graph.find_nodes(op="output")))
    output.args = ((*output.args[0], wait),)
    gm.recompile()
    assert not is_parameter_gather(gather, graph_inputs(graph, backward=False))
    gm = _apply(traced_2l, gm, {"plan": "llama_layers"})
    record = gm.meta["overlapcfg"]
    assert gather.name in record.non_fsdp
    assert record.after.get("forward", "all_gather") == 4


def test_require_full_coverage_fails_when_collectives_cannot_be_attributed(traced_2l: TracedStep) -> None:
    gm = copy.deepcopy(traced_2l.forward)
    for node in gm.graph.nodes:
        for key in ("nn_module_stack", "fwd_nn_module_stack", "custom", "overlapcfg"):
            node.meta.pop(key, None)
    code = gm.code
    cfg = load_config({"plan": {"buckets": ["tok_embeddings", "layers.*", ["norm", "output"]],
                                "require_full_coverage": True}})
    with fake_process_group(2), pytest.raises(OverlapConfigError, match="cannot be attributed"):
        apply(gm, cfg, module_fqns=traced_2l.module_fqns, graph_kind="forward")
    assert gm.code == code


def test_a_plan_that_reaches_no_collective_warns_once_and_strict_makes_it_an_error(
        traced_2l: TracedStep, caplog: pytest.LogCaptureFixture) -> None:
    gm = copy.deepcopy(traced_2l.forward)
    for node in gm.graph.nodes:
        for key in ("nn_module_stack", "fwd_nn_module_stack", "custom", "overlapcfg"):
            node.meta.pop(key, None)
    pipeline._WARNED.clear()
    cfg = {"plan": {"buckets": ["tok_embeddings", "layers.*", ["norm", "output"]]}}
    with fake_process_group(2), caplog.at_level(logging.WARNING, logger="overlapcfg.passes.pipeline"):
        apply(copy.deepcopy(gm), load_config(cfg), module_fqns=traced_2l.module_fqns, graph_kind="forward")
        apply(copy.deepcopy(gm), load_config(cfg), module_fqns=traced_2l.module_fqns, graph_kind="forward")
    warnings = [r for r in caplog.records if "lands in a bucket" in r.getMessage()]
    assert len(warnings) == 1 and "module_fqn_fn" in warnings[0].getMessage()
    with fake_process_group(2), pytest.raises(UnsupportedGraphError, match="strict"):
        apply(gm, load_config({**cfg, "strict": True}), module_fqns=traced_2l.module_fqns, graph_kind="forward")


def test_a_graph_without_fsdp_collectives_warns_with_the_fsdp2_hint(caplog: pytest.LogCaptureFixture) -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.relu.default, (x,)),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    pipeline._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="overlapcfg.passes.pipeline"):
        apply(gm, load_config({"plan": "llama_layers"}))
    assert any("FSDP2" in r.getMessage() and "overlapcfg.fully_shard" in r.getMessage() for r in caplog.records)
    with pytest.raises(UnsupportedGraphError):
        apply(gm, load_config({"plan": "llama_layers", "strict": True}))
    with pytest.raises(UnsupportedGraphError):  # the keyword, for code that builds configs elsewhere
        apply(gm, load_config({"plan": "llama_layers"}), options=PassOptions(strict=True))


def test_apply_takes_a_validated_config_only() -> None:
    with pytest.raises(TypeError, match="load_config"):
        apply(fx.GraphModule(torch.nn.Module(), fx.Graph()), {"plan": "llama_layers"})  # type: ignore[arg-type]


def test_find_collectives_classifies_the_demo_graphs_as_fsdp(traced_2l: TracedStep) -> None:
    found = find_collectives(traced_2l.forward.graph, traced_2l.module_fqn_fn("forward"), direction="forward")
    assert found and all(c.fsdp for c in found)


def test_apply_outside_a_process_group_says_what_is_needed() -> None:
    """Issue 14: torch's 'Could not resolve the process group' RuntimeError instead of what to do."""
    from tests.support.synthetic import forward_graph

    built = forward_graph([[2], [2]])
    code = built.gm.code
    with pytest.raises(UnsupportedGraphError, match="needs the process group"):
        apply(built.gm, load_config({"plan": {"buckets": ["layers.*"]}}), module_fqns=built.module_fqns,
              graph_kind="forward")
    assert built.gm.code == code


def test_the_backend_checks_attribution_against_the_model_it_is_given() -> None:
    """With ``model=``, patterns match its named_modules() and every attributed parameter must be one of its own:
    a parameter the model does not have is an AttributionError, not a silent assignment."""
    from overlapcfg.capture import shard_module
    from overlapcfg.demo import Llama, LlamaConfig
    from overlapcfg.demo.tracing import compile_with_pass, demo_batch, train_step
    from overlapcfg.errors import AttributionError
    from overlapcfg.passes.compile import backend

    cfg = LlamaConfig(n_layers=1, dim=32, n_heads=2, ffn_hidden=64, vocab_size=64)
    model = shard_module(Llama(cfg), world_size=2, rank=0)
    tokens, targets = demo_batch(cfg.vocab_size)
    with fake_process_group(2):
        good = backend({"plan": "llama_layers"}, model=model)
        train_step(compile_with_pass(model, backend=good), tokens, targets)
        assert "layers.0.attention.wq" in good.module_fqns
        assert good.graphs["forward"].meta["overlapcfg"].after.get("forward", "all_gather") == 3  # 3 buckets
        # The plan's modules exist in the stranger (the backend checks that when built), its parameters do not.
        stranger = torch.nn.Module()
        for name in ("tok_embeddings", "norm", "output"):
            stranger.add_module(name, torch.nn.Identity())
        stranger.layers = torch.nn.ModuleList([torch.nn.Identity()])
        with pytest.raises(Exception, match="the model does not have") as info:  # dynamo wraps backend errors
            train_step(compile_with_pass(model, backend=backend({"plan": "llama_layers"}, model=stranger)),
                       tokens, targets)
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or getattr(err, "inner_exception", None)
    assert any(isinstance(e, AttributionError) for e in chain)

"""``overlapcfg.verify`` catches deliberately broken graphs and names the offending node; ``apply``'s edges: a
graph without FSDP collectives, collectives outside the plan, and config errors that must leave the graph as is.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import fx

from overlapcfg import load_config
from overlapcfg.compat import fake_process_group
from overlapcfg.demo.tracing import TracedStep
from overlapcfg.errors import OverlapConfigError, OverlapVerificationError
from overlapcfg.graph.verify import summarize, verify
from overlapcfg.passes import apply
from tests.support.traces import ApplyFn, traced_step

pytestmark = pytest.mark.slow

_c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def step() -> TracedStep:
    return traced_step(2, False)


@pytest.fixture
def good(step: TracedStep, applied: ApplyFn) -> fx.GraphModule:
    """A fresh, verified ``manual`` forward graph to break."""
    return applied(step, "forward", {"plan": "llama_layers"})


def _merged_all_gather(gm: fx.GraphModule, bucket: int = 1) -> tuple[fx.Node, fx.Node]:
    for node in gm.graph.nodes:
        tag = node.meta.get("overlapcfg")
        if isinstance(tag, dict) and tag.get("part") == "start" and tag["bucket"] == bucket:
            (wait,) = node.users
            return node, wait
    raise AssertionError(f"no merged all-gather for bucket {bucket}")


def _verify_fails(step: TracedStep, gm: fx.GraphModule) -> str:
    with pytest.raises(OverlapVerificationError) as info:
        verify(step.forward, gm, direction="forward")
    return str(info.value)


# --- good graphs pass --------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["manual", "torch_manual", "none"])
@pytest.mark.parametrize(("reshard", "graph"), [(False, "forward"), (False, "backward"), (True, "backward")])
def test_verify_accepts_every_strategy_output(applied: ApplyFn, reshard: bool, graph: str, strategy: str) -> None:
    step = traced_step(2, reshard)
    gm = applied(step, graph, {"strategy": strategy, "plan": "llama_layers"})  # debug=True verified it already
    assert verify(step.graph(graph), gm, direction=graph) is None  # type: ignore[arg-type]
    assert verify(summarize(step.graph(graph), direction=graph), gm, direction=graph) is None  # type: ignore[arg-type]


# --- broken graphs fail, naming the node -------------------------------------------------------------------

def test_wait_moved_before_its_start_is_caught(step: TracedStep, good: fx.GraphModule) -> None:
    start, wait = _merged_all_gather(good)
    start.prepend(wait)
    message = _verify_fails(step, good)
    assert f"{wait.name}: waits on {start.name} before it is issued" in message


def test_dropped_wait_is_caught(step: TracedStep, good: fx.GraphModule) -> None:
    start, wait = _merged_all_gather(good)
    wait.replace_all_uses_with(start)
    good.graph.erase_node(wait)
    message = _verify_fails(step, good)
    assert f"{start.name}: expected exactly one wait_tensor, found 0" in message
    assert f"{start.name}: read before its wait by" in message


def test_read_of_the_out_buffer_before_the_wait_is_caught(step: TracedStep, good: fx.GraphModule) -> None:
    start, _ = _merged_all_gather(good)
    buffer = start.kwargs["out"]
    with good.graph.inserting_after(start):
        early = good.graph.call_function(torch.ops.aten.clone.default, (buffer,))
    early.meta["val"] = buffer.meta.get("val")
    message = _verify_fails(step, good)
    assert f"{start.name}: output buffer {buffer.name} read before the wait by {early.name}" in message


def test_parameter_dropped_from_a_bucket_is_caught(step: TracedStep, good: fx.GraphModule) -> None:
    start, _ = _merged_all_gather(good)
    copy_in = start.kwargs["out"]
    params = list(copy_in.args[0])
    # Swap one parameter for a same-shaped neighbour: the graph stays well formed, one parameter is lost.
    victim, twin = next((a, b) for a in params for b in params
                        if a is not b and a.meta["val"].shape == b.meta["val"].shape)
    copy_in.args = ([twin if p is victim else p for p in params], *copy_in.args[1:])
    message = _verify_fails(step, good)
    assert f"parameter {victim.name} is no longer all-gathered in forward" in message


def test_consumer_moved_before_its_input_is_caught(step: TracedStep, good: fx.GraphModule) -> None:
    _, wait = _merged_all_gather(good)
    consumer = next(iter(wait.users))
    wait.prepend(consumer)
    message = _verify_fails(step, good)
    assert f"{consumer.name}: reads {wait.name} before they are computed" in message


def test_apply_raises_when_a_strategy_breaks_the_graph_and_restores_it(step: TracedStep) -> None:
    from overlapcfg.config import contracts
    from overlapcfg.strategies import StrategyResult
    from overlapcfg.strategies.registry import register_strategy

    @register_strategy("test_breaker")
    def drop_first_wait(gm: fx.GraphModule, ctx: Any) -> StrategyResult:
        wait = next(iter(gm.graph.find_nodes(op="call_function", target=_c10d.wait_tensor.default)))
        wait.replace_all_uses_with(wait.args[0])
        gm.graph.erase_node(wait)
        return StrategyResult()

    try:
        gm = copy.deepcopy(step.forward)
        code = gm.code
        with fake_process_group(step.world_size, step.rank), pytest.raises(OverlapVerificationError) as info:
            apply(gm, load_config({"strategy": "test_breaker", "plan": "llama_layers"}),
                  module_fqn_fn=step.module_fqn_fn("forward"), module_fqns=step.module_fqns, graph_kind="forward")
        assert "overlapcfg[test_breaker]" in str(info.value)
        assert "wait" in str(info.value)
        assert gm.code == code  # verification failed: the graph is put back
    finally:
        contracts._CONTRACTS.pop("test_breaker", None)


# --- apply's edges -----------------------------------------------------------------------------------------

def test_graph_without_fsdp_collectives_is_returned_unchanged_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    from overlapcfg.passes import pipeline

    pipeline._WARNED.clear()
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ x) + 1

    gm = fx.symbolic_trace(f)
    code, nodes = gm.code, [n.name for n in gm.graph.nodes]
    with caplog.at_level(logging.INFO, logger="overlapcfg"):
        out = apply(gm, load_config({"plan": "llama_layers"}), graph_kind="forward")
    assert out is gm
    assert gm.code == code and [n.name for n in gm.graph.nodes] == nodes
    lines = [r for r in caplog.records if r.name.startswith("overlapcfg") and r.levelno >= logging.INFO]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.WARNING and "no FSDP parameter all-gather" in lines[0].getMessage()
    assert gm.meta["overlapcfg"].after.total_fsdp == 0


def test_collectives_outside_the_plan_stay_unmerged_and_are_reported(step: TracedStep, applied: ApplyFn) -> None:
    gm = applied(step, "forward", {"plan": {"buckets": ["layers.*"]}})
    outside = [c for c in step.collectives_in("forward") if not c.module_fqn.startswith("layers.")]
    assert {u.owner for u in gm.meta["overlapcfg"].uncovered} == {"tok_embeddings", "norm", "output"}
    assert [(u.node, u.owner) for u in gm.meta["overlapcfg"].uncovered] == [(c.node, c.module_fqn) for c in outside]
    by_name = {n.name: n for n in gm.graph.nodes}
    for c in outside:  # the original nodes are still there, untouched and unmerged
        assert by_name[c.node].target is _c10d.all_gather_into_tensor.default
        assert "overlapcfg" not in by_name[c.node].meta or "part" not in by_name[c.node].meta["overlapcfg"]
        assert [u.name for u in by_name[c.node].users] == [c.wait]
    assert gm.meta["overlapcfg"].after.get("forward", "all_gather") == 2 + len(outside)


@pytest.mark.parametrize("cfg", [
    {"plan": {"buckets": ["layer.*"]}},
    {"plan": "llama_layers", "policy": {"forward_prefetch": -1}},
    {"plan": "llama_layers", "overrides": [{"match": "layers.9", "forward_prefetch": 0}]},
    {"strategy": "manul", "plan": "llama_layers"},
    {"plan": {"buckets": ["layers.*", "layers.0"]}},
], ids=["bad-pattern", "negative-depth", "override-reaches-nothing", "unknown-strategy", "claimed-twice"])
def test_config_error_leaves_the_graph_untouched(step: TracedStep, cfg: dict[str, Any]) -> None:
    gm = copy.deepcopy(step.forward)
    code, nodes = gm.code, [(n.name, n.target) for n in gm.graph.nodes]
    with fake_process_group(step.world_size, step.rank), pytest.raises(OverlapConfigError):
        apply(gm, load_config(cfg), module_fqn_fn=step.module_fqn_fn("forward"), module_fqns=step.module_fqns,
              graph_kind="forward")
    assert gm.code == code
    assert [(n.name, n.target) for n in gm.graph.nodes] == nodes
    assert "overlapcfg" not in gm.meta


def test_swapped_gradients_are_caught(step: TracedStep, applied: ApplyFn) -> None:
    """Two outputs that are each still reduce-scattered, but each other's gradient: a lost-output check misses it."""
    gm = applied(step, "backward", {"plan": "llama_layers"})
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    a, b = [i for i, v in enumerate(outs) if isinstance(v, fx.Node)][:2]
    outs[a], outs[b] = outs[b], outs[a]
    output.args = (tuple(outs),)
    with pytest.raises(OverlapVerificationError, match=rf"graph output {a} is now the reduce-scattered gradient of"):
        verify(step.backward, gm, direction="backward")


def test_a_bucket_of_many_layers_verifies(applied: ApplyFn) -> None:
    """A merged all-gather of every parameter of an 8-layer model (single_bucket) is still a parameter gather."""
    big = traced_step(8, True)
    for graph in ("forward", "backward"):
        gm = applied(big, graph, {"plan": "single_bucket"})  # applied() runs apply(debug=True), i.e. verify
        assert gm.meta["overlapcfg"].after.total_fsdp == (1 if graph == "forward" else 2)

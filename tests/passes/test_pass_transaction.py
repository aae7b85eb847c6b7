"""``apply`` is transactional without copying the graph up front: a failed pass puts back every node as it was.

The pass keeps a snapshot of the graph (``compat.GraphSnapshot``: references and metadata dicts, no new nodes) and
rebuilds the graph from it only on failure. These tests fail a strategy after it has merged, reordered and edited
the metadata of nodes it kept, in place, and compare the graph afterwards node by node with what it was.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.passes import apply
from overlapcfg.strategies import StrategyResult, manual
from overlapcfg.strategies.registry import register_strategy
from tests.support.synthetic import backward_graph, forward_graph


def _nodes(gm: fx.GraphModule) -> list[tuple[object, ...]]:
    """Every node as a tuple: name, op, target, arguments (nodes by name), type, and its metadata by identity of
    the values (fake tensors do not compare with ``==``)."""
    def name_of(n: fx.Node) -> str:
        return n.name

    return [(n.name, n.op, n.target, fx.map_arg(n.args, name_of), dict(fx.map_arg(n.kwargs, name_of)), n.type,
             {k: id(v) for k, v in n.meta.items()}) for n in gm.graph.nodes]


@pytest.fixture
def edit_then_fail(clean_registry: None) -> str:
    @register_strategy("edit_then_fail")
    def run(gm: fx.GraphModule, ctx: Any) -> StrategyResult:
        manual.run(gm, ctx)  # merges and reorders
        for node in gm.graph.nodes:  # metadata of every node left, edited in place
            node.meta["custom"] = {"edited": True}
            node.meta.pop("val", None)
        raise RuntimeError("failed half-way")

    return "edit_then_fail"


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_failed_apply_puts_back_every_node_its_arguments_and_metadata(edit_then_fail: str, kind: str) -> None:
    syn = forward_graph([[1, 2], [2], [1, 1]]) if kind == "forward" else \
        backward_graph([[1, 2], [2], [1, 1]], regather=True)
    gm = copy.deepcopy(syn.gm)
    before, code = _nodes(gm), gm.code
    cfg = load_config({"strategy": edit_then_fail, "plan": {"buckets": ["layers.*"]}})
    with compat.fake_process_group(2, 0), pytest.raises(RuntimeError, match="half-way"):
        apply(gm, cfg, module_fqns=syn.module_fqns, graph_kind=kind)
    gm.graph.lint()
    assert _nodes(gm) == before
    assert gm.code == code


def test_a_snapshot_rebuilds_the_graph_it_saw_however_the_graph_changed_since() -> None:
    syn = forward_graph([[1], [2]])
    gm = copy.deepcopy(syn.gm)
    before = _nodes(gm)
    snapshot = compat.GraphSnapshot(gm.graph)
    wait = next(n for n in gm.graph.nodes if n.target is compat.WAIT_TENSOR)
    wait.replace_all_uses_with(wait.args[0])  # rewires its users' arguments
    gm.graph.erase_node(wait)
    output = next(iter(gm.graph.find_nodes(op="output")))
    output.meta["desc"] = "changed"
    gm.graph = snapshot.rebuild()
    assert [row[:6] for row in _nodes(gm)] == [row[:6] for row in before]
    assert all(new[6] == old[6] for new, old in zip(_nodes(gm), before, strict=True))
    assert "desc" not in next(iter(gm.graph.find_nodes(op="output"))).meta


def test_a_lazy_copy_owns_its_subgraphs_and_shares_the_rest() -> None:
    """``compat.lazy_graph_module_copy`` (the backend's ``.captured``, ``explain``'s copies): inductor rewrites a
    higher-order op's subgraph in place when it compiles the original, so the copy must own its subgraphs; other
    attributes (constants) are shared, as ``GraphModule(gm, graph)`` shares them."""
    import torch

    sub = fx.symbolic_trace(torch.nn.ReLU())
    root = torch.nn.Module()
    root.score = sub
    root.holder = torch.nn.Module()
    root.holder.inner = fx.symbolic_trace(torch.nn.Tanh())
    root.scale = torch.ones(2)
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_module("score", (x,))
    y = graph.call_module("holder.inner", (y,))
    y = graph.call_function(torch.mul, (y, graph.get_attr("scale")))
    graph.output(y)
    gm = fx.GraphModule(root, graph)
    holder_before = gm.holder

    copied = compat.lazy_graph_module_copy(gm)
    assert isinstance(copied, compat.LazyGraphModule)
    assert copied.score is not gm.score and copied.holder.inner is not gm.holder.inner
    assert copied.scale is gm.scale
    assert gm.holder is holder_before and gm.holder.inner is root.holder.inner  # the original is untouched
    nodes = len(copied.score.graph.nodes)
    with gm.score.graph.inserting_before(gm.score.graph.output_node()):  # an in-place rewrite of the original's
        gm.score.graph.call_function(torch.neg, (next(iter(gm.score.graph.nodes)),))
    assert len(copied.score.graph.nodes) == nodes
    inputs = torch.tensor([-1.0, 2.0])
    assert torch.equal(copied(inputs), torch.tanh(torch.relu(inputs)))

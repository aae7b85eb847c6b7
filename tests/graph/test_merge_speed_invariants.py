"""What the merge's shortcuts must leave exactly as upstream's merge leaves it.

``compat.cached_merge_traces`` makes upstream's bucket merge cheaper (one trace per signature, stamped again without
re-checking, metadata built once per bucket, the output node rewired once per bucket, the fake metadata repair only
from outputs whose metadata changed). Node order and inputs are compared with upstream elsewhere
(``test_depth_one_merged_inputs_are_in_upstream_order``); here the fake values every node carries, which inductor
lowers from, and each node's users in order. In the synthetic forward, ``t(w)`` reads each gathered weight: after
merging, a bucket's second weight is a piece of the flat buffer at an offset, and its reader, a view, must say so.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.graph.meta import NAMESPACE
from overlapcfg.graph.stamp import forget_traces
from overlapcfg.passes import PassOptions, apply
from tests.support.releases import upstream_is_the_reference
from tests.support.synthetic import Synthetic, backward_graph, forward_graph

LAYERS = [[1, 2], [1, 2], [2, 3, 1]]
"""The first two layers merge alike: the second is stamped from the first one's trace."""


def _fake_layout(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_fake_layout(v) for v in value)
    return None


def _layouts(gm: fx.GraphModule) -> dict[str, object]:
    return {n.name: _fake_layout(n.meta.get("val")) for n in gm.graph.nodes}


def _wiring(gm: fx.GraphModule) -> list[tuple[str, list[str], list[str], list[str]]]:
    """Each node's users in order (a pass walking ``node.users`` sees this order), its inputs, its metadata keys
    (less what our merge adds on purpose: its record, and which side of autograd a merged node is on)."""
    ours = {NAMESPACE, "autograd_backward", "partitioner_tag"}
    return [(n.name, [u.name for u in n.users], [a.name for a in n.all_input_nodes], sorted(set(n.meta) - ours))
            for n in gm.graph.nodes]


@upstream_is_the_reference
@pytest.mark.parametrize("mode", ["custom_ops", "default"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_depth_one_fake_values_and_users_equal_upstream_node_for_node(kind: str, mode: str) -> None:
    syn = forward_graph(LAYERS) if kind == "forward" else backward_graph(LAYERS, regather=True)
    out = {}
    for strategy in ("manual", "torch_manual"):
        gm = copy.deepcopy(syn.gm)
        cfg = load_config({"strategy": strategy, "plan": {"buckets": ["layers.*"]}, "policy": {"bucket_mode": mode}})
        with compat.fake_process_group(2, 0):
            out[strategy] = apply(gm, cfg, module_fqns=syn.module_fqns, graph_kind=kind)
    got, expected = _layouts(out["manual"]), _layouts(out["torch_manual"])
    assert list(got) == list(expected)
    assert got == expected
    assert _wiring(out["manual"]) == _wiring(out["torch_manual"])
    if kind == "forward":  # the case must need the repair, else this test cannot tell it apart from none
        moved = [n for n in out["torch_manual"].graph.nodes
                 if n.target is torch.ops.aten.t.default and n.meta["val"].storage_offset() != 0]
        assert moved


def _new_values(before: fx.GraphModule, after: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The fake values of the nodes the merge stamped (names the input graph did not have)."""
    old = {n.name for n in before.graph.nodes}
    return {n.name: n.meta["val"] for n in after.graph.nodes
            if n.name not in old and isinstance(n.meta.get("val"), torch.Tensor)}


def _manual(gm: fx.GraphModule, syn: Synthetic) -> fx.GraphModule:
    cfg = load_config({"strategy": "manual", "plan": {"buckets": ["layers.*"]}})
    with compat.fake_process_group(2, 0):
        return apply(gm, cfg, module_fqns=syn.module_fqns, graph_kind="forward")


def test_merge_traces_are_reused_within_a_capture_and_across_captures_with_values_of_each_captures_own() -> None:
    """A second config on the same capture stamps the traces the first made (its merged nodes carry the very same
    fake values) and gives the same graph; ``forget_traces`` makes it trace afresh; a graph of another
    capture (another fake mode) is stamped from the same traces, with fake values of its own mode."""
    forget_traces()  # this capture makes the traces (another test's capture of the same shapes may have)
    syn = forward_graph(LAYERS)
    first = _new_values(syn.gm, _manual(copy.deepcopy(syn.gm), syn))
    again = _new_values(syn.gm, _manual(copy.deepcopy(syn.gm), syn))
    assert list(again) == list(first) and len(first) > 0
    assert all(again[name] is first[name] for name in first)  # stamped from the kept traces
    forget_traces()
    cold = _new_values(syn.gm, _manual(copy.deepcopy(syn.gm), syn))
    assert list(cold) == list(first)
    assert not any(cold[name] is first[name] for name in first)  # traced afresh
    assert {name: _fake_layout(v) for name, v in cold.items()} == {name: _fake_layout(v) for name, v in first.items()}

    other = forward_graph(LAYERS)  # the same layers, another capture
    mode = next(n.meta["val"] for n in other.gm.graph.nodes if n.op == "placeholder").fake_mode
    assert mode is not next(iter(first.values())).fake_mode
    theirs = _new_values(other.gm, _manual(copy.deepcopy(other.gm), other))
    assert list(theirs) == list(first)
    assert all(v.fake_mode is mode for v in theirs.values())


def _propagated(gm: fx.GraphModule) -> dict[str, object]:
    """Every node's fake value as running the whole graph under its fake mode gives it (a fresh value per node,
    storages shared exactly where the ops alias), by name."""
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    return {n.name: v for n, v in compat.propagate_fake_values(gm, inputs).items()}


def _storage_classes(values: dict[str, object]) -> list[list[str]]:
    """Names grouped by the storage their (tensor) value lives in: which nodes alias which."""
    groups: dict[int, list[str]] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            groups.setdefault(compat.storage_id(value), []).append(name)
    return sorted(sorted(g) for g in groups.values())


@pytest.mark.parametrize("mode", ["custom_ops", "default", "coalesced"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_fake_values_for_a_compiler_are_what_running_the_graph_gives(kind: str, mode: str) -> None:
    """``for_compiler=True`` lays the kept trace's layouts on storages of each stamp's own instead of running the
    ops again: every merged node's value must be what running the transformed graph gives, in layout (shape,
    strides, offset, dtype) and in aliasing (which nodes share a storage: a split's pieces share the flat buffer,
    a view of an input shares the input's), with no storage shared between two buckets. (Readers of merged outputs
    keep their own value where its layout is unchanged, as inductor's bucketing leaves them: aliasing is compared
    over the nodes the merge made and the graph's inputs.)"""
    syn = forward_graph(LAYERS) if kind == "forward" else backward_graph(LAYERS, regather=True)
    cfg = load_config({"plan": {"buckets": ["layers.*"]}, "policy": {"bucket_mode": mode}})
    forget_traces()
    with compat.fake_process_group(2, 0):
        gm = apply(copy.deepcopy(syn.gm), cfg, module_fqns=syn.module_fqns, graph_kind=kind,
                   options=PassOptions(for_compiler=True))
        truth = _propagated(gm)
    ours = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op != "output" and "val" in n.meta}
    stamped = [*_new_values(syn.gm, gm), *(n.name for n in gm.graph.find_nodes(op="placeholder"))]
    assert len(stamped) > 10
    assert {name: _fake_layout(ours[name]) for name in ours} == {name: _fake_layout(truth[name]) for name in ours}
    assert _storage_classes({k: ours[k] for k in stamped}) == _storage_classes({k: truth[k] for k in stamped})


def test_fresh_fake_values_do_not_rerun_the_merge_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second and later stamps of a kept trace get their values without running ops (the ~1 ms per node that
    re-running cost on inductor's route): only the first bucket of a signature is traced."""
    syn = forward_graph([[1, 2]] * 4)
    calls: list[object] = []
    real = compat.propagate_fake_values
    monkeypatch.setattr(compat, "propagate_fake_values", lambda *a: calls.append(a) or real(*a))
    forget_traces()
    with compat.fake_process_group(2, 0):
        gm = apply(copy.deepcopy(syn.gm), load_config({"plan": {"buckets": ["layers.*"]}}),
                   module_fqns=syn.module_fqns, graph_kind="forward",
                   options=PassOptions(for_compiler=True))
    assert len(_new_values(syn.gm, gm)) > 20
    assert calls == []

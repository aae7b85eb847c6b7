"""The merge keeps its traces in its own table, bounded, and leaves torch's objects as it found them; its short cuts
give way to the hooks a ``GraphModule`` may carry.

- No attribute is set on the capture's ``FakeTensorMode`` (traces used to hang on it).
- A trace is shared by every capture of the same shapes: another capture is stamped from it without tracing, every
  fake value of its graph belongs to its own mode on storages of its own, and its graph is the one a fresh trace
  gives. At most ``KEPT_TRACES`` traces are kept: one dropped is traced afresh (same graph).
- A module with node-creation hooks sees every node the merge creates, with its arguments; one with replace hooks
  sees every rewrite of a reader, the output node's included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.graph import traces
from overlapcfg.passes import apply
from tests.support.merge_traces import CountedTraces, fake_mode_of, graph_layout, tensor_values
from tests.support.synthetic import Synthetic, backward_graph, forward_graph

LAYERS = [[1, 2], [1, 2]]
CFG = load_config({"plan": {"buckets": ["layers.*"]}})


def _merged(syn: Synthetic, kind: str = "forward", gm: fx.GraphModule | None = None) -> fx.GraphModule:
    with compat.fake_process_group(2, 0):
        return apply(gm if gm is not None else copy.deepcopy(syn.gm), CFG, module_fqns=syn.module_fqns,
                     graph_kind=kind)  # type: ignore[arg-type]


def _merge_values(syn: Synthetic) -> dict[str, torch.Tensor]:
    """The fake values of the nodes the merge made (names the input graph lacks)."""
    old = {n.name for n in syn.gm.graph.nodes}
    return {n.name: n.meta["val"] for n in _merged(syn).graph.nodes
            if n.name not in old and isinstance(n.meta.get("val"), torch.Tensor)}


def test_no_attribute_is_set_on_the_captures_fake_mode() -> None:
    syn = forward_graph(LAYERS)
    mode = fake_mode_of(syn.gm)
    before = dict(vars(mode))
    _merged(syn)
    assert vars(mode).keys() == before.keys()


def test_another_capture_of_the_same_shapes_is_stamped_from_the_kept_trace_with_values_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    traces.forget_traces()
    counted = CountedTraces(monkeypatch)
    first, second = forward_graph(LAYERS), forward_graph(LAYERS)
    assert fake_mode_of(first.gm) is not fake_mode_of(second.gm)
    merged_first = _merged(first)
    traced = counted.calls
    assert traced >= 1
    merged_second = _merged(second)
    assert counted.calls == traced  # nothing traced for the second capture
    traces.forget_traces()
    cold = _merged(forward_graph(LAYERS))  # a third capture, traced afresh
    assert counted.calls == 2 * traced
    assert graph_layout(merged_second) == graph_layout(merged_first) == graph_layout(cold)
    new = {n.name for n in merged_second.graph.nodes} - {n.name for n in second.gm.graph.nodes}
    values = tensor_values(merged_second)
    assert new and all(v.fake_mode is fake_mode_of(second.gm) for v in values)  # no value of the first capture's mode
    theirs = {compat.storage_id(v) for v in tensor_values(merged_first)}
    assert not theirs & {compat.storage_id(v) for v in values}


def test_at_most_kept_traces_are_kept_and_one_dropped_is_traced_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    traces.forget_traces()
    monkeypatch.setattr(traces, "KEPT_TRACES", 1)
    counted = CountedTraces(monkeypatch)
    small = [[1], [1]]  # one signature: both layers gather one 1-row shard
    _merged(forward_graph(small))
    assert counted.calls == 1
    _merged(forward_graph(small))
    assert counted.calls == 1  # kept
    _merged(forward_graph([[2], [2]]))  # another signature: the first is dropped (one kept)
    assert counted.calls == 2
    again = _merged(forward_graph(small))
    assert counted.calls == 3  # traced afresh
    assert graph_layout(again) == graph_layout(_merged(forward_graph(small)))
    assert counted.calls == 3


def test_node_creation_hooks_see_every_merged_node_with_its_arguments() -> None:
    syn = forward_graph(LAYERS)  # both layers alike: the second bucket is stamped from the first one's trace
    gm = copy.deepcopy(syn.gm)
    seen: list[tuple[str, int]] = []
    gm._register_create_node_hook(lambda node: seen.append((node.name, len(node.args))))
    merged = _merged(syn, gm=gm)
    made = {n.name for n in merged.graph.nodes} - {n.name for n in syn.gm.graph.nodes}
    assert made and made <= {name for name, _ in seen}
    assert all(nargs > 0 for name, nargs in seen if name in made)


def test_replace_hooks_see_the_output_rewritten_once_per_gradient() -> None:
    syn = backward_graph(LAYERS)  # the output node reads every reduce-scattered gradient
    gm = copy.deepcopy(syn.gm)
    rewrites: list[tuple[str, str]] = []
    gm._register_replace_node_hook(lambda old, new, user: rewrites.append((user.name, old.name)))
    _merged(syn, "backward", gm=gm)
    gradients = len(syn.owners)
    assert sum(1 for user, _ in rewrites if user == "output") == gradients

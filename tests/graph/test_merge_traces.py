"""The merge keeps its traces in its own table, bounded, and leaves torch's objects as it found them; its short cuts
give way to the hooks a ``GraphModule`` may carry.

- No attribute is set on the capture's ``FakeTensorMode`` (traces used to hang on it).
- Traces of at most ``KEPT_CAPTURES`` captures are kept: a capture merged again after more than that many others is
  traced afresh (same graph), the most recent one is stamped from its kept traces.
- A module with node-creation hooks sees every node the merge creates, with its arguments; one with replace hooks
  sees every rewrite of a reader, the output node's included.
"""

from __future__ import annotations

import copy

import torch
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.graph import traces
from overlapcfg.passes import apply
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


def _mode(syn: Synthetic) -> object:
    return next(n.meta["val"] for n in syn.gm.graph.nodes if n.op == "placeholder").fake_mode


def test_no_attribute_is_set_on_the_captures_fake_mode() -> None:
    syn = forward_graph(LAYERS)
    mode = _mode(syn)
    before = dict(vars(mode))
    _merged(syn)
    assert vars(mode).keys() == before.keys()


def test_traces_of_the_most_recent_captures_are_kept_and_older_ones_dropped() -> None:
    traces.forget_traces()
    captures = [forward_graph(LAYERS) for _ in range(traces.KEPT_CAPTURES + 1)]
    first = _merge_values(captures[0])
    for other in captures[1:]:
        _merge_values(other)
    again = _merge_values(captures[0])  # dropped (the oldest of KEPT_CAPTURES + 1): traced afresh
    assert list(again) == list(first)
    assert not any(again[name] is first[name] for name in first)
    latest = _merge_values(captures[-2])  # still among the most recent: stamped from its kept traces
    assert all(_merge_values(captures[-2])[name] is latest[name] for name in latest)


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

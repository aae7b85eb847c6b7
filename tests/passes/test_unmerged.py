"""``policy.unmerged``: a kind left one collective per parameter is still scheduled with its bucket (prefetched by
its depth, its waits delayed by its delay) but no node is added or removed for it; the result is verified; eager
FSDP2, which cannot honour it, refuses it; the schema refuses nonsense.

Fast tier: synthetic graphs (``tests.support.synthetic``) under a fake process group.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from torch import fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.errors import OverlapConfigError
from overlapcfg.graph.collectives import collective_kind, is_collective_start, started_by
from overlapcfg.graph.meta import merged_mark
from overlapcfg.passes import apply
from tests.support.synthetic import backward_graph, forward_graph

LAYERS = [[2, 1], [1, 3], [2], [1, 1]]


def _apply(policy: dict[str, Any], graph: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    syn = backward_graph(LAYERS, regather=True) if graph == "backward" else forward_graph(LAYERS)
    cfg = overlapcfg.load_config({"plan": {"buckets": ["layers.*"]}, "policy": policy})
    original = fx.GraphModule(syn.gm, syn.gm.graph.__deepcopy__())
    with compat.fake_process_group(2):
        return original, apply(syn.gm, cfg, graph_kind=graph, module_fqns=syn.module_fqns)  # verified by default


def _kinds(gm: fx.GraphModule) -> Counter[str]:
    return Counter(collective_kind(n) for n in gm.graph.nodes if is_collective_start(n))


@pytest.mark.parametrize("unmerged", [["reduce_scatter"], ["all_gather"], ["all_gather", "reduce_scatter"]])
def test_an_unmerged_kind_keeps_its_collectives_and_the_others_merge(unmerged: list[str]) -> None:
    original, gm = _apply({"backward_prefetch": 1, "reduce_scatter_delay": 1, "unmerged": unmerged}, "backward")
    before, after = _kinds(original), _kinds(gm)
    for kind in ("all_gather", "reduce_scatter"):
        if kind in unmerged:
            assert after[kind] == before[kind], kind
        else:
            assert after[kind] == len(LAYERS), kind  # one per bucket
    if unmerged == ["all_gather", "reduce_scatter"]:  # nothing merged: the same nodes, only their order moved
        assert sorted(n.name for n in gm.graph.nodes) == sorted(n.name for n in original.graph.nodes)
    for n in gm.graph.nodes:  # every start knows its bucket (the scheduler and the tuner's profile read it)
        if is_collective_start(n):
            assert merged_mark(n) is not None, n.name


def test_unmerged_reduce_scatters_are_still_delayed_with_their_bucket() -> None:
    """Delay 1: every wait of bucket i's reduce-scatters comes after the reduce-scatter starts of bucket i + 1."""
    _, gm = _apply({"reduce_scatter_delay": 1, "unmerged": ["reduce_scatter"]}, "backward")
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    starts: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    for n in gm.graph.nodes:
        mark = merged_mark(n)
        if mark is None or mark.kind != "reduce_scatter":
            continue
        (starts if is_collective_start(n) else waits).setdefault(mark.bucket, []).append(pos[n])
    order = sorted(starts, key=lambda b: min(starts[b]))  # buckets in the order their gradients are reduced
    assert all(len(starts[b]) == len(LAYERS[b]) for b in order)  # one per parameter
    for this, following in itertools.pairwise(order):
        assert min(waits[this]) > max(starts[following]), (this, following)


def test_unmerged_all_gathers_are_prefetched_together_with_their_bucket() -> None:
    """Forward depth 1: bucket i + 1's all-gathers are all issued before bucket i's first wait."""
    _, gm = _apply({"forward_prefetch": 1, "unmerged": ["all_gather"]}, "forward")
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    issued: dict[int, list[int]] = {}
    first_wait: dict[int, int] = {}
    for n in gm.graph.nodes:
        start = started_by(n)
        mark = merged_mark(n)
        if mark is not None and is_collective_start(n):
            issued.setdefault(mark.bucket, []).append(pos[n])
        elif start is not None and merged_mark(start) is not None:
            b = merged_mark(start).bucket  # type: ignore[union-attr]
            first_wait[b] = min(first_wait.get(b, pos[n]), pos[n])
    order = sorted(first_wait, key=first_wait.__getitem__)
    assert all(len(issued[b]) == len(LAYERS[b]) for b in order)  # one per parameter
    for this, following in itertools.pairwise(order):
        assert max(issued[following]) < first_wait[this], (this, following)


def test_unmerged_takes_each_kind_once_and_torch_manual_has_no_such_knob() -> None:
    with pytest.raises(OverlapConfigError, match="each kind at most once"):
        overlapcfg.load_config({"plan": "llama_layers", "policy": {"unmerged": ["all_gather", "all_gather"]}})
    with pytest.raises(OverlapConfigError, match="unmerged"):
        overlapcfg.load_config({"strategy": "torch_manual", "plan": "llama_layers",
                                "policy": {"unmerged": ["reduce_scatter"]}})
    cfg = overlapcfg.load_config({"plan": "llama_layers", "policy": {"unmerged": ["reduce_scatter", "all_gather"]}})
    assert cfg.policy.unmerged == ("all_gather", "reduce_scatter")  # type: ignore[attr-defined]


def test_eager_fsdp2_refuses_unmerged() -> None:
    from overlapcfg.fsdp2.checks import check_config

    cfg = overlapcfg.load_config({"plan": "llama_layers", "policy": {"unmerged": ["reduce_scatter"]}})
    faults = check_config(cfg)  # relative to the config; the driver names them where the user put it
    assert [cfg.mount.show(f.path) for f in faults] == ["overlap.policy.unmerged"]
    assert "cannot leave ['reduce_scatter'] unmerged" in faults[0].message

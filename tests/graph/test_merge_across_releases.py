"""On every supported torch release the merge emits torch 2.13's graph: the same ops, arguments and order.

The bucket merge is overlapcfg's own (``overlapcfg.graph.bucket_fns``, ``overlapcfg.graph.stamp``): on torch 2.13
it is node for node what upstream's ``manual_overlap_bucketing`` emits (``test_merge_speed_invariants.py`` compares
them there), and on 2.11 and 2.14, whose own merges differ (2.11 copies in with ``_foreach_copy_``, 2.14 orders the
depth-1 backward otherwise), it must still be that graph. ``golden/merged_graphs.json`` holds the graphs torch 2.13
gives for the synthetic forward and backward, per bucket mode and depth; each release's are compared with it, on
2.13 name for name. Elsewhere node names are not compared (``make_fx`` names nodes after their ops), nor views
that are the tensor itself: ``make_fx`` on torch 2.14 spells a ``reshape`` to the same shape ``aten.alias`` where
2.13 spells it ``aten.view`` to that shape, and puts an ``alias`` before a reshape's copy. The other differences
releases impose are in the copy-in's arguments (torch 2.11's ``_pre_bucket_all_gather`` also takes
the group's name; its dtypes are indices into a table of torch's dtypes, which grows between releases), so copy-in
arguments are compared by name, ``group_name`` left out, dtypes by name.

Regenerate on torch 2.13 only, after a deliberate change to what the merge emits:
``OVERLAPCFG_REGENERATE_GOLDEN=1 python -m pytest tests/graph/test_merge_across_releases.py``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.passes import apply
from tests.support.synthetic import backward_graph, forward_graph

GOLDEN = Path(__file__).parent / "golden" / "merged_graphs.json"
LAYERS = [[1, 2], [1, 2], [2, 3, 1]]
CASES = [(kind, mode, depth) for kind in ("forward", "backward") for mode in ("custom_ops", "default", "coalesced")
         for depth in (1, 2) if not (kind == "forward" and mode == "coalesced")]


def _arg(value: object) -> Any:
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        return [_arg(v) for v in value]
    if isinstance(value, dict):
        return {k: _arg(v) for k, v in value.items()}
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    return value


def _node(n: fx.Node) -> list[Any]:
    if n.target is compat.pre_bucket_all_gather:
        bound = compat.pre_bucket_all_gather_arguments(n.args, n.kwargs)
        bound.pop("group_name", None)
        # dtypes travel as indices into a table of every torch dtype, which grows between releases
        bound["out_dtype_ints"] = [str(compat.bucket_dtype_table[i]) for i in bound["out_dtype_ints"]]  # type: ignore[union-attr]
        return [n.name, str(n.target), _arg(bound)]
    return [n.name, n.op, str(n.target), _arg(n.args), _arg(n.kwargs)]


def _structure(nodes: list[list[Any]], shapes: dict[str, list[int]]) -> list[list[Any]]:
    """``nodes`` (as ``_node`` writes them) with names replaced by positions and the identity views left out (an
    ``alias``, or a ``view`` to the input's own shape: each reader reads the input instead): what a graph computes
    and in which order, whatever ``make_fx`` of this release calls its nodes and however it spells "this tensor"."""
    same: dict[str, str] = {}
    kept: list[list[Any]] = []
    for node in nodes:
        name, rest = node[0], node[1:]
        if rest[:2] == ["call_function", "aten.alias.default"] or (
                rest[:2] == ["call_function", "aten.view.default"] and len(rest[2]) == 2
                and shapes.get(rest[2][0][1:]) == list(rest[2][1])):
            source = rest[2][0][1:]
            same[name] = same.get(source, source)
            continue
        kept.append(node)
    position = {node[0]: i for i, node in enumerate(kept)}

    def rename(value: Any) -> Any:
        if isinstance(value, str) and value.startswith("%"):
            return f"%{position[same.get(value[1:], value[1:])]}"
        if isinstance(value, list):
            return [rename(v) for v in value]
        if isinstance(value, dict):
            return {k: rename(v) for k, v in value.items()}
        return value

    return [rename(node[1:]) for node in kept]


def _merged(kind: str, mode: str, depth: int) -> list[list[Any]]:
    syn = forward_graph(LAYERS) if kind == "forward" else backward_graph(LAYERS, regather=True)
    cfg = load_config({"plan": {"buckets": ["layers.*"]}, "policy": {
        "bucket_mode": mode, "forward_prefetch": depth, "backward_prefetch": depth, "reduce_scatter_delay": depth}})
    with compat.fake_process_group(2, 0):
        gm = apply(copy.deepcopy(syn.gm), cfg, module_fqns=syn.module_fqns, graph_kind=kind)
    return [_node(n) for n in gm.graph.nodes] + [["shapes", {n.name: list(n.meta["val"].shape) for n in gm.graph.nodes
                                                            if isinstance(n.meta.get("val"), torch.Tensor)}]]


def _key(kind: str, mode: str, depth: int) -> str:
    return f"{kind}/{mode}/depth {depth}"


def test_the_golden_graphs_were_made_on_torch_2_13_and_cover_every_case() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert golden["torch"].startswith("2.13.")
    assert sorted(golden["graphs"]) == sorted(_key(*case) for case in CASES)


@pytest.mark.parametrize(("kind", "mode", "depth"), CASES)
def test_the_merge_emits_torch_2_13s_graph_on_this_release(kind: str, mode: str, depth: int) -> None:
    got = _merged(kind, mode, depth)
    if os.environ.get("OVERLAPCFG_REGENERATE_GOLDEN") and torch.__version__.startswith("2.13."):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"graphs": {}}
        golden["torch"] = torch.__version__
        golden["graphs"][_key(kind, mode, depth)] = got
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())["graphs"][_key(kind, mode, depth)]
    if torch.__version__.startswith("2.13."):
        assert got == expected
    else:
        assert _structure(got[:-1], got[-1][1]) == _structure(expected[:-1], expected[-1][1])

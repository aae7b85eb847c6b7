"""The op vocabulary (``overlapcfg.graph.ops``) is one: the verifier, attribution and the cost model read the same
families and the same schema facts, so a new op variant lands everywhere at once. Fast: hand-built graphs only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from overlapcfg import compat, load_config
from overlapcfg.cost.price import node_kind
from overlapcfg.errors import OverlapVerificationError
from overlapcfg.graph.meta import merged_mark
from overlapcfg.graph.ops import started_by, wait_of
from overlapcfg.graph.parameters import placeholder_sources
from overlapcfg.graph.verify import verify
from overlapcfg.passes import apply
from tests.support.synthetic import forward_graph

_aten = torch.ops.aten


def _read_then_overwrite(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
    piece = _aten.split.Tensor(x, 2)[0]
    scaled = _aten.mul.Tensor(piece, 2)
    _aten.copy_.default(x, y)  # after the read: the product saw x's old bytes
    return (scaled,)


def test_a_write_moved_before_a_reader_of_a_split_piece_is_caught() -> None:
    """A piece of ``split`` is a view of its source (its schema: ``Tensor(a -> *) self -> Tensor(a)[]``), so a
    write into the source moved before the piece's reader changes what the reader reads."""
    before = make_fx(_read_then_overwrite, tracing_mode="fake")(torch.randn(4), torch.randn(4))
    after = copy.deepcopy(before)
    mul = next(n for n in after.graph.nodes if n.target is _aten.mul.Tensor)
    write = next(n for n in after.graph.nodes if n.target is _aten.copy_.default)
    mul.prepend(write)  # the write now runs first: mul reads y's bytes through the piece
    after.recompile()
    verify(before, copy.deepcopy(before))  # unchanged: accepted
    with pytest.raises(OverlapVerificationError, match=r"mul.*args\[0\]: reads .*before it read"):
        verify(before, after)


def test_an_unsafe_view_between_a_parameter_and_its_all_gather_is_transparent() -> None:
    """``_unsafe_view`` moves bytes like ``view`` (the verifier interprets it as a reshape); attribution sees
    through it too, so the gather's parameter input is found."""
    graph = fx.Graph()
    shard = graph.placeholder("primals_1")
    flat = graph.call_function(_aten._unsafe_view.default, (shard, [8]))
    start = graph.call_function(compat.ALL_GATHER_INTO_TENSOR, (flat, 2, "0"))
    graph.output((graph.call_function(compat.WAIT_TENSOR, (start,)),))
    assert placeholder_sources(start) == (shard,)


def _wrapped_forward() -> fx.GraphModule:
    """Three one-parameter layers, bucketed per layer, waits wrapped in ``control_deps`` (``insert_overlap_deps``)."""
    cfg = load_config({"plan": {"buckets": ["layers.*"]}, "policy": {"insert_overlap_deps": True}})
    with compat.fake_process_group(2, 0):
        return apply(forward_graph([[1], [1], [1]]).gm, cfg, graph_kind="forward")


def test_a_control_deps_wrapped_wait_is_a_wait_to_every_stage() -> None:
    """Classification, cost and the merged marks agree on what a wrapped wait is: the wait of its start."""
    gm = _wrapped_forward()
    wrapped = [n for n in gm.graph.nodes if n.target is compat.control_deps]
    assert wrapped, "insert_overlap_deps wrapped nothing"
    for wait in wrapped:
        start = started_by(wait)
        assert start is not None and wait_of(start) is wait
        assert node_kind(wait) == "wait" and node_kind(start) == "collective"
        assert merged_mark(wait).part == "wait" and merged_mark(start).part == "start"  # type: ignore[union-attr]
    graph = fx.Graph()
    node = graph.call_function(_aten._unsafe_view.default, (graph.placeholder("x"), [8]))
    graph.output((node,))
    assert node_kind(node) == "free"


def test_merged_nodes_say_which_part_of_the_collective_they_are() -> None:
    """The mark merging leaves on a start and its waits names the part (``start`` / ``wait``), a word apart from
    ``Collective.role`` (what the collective does for data parallelism)."""
    marks = [n.meta["overlapcfg"] for n in _wrapped_forward().graph.nodes if "overlapcfg" in n.meta]
    assert sorted(m["part"] for m in marks) == ["start"] * 3 + ["wait"] * 3
    assert all("role" not in m for m in marks)

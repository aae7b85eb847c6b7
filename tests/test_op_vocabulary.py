"""The op vocabulary is one: the verifier, attribution and the cost model read the same families and the same schema
facts, so a new op variant lands everywhere at once. Fast: hand-built graphs only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from overlapcfg.errors import OverlapVerificationError
from overlapcfg.graph.verify import verify

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

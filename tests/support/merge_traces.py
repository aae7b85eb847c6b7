"""What tests of the merge's shared traces (``overlapcfg.graph.traces``) read: how many merge functions were traced,
a graph as a compiler reads it, and whose fake values a graph holds."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from overlapcfg import compat

__all__ = ["CountedTraces", "fake_mode_of", "graph_layout", "tensor_values"]


class CountedTraces:
    """``compat.trace_with_fake_mode`` counted while the test runs (``calls``): how many merge functions were
    traced rather than stamped from a kept trace."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = compat.trace_with_fake_mode

        def counted(*args: object) -> object:
            self.calls += 1
            return real(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(compat, "trace_with_fake_mode", counted)


def graph_layout(gm: fx.GraphModule) -> list[tuple[str, object, str, object]]:
    """Each node's name, target, arguments (by name) and value layout (shape, stride, offset, dtype): the graph as a
    compiler reads it, so two graphs that compare equal here compile alike."""
    def layout(v: object) -> object:
        return (tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype) if isinstance(v, torch.Tensor) else None

    return [(n.name, n.target, str(n.args), layout(n.meta.get("val"))) for n in gm.graph.nodes]


def tensor_values(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The fake tensor values of ``gm``'s nodes (``meta['val']``), in node order."""
    return [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def fake_mode_of(gm: fx.GraphModule) -> object:
    """The fake mode of ``gm``'s first tensor placeholder: the capture's own."""
    return next(n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")
                if isinstance(n.meta.get("val"), torch.Tensor)).fake_mode

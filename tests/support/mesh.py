"""Helpers for the mesh tests (HSDP, FSDP + TP): graph summaries by mesh dimension that read only the final FX
graph (op, group name, inputs), not the pass record. The one-trace parity harness is ``tests/support/variants.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from torch import fx

from overlapcfg.graph.ops import collective_kind, data_inputs, group_name, started_by

__all__ = ["counts_by_dim", "group_signature"]


def counts_by_dim(gm: fx.GraphModule, dims_of: Mapping[str, str]) -> Counter[tuple[str, str]]:
    """``(kind, mesh dimension)`` -> number of collective starts; groups not in ``dims_of`` count as ``"?"``."""
    return Counter((str(collective_kind(n)), dims_of.get(group_name(n), "?"))
                   for n in gm.graph.nodes if collective_kind(n) is not None)


def group_signature(gm: fx.GraphModule, group: str) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]:
    """The collectives of ``group`` in graph order: ``(start, kind, inputs it reads, readers of its waits)``.

    Node names survive the pass for everything it does not merge, so equal signatures before and after mean the
    same collectives, in the same relative order, reading the same values and read by the same consumers.
    """
    out = []
    for node in gm.graph.nodes:
        if collective_kind(node) is None or group_name(node) != group:
            continue
        waits = [u for u in node.users if started_by(u) is node]
        readers = sorted(r.name for w in waits for r in w.users)
        out.append((node.name, str(collective_kind(node)), tuple(n.name for n in data_inputs(node)), tuple(readers)))
    return tuple(out)

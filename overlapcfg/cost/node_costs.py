"""Measured per-node durations, for the simulator and the tuner to use instead of the roofline.

``overlapcfg.measuring`` runs a step's graphs with every node timed (``torch.profiler`` ranges named after the fx
nodes) and keeps, per graph and node name, the median seconds and the node's *signature*: its op and the shapes
and dtypes it reads and writes. ``simulate(..., node_costs=...)`` and ``tune(..., node_costs=...)`` then cost a
node by its measured time when the graph they replay has a node of that name *and* that signature (the same
kernel on the same tensors), and by the roofline otherwise: nodes the pass created (merged copy-ins and copy-outs)
and nodes of a different graph fall back, and the prediction says how much came from which source
(``Simulation.cost_sources``). Only compute-stream nodes are taken (kernels, views); collectives and waits are
the model's, since their time is what the schedule changes.

A profile of the untransformed step serves every config of that step: the pass keeps the nodes it does not
create, names included.

Durations are held to what a measurement can be: a finite number of seconds from 0 to ``MAX_NODE_SECONDS``. NaN,
a negative or an infinite duration, or one of 1e300 s, is an ``OverlapConfigError`` naming the file (``read``)
and the entry, never a node dropped or a step predicted at infinity.

One footing for both sources (``Footing``): the nodes a measurement lacks (the copies a pass creates) are not
priced by the bare roofline, whose clock is the profile's peaks, but by the roofline put on the measurement's
footing: per kind of node, ``scale x roofline`` fitted through the measured nodes (how far this machine's kernels
of that kind are from the profile's peaks). Both sources are the work of a kernel alone; contention is the
simulator's, applied to both alike. ``overlapcfg.measure`` also puts the
durations themselves on the clock of the timed steps (``clock_scale``): the node-timed steps run once, at the end,
under whatever load the machine had then.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import fx

from overlapcfg import compat
from overlapcfg.cost.node_costs_file import (
    HEADER,
    MAX_NODE_SECONDS,
    NODE_COSTS_SCHEMA,
    duration_faults,
    node_costs_data,
    read_node_costs,
)
from overlapcfg.cost.price import iter_tensors, node_kind
from overlapcfg.errors import OverlapConfigError

__all__ = ["MAX_NODE_SECONDS", "MEASURABLE_KINDS", "NODE_COSTS_SCHEMA", "Footing", "NodeCosts", "fit_footing",
           "node_signature"]

MEASURABLE_KINDS = frozenset({"compute", "memory", "free"})
"""Node kinds (``overlapcfg.cost.price.node_kind``) whose measured time replaces the model's."""


def _describe(value: object) -> str:
    tensors = list(iter_tensors(value))
    return ",".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)


def node_signature(node: fx.Node) -> str:
    """``aten.mm(float32[1024, 64],float32[64, 64])->float32[1024, 64]``: the op and the tensors it reads and
    writes (from ``meta["val"]``); two nodes with one signature run the same kernel on the same shapes."""
    inputs = ",".join(_describe(a.meta.get("val")) for a in node.all_input_nodes)
    target = compat.op_name(node.target) if node.op == "call_function" else node.op
    return f"{target}({inputs})->{_describe(node.meta.get('val'))}"


@dataclass(frozen=True, slots=True)
class NodeCosts:
    """Seconds per node of a step's graphs, as measured: ``graphs[graph][node name] = (signature, seconds)``."""

    source: str
    """What was measured, for reports: backend, ranks, which config's graphs, how many steps, when."""
    graphs: Mapping[str, Mapping[str, tuple[str, float]]] = field(default_factory=dict)
    clock_scale: float = 1.0
    """The factor the durations were multiplied by to put them on the clock of the timed steps (1.0: as timed)."""

    def __post_init__(self) -> None:
        faults = duration_faults(self.graphs)
        if faults:
            raise OverlapConfigError(faults, header=HEADER)

    def seconds(self, graph: str, node: fx.Node) -> float | None:
        """The measured time of ``node`` in ``graph``, or None (not measured, or a different kernel there)."""
        entry = self.graphs.get(graph, {}).get(node.name)
        if entry is None or node_kind(node) not in MEASURABLE_KINDS or entry[0] != node_signature(node):
            return None
        return entry[1]

    def __len__(self) -> int:
        return sum(len(nodes) for nodes in self.graphs.values())

    def footing(self, graphs: Iterable[tuple[str, fx.GraphModule]],
                roofline: Callable[[fx.Node], float]) -> Footing:
        """The roofline on this measurement's footing (``fit_footing``), from every measured node of ``graphs``
        (``(name, graph)`` pairs) and its ``roofline`` seconds."""
        pairs = []
        for name, gm in graphs:
            for node in gm.graph.nodes:
                measured = self.seconds(name, node) if node.op == "call_function" else None
                if measured is not None:
                    pairs.append((node_kind(node), roofline(node), measured))
        return fit_footing(pairs)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": NODE_COSTS_SCHEMA, "source": self.source, "clock_scale": self.clock_scale,
                "graphs": {g: {n: {"signature": sig, "seconds": s} for n, (sig, s) in nodes.items()}
                           for g, nodes in self.graphs.items()}}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any], *, where: str | None = None) -> NodeCosts:
        """Read what ``to_json`` wrote (``node_costs.json`` of ``overlapcfg mode=measure``), bounded and checked
        (``overlapcfg.cost.node_costs_file.node_costs_data``): every bad entry is an ``OverlapConfigError``
        (``graphs.forward.mm_3.seconds: ...``); ``where`` names the file in its header."""
        data = node_costs_data(text, where=where)
        return cls(source=data.source, graphs=data.graphs, clock_scale=data.clock_scale)

    @classmethod
    def read(cls, path: str | Path, *, root: str = "node_costs") -> NodeCosts:
        """``from_json`` of a file (``node_costs.json``): its faults name the file; a file that cannot be read is
        an ``OverlapConfigError`` at ``root`` (where the path was given: ``tune.node_costs``)."""
        data = read_node_costs(path, root=root)
        return cls(source=data.source, graphs=data.graphs, clock_scale=data.clock_scale)


ALL = "all"
"""The scale fitted through every measured node, for a kind without enough of its own."""
MIN_PAIRS = 3
"""Measured nodes of a kind needed to fit its scale; fewer, and that kind keeps the bare roofline."""


@dataclass(frozen=True, slots=True)
class Footing:
    """The roofline on a measurement's footing: per node kind (``compute``, ``memory``), ``seconds = scale x
    roofline``; a kind with too few measured nodes of its own takes the scale of all of them together (``ALL``),
    and without any, the bare roofline. A scale and no per-kernel constant: merging
    buckets must only add bytes, the rule the tuner's quick model sums its units' copies by (see
    ``overlapcfg.cost.price.compute_seconds``), so views stay free and a copy costs its bytes, at this machine's
    rate."""

    scales: Mapping[str, float] = field(default_factory=dict)

    def price(self, kind: str, roofline: float) -> float:
        return roofline * self.scales.get(kind, self.scales.get(ALL, 1.0))

    def describe(self) -> str:
        """``compute x1.3 roofline; memory x4.1 roofline``, for reports."""
        return "; ".join(f"{kind} x{scale:.3g} roofline" for kind, scale in self.scales.items())


def fit_footing(pairs: Iterable[tuple[str, float, float]]) -> Footing:
    """Per kind with a roofline (``compute``, ``memory``), the scale minimizing the squared relative error of
    ``scale x roofline`` against the measured seconds over ``(kind, roofline, measured)`` triples: a small kernel
    counts as much as a large one."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for kind, roof, measured in pairs:
        if kind != "free" and roof > 0 and measured > 0 and math.isfinite(measured) and math.isfinite(roof):
            by_kind.setdefault(kind, []).append((roof, measured))
    scales = {}
    pooled = [row for rows in by_kind.values() for row in rows]
    for kind, pairs_of_kind in [*sorted(by_kind.items()), (ALL, pooled)]:
        if len(pairs_of_kind) >= MIN_PAIRS:
            # min sum (b r / m - 1)^2: b = sum(r / m) / sum((r / m)^2)
            ratios = [r / m for r, m in pairs_of_kind]
            scales[kind] = sum(ratios) / sum(x * x for x in ratios)
    return Footing(scales)

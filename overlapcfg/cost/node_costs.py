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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import fx

from overlapcfg import compat
from overlapcfg.config.yaml_files import read_text
from overlapcfg.cost.price import iter_tensors, node_kind
from overlapcfg.errors import Fault, OverlapConfigError, show_value

__all__ = ["MAX_NODE_SECONDS", "MEASURABLE_KINDS", "NODE_COSTS_SCHEMA", "Footing", "NodeCosts", "fit_footing",
           "node_signature"]

NODE_COSTS_SCHEMA = "overlapcfg.node_costs/1"
MEASURABLE_KINDS = frozenset({"compute", "memory", "free"})
"""Node kinds (``overlapcfg.cost.price.node_kind``) whose measured time replaces the model's."""
MAX_NODE_SECONDS = 3600.0
"""Longest duration a node may have: an hour for one kernel of one step is not a measurement (a unit mix-up, a
corrupted file), and it would price the whole step at hours."""
MAX_CLOCK_SCALE = 1000.0
"""Largest ``clock_scale`` a file may carry: the timed steps and the node-timed ones ran on one machine minutes
apart; a thousandfold difference is a corrupted file, not load."""
HEADER = "invalid node costs"


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
        faults = list(_duration_faults(self.graphs))
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
        """Read what ``to_json`` wrote (``node_costs.json`` of ``overlapcfg mode=measure``). Anything else, a
        duration that is not a finite number of seconds from 0 to ``MAX_NODE_SECONDS`` included, is an
        ``OverlapConfigError`` listing every bad entry (``graphs.forward.mm_3.seconds: ...``); ``where`` names the
        file in its header."""
        header = f"{HEADER} in {where!r}" if where else HEADER
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError as err:
            raise OverlapConfigError([Fault("", f"not JSON: {err}")], header=header) from None
        if not isinstance(data, Mapping) or data.get("schema") != NODE_COSTS_SCHEMA:
            got = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
            raise OverlapConfigError([Fault("schema", f"not overlapcfg node costs of schema {NODE_COSTS_SCHEMA!r} "
                                                      f"(got {show_value(got)})")], header=header)
        graphs, faults = _entries(data.get("graphs"))
        if faults:
            raise OverlapConfigError(faults, header=header)
        scale = _number(data.get("clock_scale", 1.0))
        if not (isinstance(scale, float) and math.isfinite(scale) and 0 < scale <= MAX_CLOCK_SCALE):
            raise OverlapConfigError([Fault("clock_scale", f"expected a positive finite factor up to "
                                                           f"{MAX_CLOCK_SCALE:g}, got {show_value(scale)}")],
                                     header=header)
        try:
            return cls(source=str(data.get("source", "")), graphs=graphs, clock_scale=scale)
        except OverlapConfigError as err:
            raise OverlapConfigError(err.faults, header=header) from None

    @classmethod
    def read(cls, path: str | Path, *, root: str = "node_costs") -> NodeCosts:
        """``from_json`` of a file (``node_costs.json``): its faults name the file; a file that cannot be read is
        an ``OverlapConfigError`` at ``root`` (where the path was given: ``tune.node_costs``)."""
        path = Path(path).expanduser()
        text = read_text(path, root, what="node costs file")
        return cls.from_json(text, where=str(path))


def _entries(graphs: Any) -> tuple[dict[str, dict[str, tuple[str, float]]], list[Fault]]:
    """``graphs`` of a ``node_costs.json`` as ``NodeCosts.graphs``, and a fault per entry of the wrong shape."""
    if not isinstance(graphs, Mapping):
        return {}, [Fault("graphs", f"expected a mapping of graph -> node -> {{signature, seconds}}, got "
                                    f"{type(graphs).__name__}")]
    out: dict[str, dict[str, tuple[str, float]]] = {}
    faults = []
    for g, nodes in graphs.items():
        if not isinstance(nodes, Mapping):
            faults.append(Fault(f"graphs.{g}", f"expected a mapping of node -> {{signature, seconds}}, got "
                                               f"{type(nodes).__name__}"))
            continue
        for n, entry in nodes.items():
            where = f"graphs.{g}.{n}"
            if not isinstance(entry, Mapping) or not isinstance(entry.get("signature"), str) or "seconds" not in entry:
                faults.append(Fault(where, "expected {signature: <text>, seconds: <number>}"))
                continue
            out.setdefault(str(g), {})[str(n)] = (entry["signature"], _number(entry["seconds"]))
    return out, faults


def _number(value: Any) -> Any:
    """A JSON number as a float (an integer too); anything else as it is, for the fault to show."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def _duration_faults(graphs: Mapping[str, Mapping[str, tuple[str, float]]]) -> Iterator[Fault]:
    for g, nodes in graphs.items():
        for n, (_, seconds) in nodes.items():
            number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            ok = number and (isinstance(seconds, int) or math.isfinite(seconds)) and 0 <= seconds <= MAX_NODE_SECONDS
            if not ok:
                yield Fault(f"graphs.{g}.{n}.seconds", f"expected a duration in seconds, a finite number from 0 to "
                                                       f"{MAX_NODE_SECONDS:g}, got {show_value(seconds)}")


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

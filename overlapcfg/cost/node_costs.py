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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from overlapcfg import compat
from overlapcfg.cost.price import iter_tensors, node_kind
from overlapcfg.errors import OverlapConfigError

__all__ = ["NODE_COSTS_SCHEMA", "MEASURABLE_KINDS", "NodeCosts", "node_signature"]

NODE_COSTS_SCHEMA = "overlapcfg.node_costs/1"
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

    def seconds(self, graph: str, node: fx.Node) -> float | None:
        """The measured time of ``node`` in ``graph``, or None (not measured, or a different kernel there)."""
        entry = self.graphs.get(graph, {}).get(node.name)
        if entry is None or node_kind(node) not in MEASURABLE_KINDS or entry[0] != node_signature(node):
            return None
        return entry[1]

    def __len__(self) -> int:
        return sum(len(nodes) for nodes in self.graphs.values())

    def to_dict(self) -> dict[str, Any]:
        return {"schema": NODE_COSTS_SCHEMA, "source": self.source,
                "graphs": {g: {n: {"signature": sig, "seconds": s} for n, (sig, s) in nodes.items()}
                           for g, nodes in self.graphs.items()}}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> NodeCosts:
        """Read what ``to_json`` wrote (``node_costs.json`` of ``overlapcfg mode=measure``)."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if data.get("schema") != NODE_COSTS_SCHEMA:
            raise OverlapConfigError(
                f"not overlapcfg node costs of schema {NODE_COSTS_SCHEMA!r} (got {data.get('schema')!r})")
        graphs = {str(g): {str(n): (str(e["signature"]), float(e["seconds"])) for n, e in nodes.items()}
                  for g, nodes in data["graphs"].items()}
        return cls(source=str(data["source"]), graphs=graphs)

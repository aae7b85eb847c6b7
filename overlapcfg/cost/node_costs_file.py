"""Reading a ``node_costs.json`` (what ``overlapcfg mode=measure`` writes) into plain, checked data; torch-free.

Apart from ``overlapcfg.cost.node_costs`` (which prices nodes of fx graphs, and imports torch) so that the
``overlapcfg`` command checks a ``tune.node_costs=<file>`` before it composes anything, in a second, instead of
after importing torch and tracing. The JSON is read with the library's bounds (``overlapcfg.config.json_files``:
size, nesting, values, duplicate keys); every entry is held to what a measurement can be.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlapcfg.config.json_files import parse_json
from overlapcfg.config.yaml_files import read_text
from overlapcfg.errors import Fault, OverlapConfigError, show_value

__all__ = ["HEADER", "MAX_CLOCK_SCALE", "MAX_NODE_SECONDS", "NODE_COSTS_SCHEMA", "NodeCostsData", "duration_faults",
           "node_costs_data", "read_node_costs"]

NODE_COSTS_SCHEMA = "overlapcfg.node_costs/1"
MAX_NODE_SECONDS = 3600.0
"""Longest duration a node may have: an hour for one kernel of one step is not a measurement (a unit mix-up, a
corrupted file), and it would price the whole step at hours."""
MAX_CLOCK_SCALE = 1000.0
"""Largest ``clock_scale`` a file may carry: the timed steps and the node-timed ones ran on one machine minutes
apart; a thousandfold difference is a corrupted file, not load."""
HEADER = "invalid node costs"


@dataclass(frozen=True, slots=True)
class NodeCostsData:
    """A checked ``node_costs.json``: ``graphs[graph][node name] = (signature, seconds)``."""

    source: str
    graphs: dict[str, dict[str, tuple[str, float]]]
    clock_scale: float


def read_node_costs(path: str | Path, *, root: str = "node_costs") -> NodeCostsData:
    """``node_costs_data`` of a file: a file that cannot be read is a fault at ``root`` (where its path was given,
    ``tune.node_costs``); what it holds, faults under a header naming the file."""
    path = Path(path).expanduser()
    return node_costs_data(read_text(path, root, what="node costs file"), where=str(path))


def node_costs_data(text: str | Mapping[str, Any], *, where: str | None = None) -> NodeCostsData:
    """What ``NodeCosts.to_json`` wrote, checked: anything else, or a duration that is not a finite number of
    seconds from 0 to ``MAX_NODE_SECONDS`` included, is an ``OverlapConfigError`` listing every bad entry
    (``graphs.forward.mm_3.seconds: ...``); ``where`` names the file in its header."""
    header = f"{HEADER} in {where!r}" if where else HEADER
    try:
        data = parse_json(text, "", source=where) if isinstance(text, str) else dict(text)
    except OverlapConfigError as err:
        raise OverlapConfigError(err.faults, header=header) from None
    if not isinstance(data, Mapping) or data.get("schema") != NODE_COSTS_SCHEMA:
        got = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
        raise OverlapConfigError([Fault("schema", f"not overlapcfg node costs of schema {NODE_COSTS_SCHEMA!r} "
                                                  f"(got {show_value(got)})")], header=header)
    graphs, faults = _entries(data.get("graphs"))
    faults += duration_faults(graphs)
    if faults:
        raise OverlapConfigError(faults, header=header)
    scale = _number(data.get("clock_scale", 1.0))
    if not (isinstance(scale, float) and math.isfinite(scale) and 0 < scale <= MAX_CLOCK_SCALE):
        raise OverlapConfigError([Fault("clock_scale", f"expected a positive finite factor up to "
                                                       f"{MAX_CLOCK_SCALE:g}, got {show_value(scale)}")],
                                 header=header)
    return NodeCostsData(source=str(data.get("source", "")), graphs=graphs, clock_scale=scale)


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


def duration_faults(graphs: Mapping[str, Mapping[str, tuple[str, float]]]) -> list[Fault]:
    """A fault per duration that is not a finite number of seconds from 0 to ``MAX_NODE_SECONDS``."""
    return list(_bad_durations(graphs))


def _bad_durations(graphs: Mapping[str, Mapping[str, tuple[str, float]]]) -> Iterator[Fault]:
    for g, nodes in graphs.items():
        for n, (_, seconds) in nodes.items():
            number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            ok = number and (isinstance(seconds, int) or math.isfinite(seconds)) and 0 <= seconds <= MAX_NODE_SECONDS
            if not ok:
                yield Fault(f"graphs.{g}.{n}.seconds", f"expected a duration in seconds, a finite number from 0 to "
                                                       f"{MAX_NODE_SECONDS:g}, got {show_value(seconds)}")

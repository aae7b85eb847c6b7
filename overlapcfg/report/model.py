"""The report's data: what the pass did per bucket and per graph, what the plan is predicted to cost, and several
configs compared on one trace. Data only: nothing here draws.

Plain frozen pydantic models so the JSON form is the schema (``Report.to_json()`` / ``Report.from_json()``,
versioned by ``SCHEMA``). Building a report lives in ``explain.py``, comparing in ``compare.py``, drawing in
``render.py``, the prediction in ``overlapcfg.cost``. The transformed graph modules ride along on the ``Report``
object but never into JSON. Both are ``overlapcfg.results.Result``s: ``print(report)`` and ``rich.print(report)``
show what ``render.py`` draws (it registers the drawing: the data knows that it can be drawn, not how),
``repr(report)`` is one line, and ``report.timeline(path)`` / ``comparison.timeline(path)`` write the predicted
step's timeline (``timeline.py``, registered by ``render.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import PrivateAttr
from torch import fx

from overlapcfg.cost.prediction import Simulation
from overlapcfg.errors import OverlapConfigError, OverlapLookupError
from overlapcfg.graph.record import BucketRecord, GroupTraffic, Uncovered
from overlapcfg.report.labels import fmt_seconds
from overlapcfg.resolve.resolved import RecordModel
from overlapcfg.results import Result, counted

__all__ = ["COMPARE_SCHEMA", "SCHEMA", "Comparison", "ComparisonRow", "GraphReport", "Report"]

TIMELINE_SUFFIXES = (".png", ".json")
"""``timeline(path)`` writes a Gantt chart (``.png``) or a Chrome trace (``.json``), as the command writes both."""


SCHEMA = "overlapcfg.report/5"
"""Bumped on any change to the fields (added, renamed, removed, or changed in meaning): reports are validated
strictly (``extra="forbid"``), so a reader accepts exactly the version it was written for."""


class GraphReport(RecordModel):
    """One graph (forward or backward) after the pass."""

    name: str
    strategy: str
    nodes: int
    collectives_before: int
    """FSDP collectives before merging."""
    collectives_after: int
    non_fsdp: tuple[str, ...]
    """Collectives that are not FSDP's, left alone (node names)."""
    roles: tuple[tuple[str, int], ...] = ()
    """Collectives before the pass per role (``fsdp_all_gather``, ``fsdp_reduce_scatter``, ``hsdp_all_reduce``,
    ``other``)."""
    groups: tuple[GroupTraffic, ...] = ()
    """Per process group and role: collectives before and after, bytes moved."""
    uncovered: tuple[Uncovered, ...]
    order: str
    """Collective/compute order, compact: ``AG[layers.0] W[tok_embeddings] C×12 ...``."""
    pass_seconds: float
    notes: tuple[str, ...] = ()


class Report(Result, RecordModel):
    """What ``explain`` found. ``forward`` / ``backward``: the transformed graph modules (not serialized).

    ``print(report)``: the command's tables; ``report.timeline("timeline.png")`` (or ``.json``): the predicted step
    (``explain(..., hardware=...)``) as the command's timeline picture or Chrome trace."""

    presented_by: ClassVar[str] = "overlapcfg.report.render"

    schema_: str = SCHEMA
    strategy: str
    plan_name: str | None
    config: dict[str, Any]
    """The validated ``OverlapConfig``, JSON form."""
    world_size: int
    """World size of the trace (bucket byte counts use it for ``sharded_bytes``)."""
    buckets: tuple[BucketRecord, ...]
    """One record per bucket, forward and backward combined (``overlapcfg.graph.record``)."""
    graphs: tuple[GraphReport, ...]
    warnings: tuple[str, ...] = ()
    simulation: Simulation | None = None
    baseline: Simulation | None = None
    """The untransformed step predicted on the same hardware (what the table's "before" column shows), so the
    JSON says what the pass bought too. None without hardware, or for a graph that arrived already transformed."""
    mesh: tuple[tuple[str, str], ...] = ()
    """``(mesh dimension, process-group name)`` where the trace knows its device mesh (``dp_shard``, ``dp_replicate``,
    ``tp``): reports name groups by dimension, ``dp_shard (group 3)``. Empty: groups by their names alone."""

    _forward: fx.GraphModule | None = PrivateAttr(None)
    _backward: fx.GraphModule | None = PrivateAttr(None)

    @property
    def forward(self) -> fx.GraphModule | None:
        return self._forward

    @property
    def backward(self) -> fx.GraphModule | None:
        return self._backward

    def graph(self, name: str) -> GraphReport:
        for g in self.graphs:
            if g.name == name:
                return g
        raise OverlapLookupError(f"no graph {name!r} in this report; have {[g.name for g in self.graphs]}")

    def group_label(self, group: str) -> str:
        """``dp_shard (group 3)`` where the mesh names ``group``, else ``group 3``."""
        dims = {g: dim for dim, g in self.mesh}
        return f"{dims[group]} (group {group})" if group in dims else f"group {group}"

    def bucket(self, name: str) -> BucketRecord:
        for b in self.buckets:
            if b.name == name:
                return b
        raise OverlapLookupError(f"no bucket {name!r}; have {[b.name for b in self.buckets]}")

    def __eq__(self, other: object) -> bool:  # the graph modules are attachments, not data
        return isinstance(other, Report) and self.model_dump() == other.model_dump()

    # reports are compared by value and are not hashable (the attached graphs are not data)
    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        return {"schema": data.pop("schema_"), **data}

    def to_json(self, indent: int | None = 2) -> str:
        """``{"schema": "overlapcfg.report/1", ...}``; ``Report.from_json`` reads it back to an equal report."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> Report:
        data = json.loads(text) if isinstance(text, str) else dict(text)
        schema = data.pop("schema", None)
        if schema != SCHEMA:
            raise OverlapConfigError(f"not an overlapcfg report of schema {SCHEMA!r} (got schema {schema!r})")
        return cls.model_validate({"schema_": schema, **data})

    def attach(self, forward: fx.GraphModule | None, backward: fx.GraphModule | None) -> Report:
        self._forward, self._backward = forward, backward
        return self

    def timeline(self, path: str | Path) -> Path:
        """Write the predicted step's timeline to ``path``: a Gantt chart (``.png``) or a Chrome trace (``.json``,
        open it in https://ui.perfetto.dev), as ``overlapcfg mode=compare`` writes them. Needs a prediction
        (``explain(..., hardware=...)``)."""
        return self._write("timeline", path, TIMELINE_SUFFIXES)

    def summary(self) -> str:
        graphs = ", ".join(f"{g.name} {g.collectives_before}→{g.collectives_after}" for g in self.graphs)
        plan = f", plan={self.plan_name!r}" if self.plan_name else ""
        sim = f", predicted step {fmt_seconds(self.simulation.step_seconds)} on {self.simulation.hardware}" \
            if self.simulation is not None else ""
        return f"strategy={self.strategy!r}{plan}, {counted(len(self.buckets), 'bucket')}, {graphs}{sim}"


COMPARE_SCHEMA = "overlapcfg.compare/1"


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One config of a comparison: its report (with the prediction) and the prediction itself."""

    name: str
    strategy: str
    report: Report
    simulation: Simulation

    @property
    def collectives(self) -> int:
        """FSDP collectives after the pass, both graphs."""
        return sum(g.collectives_after for g in self.report.graphs)

    @property
    def pass_seconds(self) -> float:
        return sum(g.pass_seconds for g in self.report.graphs)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "strategy": self.strategy, "config": self.report.config,
                "collectives": self.collectives, "pass_seconds": self.pass_seconds,
                "simulation": self.simulation.model_dump(mode="json")}


@dataclass(frozen=True, slots=True, repr=False)
class Comparison(Result):
    """Several configs on one trace, predicted on one hardware profile at one world size (``compare``).

    ``print(comparison)``: the command's table; ``comparison.timeline("timeline.png")`` (or ``.json``): every row's
    predicted step on one time axis, the command's timeline."""

    presented_by = "overlapcfg.report.render"  # not annotated: a ClassVar would be listed in __dataclass_fields__

    hardware: str
    world_size: int
    rows: tuple[ComparisonRow, ...]

    def row(self, name: str) -> ComparisonRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise OverlapLookupError(f"no row {name!r}; have {[r.name for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        return {"schema": COMPARE_SCHEMA, "hardware": self.hardware, "world_size": self.world_size,
                "rows": [r.to_dict() for r in self.rows]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def timeline(self, path: str | Path) -> Path:
        """Write every row's predicted step on one time axis to ``path``: a Gantt chart (``.png``) or a Chrome trace
        (``.json``, open it in https://ui.perfetto.dev), the files ``overlapcfg mode=compare`` writes."""
        return self._write("timeline", path, TIMELINE_SUFFIXES)

    def summary(self) -> str:
        best = min(self.rows, key=lambda r: r.simulation.step_seconds, default=None)
        fastest = f", fastest {best.name!r} {fmt_seconds(best.simulation.step_seconds)}" if best else ""
        return (f"{self.hardware}, world size {self.world_size}, {counted(len(self.rows), 'row')} "
                f"{', '.join(repr(r.name) for r in self.rows)}{fastest}")

"""The report's data: what the pass did per bucket and per graph, and what the plan is predicted to cost.

Plain frozen pydantic models so the JSON form is the schema (``Report.to_json()`` / ``Report.from_json()``,
versioned by ``SCHEMA``). Building a report lives in ``explain.py``, drawing it in ``render.py``, the cost model in
``simulate.py``. The transformed graph modules ride along on the ``Report`` object but never into JSON.
``print(report)`` shows the rendered tables (``render.report_table``: the renderer stays a free function over the
data, which it imports only for type checking), ``repr(report)`` one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr
from rich.console import RenderableType
from torch import fx

from overlapcfg.graph.record import BucketRecord, GroupTraffic, Uncovered
from overlapcfg.report.labels import fmt_seconds
from overlapcfg.report.render import plain_text, report_table

__all__ = ["SCHEMA", "ComputePart", "ComputeShare", "CostSource", "Event", "GraphReport", "Report", "Simulation",
           "StreamTime"]

SCHEMA = "overlapcfg.report/5"
"""Bumped on any change to the fields (added, renamed, removed, or changed in meaning): reports are validated
strictly (``extra="forbid"``), so a reader accepts exactly the version it was written for."""


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class GraphReport(_Data):
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


class StreamTime(_Data):
    stream: str
    busy_seconds: float


@dataclass(frozen=True, slots=True)
class Event:
    """One interval on one stream, for timelines (never in JSON). ``kind``: compute, memory (bandwidth-bound
    kernel), all_gather, reduce_scatter, all_reduce, other, or wait (the compute stream stalled on ``node``, a
    collective of kind ``waits_on``)."""

    graph: str
    node: str
    stream: str
    kind: str
    start: float
    end: float
    label: str = ""
    nbytes: int = 0
    waits_on: str = ""
    """For a wait: the kind of the collective waited on (``all_gather``, ``reduce_scatter``, ...)."""


class CostSource(_Data):
    """Where part of a prediction's time came from: which nodes were priced how, and the seconds they add up to."""

    part: Literal["compute", "issue", "collectives", "contention"]
    """``compute``: kernels and views on the compute stream; ``issue``: the compute stream issuing collectives;
    ``collectives``: collectives on their own streams; ``contention``: compute time lost to collectives in flight
    (the profile's measured slowdowns; ``nodes`` counts one)."""
    source: Literal["measured", "roofline", "fitted", "datasheet"]
    """``measured``: per-node durations from a profile of the same graph (``NodeCosts``); ``roofline``: FLOPs and
    bytes over the profile's peaks; ``fitted``: the profile's calibrated collective fits; ``datasheet``: its ring
    model numbers."""
    nodes: int
    seconds: float


ComputePart = Literal["matmul", "attention", "memory", "other"]
"""What compute-stream time goes to: FLOP-counted kernels (matmuls, convolutions) outside attention; attention
(each SDPA call as the fused kernel trainers run, ``overlapcfg.report.attention``); memory-bound kernels
(elementwise, norms, the copies bucketing adds); other (issuing collectives, views a measurement timed)."""


class ComputeShare(_Data):
    """One part of the compute stream's work (contention not included)."""

    part: ComputePart
    nodes: int
    seconds: float


class Simulation(_Data):
    """The cost model's prediction for the whole step (forward then backward), see ``overlapcfg.report.simulate``.

    ``events`` (the replay's intervals, for timelines) ride along on the object but never into JSON.
    """

    hardware: str
    world_size: int
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    """Sum over every collective on every stream."""
    exposed_comm_seconds: float
    """Time the compute stream waits on collectives."""
    contention_seconds: float = 0.0
    """Compute time lost to contention: kernels running slower while collectives are in flight (the profile's
    measured slowdowns; 0 on datasheet profiles). ``step = compute + contention + exposed``."""
    overlap_ratio: float | None
    """Share of communication hidden behind compute; None without communication."""
    lower_bound_seconds: float
    """max(compute + collectives no schedule can hide (tensor-parallel activations), busiest comm stream): no
    bucketing or reordering of data-parallel collectives can beat it."""
    peak_inflight_bytes: int
    """Peak unsharded bytes of all-gathers issued but not yet waited."""
    peak_unsharded_param_bytes: int
    """Peak bytes of unsharded parameters alive (issued all-gathers until the gathered weights' last use)."""
    peak_activation_bytes: int | None
    """Peak bytes the graphs allocate besides unsharded parameters and their inputs, where derivable."""
    streams: tuple[StreamTime, ...] = ()
    cost_sources: tuple[CostSource, ...] = ()
    """How each part of the prediction was priced (measured, roofline, fitted, datasheet), nodes and seconds."""
    node_costs: str | None = None
    """What the measured node durations were, when given (``NodeCosts.source``)."""
    compute_parts: tuple[ComputeShare, ...] = ()
    """``compute_seconds`` broken into matmul, attention, memory-bound and other (``ComputePart``)."""
    attention_calls: int = 0
    """Attention calls costed as fused kernels (forward; their backward too)."""

    _events: tuple[Event, ...] = PrivateAttr(())

    @property
    def events(self) -> tuple[Event, ...]:
        return self._events

    def with_events(self, events: tuple[Event, ...]) -> Simulation:
        self._events = events
        return self


class Report(_Data):
    """What ``explain`` found. ``forward`` / ``backward``: the transformed graph modules (not serialized)."""

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
        raise KeyError(f"no graph {name!r} in this report; have {[g.name for g in self.graphs]}")

    def group_label(self, group: str) -> str:
        """``dp_shard (group 3)`` where the mesh names ``group``, else ``group 3``."""
        dims = {g: dim for dim, g in self.mesh}
        return f"{dims[group]} (group {group})" if group in dims else f"group {group}"

    def bucket(self, name: str) -> BucketRecord:
        for b in self.buckets:
            if b.name == name:
                return b
        raise KeyError(f"no bucket {name!r}; have {[b.name for b in self.buckets]}")

    def __eq__(self, other: object) -> bool:  # the graph modules are attachments, not data
        return isinstance(other, Report) and self.model_dump() == other.model_dump()

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
            raise ValueError(f"not an overlapcfg report of schema {SCHEMA!r} (got schema {schema!r})")
        return cls.model_validate({"schema_": schema, **data})

    def attach(self, forward: fx.GraphModule | None, backward: fx.GraphModule | None) -> Report:
        self._forward, self._backward = forward, backward
        return self

    def __rich__(self) -> RenderableType:
        """``rich.print(report)``: the tables, in colour."""
        return report_table(self)

    def __str__(self) -> str:
        """``print(report)``: the tables as plain text (``render.report_table``)."""
        return plain_text(report_table(self))

    def __repr__(self) -> str:
        graphs = ", ".join(f"{g.name} {g.collectives_before}→{g.collectives_after}" for g in self.graphs)
        plan = f", plan={self.plan_name!r}" if self.plan_name else ""
        sim = f", predicted step {fmt_seconds(self.simulation.step_seconds)} on {self.simulation.hardware}" \
            if self.simulation is not None else ""
        return f"Report(strategy={self.strategy!r}{plan}, {len(self.buckets)} buckets, {graphs}{sim})"

"""What the cost model predicts: ``Simulation`` (the step's times, peaks, how each part was priced and what compute
went to; the JSON a report, a comparison and a measurement hold) and ``Event`` (one interval on one stream, for
timelines, never in JSON). Made by ``overlapcfg.cost.simulator``; drawn by ``overlapcfg.report``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, PrivateAttr

from overlapcfg.resolve.resolved import RecordModel

__all__ = ["ComputePart", "ComputeShare", "CostSource", "Event", "Simulation", "StreamTime"]


class StreamTime(RecordModel):
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


class CostSource(RecordModel):
    """Where part of a prediction's time came from: which nodes were priced how, and the seconds they add up to."""

    part: Literal["compute", "issue", "collectives", "contention"]
    """``compute``: kernels and views on the compute stream; ``issue``: the compute stream issuing collectives;
    ``collectives``: collectives on their own streams; ``contention``: compute time lost to collectives in flight
    (the profile's measured slowdowns; ``nodes`` counts one)."""
    source: Literal["measured", "roofline", "achievable", "fitted", "datasheet"]
    """``measured``: per-node durations from a profile of the same graph (``NodeCosts``); ``achievable``: FLOPs and
    bytes at the profile's achievable rates (``HardwareProfile.achievable``); ``roofline``: over its bare peaks
    (a profile without achievable rates); ``fitted``: the profile's collective rates (calibrated, or the published
    achievable ones it ships); ``datasheet``: its ring model on the nominal links."""
    nodes: int
    seconds: float


ComputePart = Literal["matmul", "attention", "memory", "optimizer", "other"]
"""What compute-stream time goes to: FLOP-counted kernels (matmuls, convolutions) outside attention; attention
(each SDPA call as the fused kernel trainers run, ``overlapcfg.cost.attention``); memory-bound kernels
(elementwise, norms, the copies bucketing adds); the optimizer step and gradient clipping priced after the
backward (``Pricing.optimizer``); other (issuing collectives, views a measurement timed)."""


class ComputeShare(RecordModel):
    """One part of the compute stream's work (contention not included)."""

    part: ComputePart
    nodes: int
    seconds: float


class Simulation(RecordModel):
    """The cost model's prediction for the whole step (forward then backward), see ``overlapcfg.cost.simulator``.

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
    skew_seconds: float = 0.0
    """Seconds collectives waited for their last rank (the profile's ``skew``), summed over collectives; what of it
    the compute stream waited is in ``exposed_comm_seconds``."""
    wake_seconds: float = 0.0
    """Seconds collectives took beyond their fits to wake a link idle since its last collective (the profile's
    ``skew.wake``), summed; part of ``comm_seconds``."""
    start_delay_seconds: float = 0.0
    """Seconds collectives that started on an idle link under compute sat before they moved
    (``Contention.start_delay``), summed; 0 where the profile has no start delay."""
    tokens_per_step: int | None = None
    """Tokens one rank processes per step (``overlapcfg.cost.throughput``); None: unknown (``throughput_note``)."""
    model_params: int | None = None
    """The model's parameters as this rank computes with them (MFU's ``N``)."""
    graph_flops: float = 0.0
    """FLOPs of the step's kernels by torch's counter (fused attention, recompute included)."""
    peak_flops: float = 0.0
    """The device's dense datasheet peak for the costed dtype: MFU's denominator."""
    tokens_per_second: float | None = None
    """Tokens per second per GPU."""
    mfu: float | None = None
    """``6 x model_params x tokens_per_step / (step_seconds x peak_flops)``."""
    graph_mfu: float | None = None
    """``graph_flops / (step_seconds x peak_flops)``: the hardware's utilization by the graph's own count."""
    pricing: dict[str, Any] = Field(default_factory=dict)
    """The ``overlapcfg.cost.pricing.Pricing`` the prediction assumed (``fusion`` resolved)."""
    recompute: str = ""
    """Which activation checkpointing it priced, and what it recomputes."""
    optimizer: str = "none"
    """The optimizer step and clipping it priced after the backward."""
    throughput_note: str = ""
    """Why tokens or parameters are unknown, where they are."""

    _events: tuple[Event, ...] = PrivateAttr(())

    @property
    def events(self) -> tuple[Event, ...]:
        return self._events

    def with_events(self, events: tuple[Event, ...]) -> Simulation:
        self._events = events
        return self

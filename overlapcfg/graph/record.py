"""The record vocabulary, from the pass to the report: one type per concept, written once, read everywhere.

- ``DepthDecision``: what the scheduler decided for one bucket, direction and kind (requested vs effective, why);
- ``CollectiveChange``: one bucket's collectives of one direction and kind, before and after merging, and bytes;
- ``BucketRecord``: one bucket as the pass saw it (its resolved modules and depths, its parameters and sizes,
  its collective changes and decisions). The report's buckets are the same type, forward and backward combined;
- ``PassRecord``: one graph's pass (``gm.meta["overlapcfg"]``: ``overlapcfg.graph.meta.pass_record``);

Frozen pydantic models: the JSON form of a report is made of these, and ``Report.from_json`` reads them back.
"""

from __future__ import annotations

from overlapcfg.kinds import Direction
from overlapcfg.resolve.resolved import RecordModel, ResolvedBucket

__all__ = ["BucketRecord", "CollectiveChange", "CollectiveCounts", "DepthDecision", "GroupTraffic",
           "PassRecord", "RecordModel", "Uncovered"]


class DepthDecision(RecordModel):
    """What the scheduler decided for one bucket in one direction and kind (``manual`` only)."""

    bucket: str
    direction: Direction
    kind: str
    position: int
    """Order of this bucket among its direction's buckets (0 = first to compute)."""
    requested: int
    """From the policy, the plan entry or an override."""
    effective: int
    """As placed; lower than requested where the byte cap, the end of the graph or a consumer bound."""
    inflight_bytes: int
    """All-gathers: unsharded bytes issued but not yet waited when this bucket's wait runs (itself included)."""
    reason: str | None = None
    """Why ``effective`` differs from ``requested``, if it does."""


class CollectiveChange(RecordModel):
    """FSDP collectives of one bucket in one direction and kind, before and after merging."""

    direction: Direction
    kind: str
    before: int
    after: int
    unsharded_bytes: int
    """Full-size bytes these collectives move (all-gather output / reduce-scatter input)."""


class BucketRecord(ResolvedBucket):
    """A resolved bucket (``overlapcfg.resolve.ResolvedBucket``) with what the pass found and did: its parameters and
    sizes, its collectives before and after, the scheduler's decisions."""

    params: tuple[str, ...] = ()
    """Parameter FQNs (``layers.0.attention.wq.weight``) where attribution knows them, else placeholder names."""
    param_count: int = 0
    """Number of parameters (tensors)."""
    numel: int = 0
    """Number of parameter elements, unsharded."""
    unsharded_bytes: int = 0
    """Bytes of the bucket's parameters, unsharded: what one forward all-gather brings in."""
    sharded_bytes: int = 0
    """Bytes each rank holds: ``unsharded_bytes / world_size``."""
    collectives: tuple[CollectiveChange, ...] = ()
    decisions: tuple[DepthDecision, ...] = ()
    reshard_after_forward: bool | int | None = None
    """The plan entry's ``reshard_after_forward`` (None: not set). On a whole-step graph ``false`` makes the backward
    read the forward's gathered parameters instead of re-gathering them (``overlapcfg.passes.keep_unsharded``)."""
    held_bytes: int = 0
    """Unsharded bytes the pass keeps alive from their forward gather to their last backward use instead of
    re-gathering them (``reshard_after_forward: false``): memory held for the backward half of the step."""

    def changes(self, direction: str, kind: str) -> CollectiveChange | None:
        return next((c for c in self.collectives if (c.direction, c.kind) == (direction, kind)), None)


class CollectiveCounts(RecordModel):
    """FSDP collectives per (direction, kind), e.g. ``(("forward", "all_gather", 9),)``, plus the others."""

    fsdp: tuple[tuple[str, str, int], ...]
    other: int

    def get(self, direction: str, kind: str) -> int:
        return next((n for d, k, n in self.fsdp if (d, k) == (direction, kind)), 0)

    @property
    def total_fsdp(self) -> int:
        return sum(n for _, _, n in self.fsdp)


class GroupTraffic(RecordModel):
    """What one process group carries for one role: how many collectives before and after the pass, and the bytes
    they move (full-size side: all-gather outputs, reduce-scatter and all-reduce inputs). HSDP users read the
    replicate group's row to see what the slow links carry."""

    group: str
    """The process-group name the graph states (``'1'``)."""
    size: int | None
    """Ranks in it, as the graph states them (None: an all-reduce whose group is not live in this process)."""
    role: str
    """``overlapcfg.graph.collectives.CollectiveRole``."""
    before: int
    after: int
    unsharded_bytes: int


class Uncovered(RecordModel):
    """An FSDP collective no bucket covers: left where the trace put it."""

    graph: str
    node: str
    owner: str | None


class PassRecord(RecordModel):
    """What one pass over one graph did."""

    strategy: str
    graph_kind: str
    buckets: tuple[BucketRecord, ...]
    decisions: tuple[DepthDecision, ...]
    """Scheduler decisions (``manual`` only): requested vs effective depth per bucket and direction."""
    before: CollectiveCounts
    after: CollectiveCounts
    uncovered: tuple[Uncovered, ...]
    """FSDP collectives in no bucket."""
    non_fsdp: tuple[str, ...]
    """Collectives that are not FSDP's, left where data dependencies put them (node names)."""
    groups: tuple[GroupTraffic, ...] = ()
    """Every collective by process group and role (``CollectiveRole``), before and after."""
    seconds: float
    notes: tuple[str, ...] = ()
    """Anything skipped or worth knowing, one line each."""

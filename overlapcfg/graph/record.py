"""The record vocabulary, from the pass to the report: one type per concept, written once, read everywhere.

- ``DepthDecision``: what the scheduler decided for one bucket, direction and kind (requested vs effective, why);
- ``CollectiveChange``: one bucket's collectives of one direction and kind, before and after merging, and bytes;
- ``BucketRecord``: one bucket as the pass saw it (its resolved modules and depths, its parameters and sizes,
  its collective changes and decisions). The report's buckets are the same type, forward and backward combined;
- ``ScheduledCollective`` / ``ScheduleFingerprint``: the collectives a rank will issue, in order, as the
  same-schedule check compares them across ranks (``overlapcfg.graph.fingerprint``, ``overlapcfg.graph.same_schedule``);
- ``PassRecord``: one graph's pass (``gm.meta["overlapcfg"]``: ``overlapcfg.graph.meta.pass_record``);

Frozen pydantic models: the JSON form of a report is made of these, and ``Report.from_json`` reads them back.
"""

from __future__ import annotations

import hashlib

from overlapcfg.kinds import Direction
from overlapcfg.resolve.resolved import RecordModel, ResolvedBucket

__all__ = ["BucketRecord", "CollectiveChange", "CollectiveCounts", "DepthDecision", "GroupTraffic",
           "PassRecord", "RecordModel", "ScheduleFingerprint", "ScheduledCollective", "Uncovered",
           "first_difference"]


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


class ScheduledCollective(RecordModel):
    """One collective a rank will issue, as the same-schedule check compares it: everything that must be equal on
    every rank of its group for the collective to complete with the right data, and nothing that may differ (node
    names, which the messages show, and the group's name where the group is another rank's instance of the same
    role: ``ScheduleFingerprint.lines`` numbers groups by first appearance)."""

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``other``; ``fsdp2_group`` for one
    ``fully_shard`` group of the eager FSDP2 driver."""
    op: str
    """The op issued (``_c10d_functional.all_gather_into_tensor``; ``fully_shard`` for an FSDP2 group)."""
    group: str
    """The process group's name as this rank states it."""
    group_size: int | None
    tensors: str
    """Dtypes and shapes it reads and writes: ``float32[4096] -> float32[8192]``."""
    reduce_op: str | None = None
    bucket: str | None = None
    """The bucket it serves (a merged collective, or an FSDP2 group), None for one the pass left alone."""
    payload: tuple[str, ...] = ()
    """What it carries, in the order its buffer packs them: parameter (or source node) and bytes per part."""
    detail: str = ""
    """Anything else every rank must agree on (FSDP2: ``reshard_after_forward`` and the prefetch lists)."""
    node: str = ""
    """The start node's name (FSDP2: the group's first module): shown in messages, never compared."""

    def line(self, group_label: str) -> str:
        """The canonical form two ranks compare, with the group given as ``group_label``."""
        parts = [self.kind, self.op, f"group {group_label} of {self.group_size}", self.tensors]
        if self.reduce_op is not None:
            parts.append(self.reduce_op)
        if self.bucket is not None:
            parts.append(f"bucket {self.bucket} [{', '.join(self.payload)}]")
        elif self.payload:
            parts.append(f"[{', '.join(self.payload)}]")
        if self.detail:
            parts.append(self.detail)
        return " | ".join(parts)

    def describe(self, shown_parts: int = 4) -> str:
        """One line for people: the canonical line with this rank's group name and node, the payload shortened."""
        payload = ", ".join(self.payload[:shown_parts]) + (f", ... ({len(self.payload)} parts)"
                                                           if len(self.payload) > shown_parts else "")
        where = f"bucket {self.bucket} [{payload}]" if self.bucket is not None else f"[{payload}]" if payload else ""
        parts = [f"{self.kind} ({self.op}) on group {self.group!r} of {self.group_size}", self.tensors,
                 *((self.reduce_op,) if self.reduce_op is not None else ()), *((where,) if where else ()),
                 *((self.detail,) if self.detail else ())]
        return " ".join(parts) + (f"  [{self.node}]" if self.node else "")


class ScheduleFingerprint(RecordModel):
    """The collectives one rank will issue for one graph (or one ``fully_shard`` call), in issue order: what the
    same-schedule check compares across the ranks of each process group (by ``digest`` first, line by line only
    where digests differ). Deterministic: built from graph order and names only (no ids, no hash of a set)."""

    graph: str
    """Which graph: ``forward``, ``backward``, ``joint``, ``graph`` (inductor's), ``fsdp2``."""
    collectives: tuple[ScheduledCollective, ...] = ()

    def groups(self) -> tuple[str, ...]:
        """The process-group names the collectives use, in order of first appearance."""
        return tuple(dict.fromkeys(c.group for c in self.collectives))

    def lines(self) -> tuple[str, ...]:
        """The canonical lines: the graph, then one per collective, each group numbered by first appearance
        (``g0``, ``g1``): two ranks of one data-parallel group whose tensor-parallel groups are different groups
        of the same role write the same lines."""
        labels = {name: f"g{i}" for i, name in enumerate(self.groups())}
        return (f"graph {self.graph}", *(c.line(labels[c.group]) for c in self.collectives))

    def digest(self) -> str:
        """SHA-256 of ``lines`` (hex): equal on two ranks exactly when they would issue the same collectives."""
        return hashlib.sha256("\n".join(self.lines()).encode()).hexdigest()

    def render(self) -> str:
        """The fingerprint for people: a header, then one numbered line per collective."""
        head = f"schedule of the {self.graph} graph: {len(self.collectives)} collectives, digest {self.digest()[:16]}"
        return "\n".join([head, *(f"  {i:>4}  {c.describe()}" for i, c in enumerate(self.collectives))])


def first_difference(mine: ScheduleFingerprint, theirs: ScheduleFingerprint) -> int | None:
    """Position of the first collective at which two fingerprints differ (the shorter one's length where one is a
    prefix of the other); -1 where they are fingerprints of different graphs; None where they are the same."""
    if mine.graph != theirs.graph:
        return -1
    a, b = mine.lines()[1:], theirs.lines()[1:]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


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
    schedule: ScheduleFingerprint | None = None
    """The collectives this rank will issue for this graph, in order (``ScheduleFingerprint.render`` prints it)."""
    same_schedule: str = ""
    """What the same-schedule check found: ``checked: ...``, ``not checked: <why>``, ``off: ...``; empty where no
    route checked this graph (``apply`` called directly)."""

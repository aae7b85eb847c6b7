"""What ``overlapcfg.fully_shard`` did, in the compiled path's record vocabulary, and how to read it back.

The record is a ``PassRecord`` (``graph_kind="fsdp2"``: ``BucketRecord`` per bucket, ``DepthDecision`` per bucket
and direction, notes) so whatever reads the compiled path's records reads this one, plus the FSDP2 facts that have
no compiled counterpart: the forward order used, each group's ``reshard_after_forward`` and the prefetch lists
handed to FSDP2. It is written once, at sharding, on the model under ``RECORD_ATTR``.

Collective counts mean what they mean in the compiled record: ``before`` is one collective per parameter (what
sharding each parameter on its own would issue), ``after`` one per ``fully_shard`` group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from overlapcfg import compat
from overlapcfg.config import OverlapConfig
from overlapcfg.config.depths import DEPTH_FIELDS
from overlapcfg.errors import OverlapLookupError, OverlapUsageError
from overlapcfg.fsdp2.checks import NATIVE_REDUCE_SCATTER_DELAY
from overlapcfg.fsdp2.layout import LayoutBucket, ShardLayout, reshards
from overlapcfg.fsdp2.tree import ParamInfo
from overlapcfg.graph.record import (
    BucketRecord,
    CollectiveChange,
    CollectiveCounts,
    DepthDecision,
    PassRecord,
    RecordModel,
    ScheduledCollective,
    ScheduleFingerprint,
    Uncovered,
)

__all__ = ["RECORD_ATTR", "ROOT", "Fsdp2Record", "build_record", "layout_schedule", "read_record"]

RECORD_ATTR = "_overlapcfg_record"
"""``getattr(model, RECORD_ATTR)``: the ``Fsdp2Record`` of the ``overlapcfg.fully_shard`` call that sharded it."""

ROOT = "<root>"
"""The root's group in prefetch lists and notes."""


class Fsdp2Record(RecordModel):
    """One ``overlapcfg.fully_shard`` call."""

    record: PassRecord
    """Buckets (forward order), decisions and notes, as the compiled path records them."""
    world_size: int | None
    """Ranks each parameter is sharded over (None where it was not known at sharding)."""
    forward_order: tuple[str, ...]
    """Bucket names (those with parameters) in the order forward starts them, each at its first module: in
    registration order, or as measured on the first forward where that differed (a note says so)."""
    backward_order: tuple[str, ...] = ()
    """Bucket names in the order backward starts them (each where its last module's forward ended, latest first):
    the reverse of ``forward_order`` except for buckets whose modules run apart (a tied embedding and head is
    first in both). Buckets without parameters are left out (nothing to gather)."""
    reshard_after_forward: tuple[tuple[str, bool | int | None], ...]
    """``(bucket, value passed to fully_shard)``; None: not passed, FSDP2's default (true)."""
    forward_prefetch: tuple[tuple[str, tuple[str, ...]], ...]
    """``(group, buckets it prefetches in forward)``, the root's group as ``<root>``."""
    backward_prefetch: tuple[tuple[str, tuple[str, ...]], ...]
    """The same for backward. An empty list means none: FSDP2 is given the group itself (a no-op), because an
    empty list would switch FSDP2's implicit depth-1 backward prefetch back on."""
    root_params: tuple[str, ...]
    """Parameters in no bucket, sharded by the root's ``fully_shard``."""

    @property
    def buckets(self) -> tuple[BucketRecord, ...]:
        return self.record.buckets

    @property
    def decisions(self) -> tuple[DepthDecision, ...]:
        return self.record.decisions

    def bucket(self, name: str) -> BucketRecord:
        for b in self.record.buckets:
            if b.name == name:
                return b
        raise OverlapLookupError(f"no bucket {name!r}; have {[b.name for b in self.record.buckets]}")


def read_record(model: nn.Module) -> Fsdp2Record:
    """The record of the ``overlapcfg.fully_shard`` call that sharded ``model`` (or the module a
    ``torch.compile`` wrapper holds). ``TypeError`` if it was not sharded that way."""
    for candidate in (model, compat.compiled_inner_module(model)):
        record = vars(candidate).get(RECORD_ATTR) if candidate is not None else None
        if isinstance(record, Fsdp2Record):
            return record
    raise OverlapUsageError(f"{type(model).__name__} was not sharded by overlapcfg.fully_shard: it carries no record")


def build_record(layout: ShardLayout, cfg: OverlapConfig, *, seconds: float, notes: tuple[str, ...],
                 schedule: ScheduleFingerprint | None = None, same_schedule: str = "") -> Fsdp2Record:
    """The record of sharding by ``layout`` (after it was applied); ``notes``: ``layout.notes`` as the user reads
    them (``overlapcfg.config.boundary.Mount.notes``), before the notes on the bucket order; ``schedule`` /
    ``same_schedule``: its fingerprint (``layout_schedule``) and what the same-schedule check found."""
    names = [b.name for b in layout.buckets]
    # A bucket's reduce-scatter is issued when its backward is complete: where its *first* module's backward ends,
    # so in reverse forward order (a tied embedding + head, first to start backward, is the last to reduce).
    issued = [layout.buckets[i] for i in reversed(layout.chain)]
    decisions = (*layout.forward.decisions, *layout.backward.decisions,
                 *(_reduce_scatter_decision(b, p) for p, b in enumerate(issued)))
    changes = [_changes(b.params, reshards(b.reshard_after_forward)) for b in layout.buckets]
    root_changes = _changes(layout.root_params, backward_gather=False)
    record = PassRecord(
        strategy=cfg.strategy,
        graph_kind="fsdp2",
        buckets=tuple(_bucket_record(b, c, decisions) for b, c in zip(layout.buckets, changes, strict=True)),
        decisions=tuple(decisions),
        before=_counts([*changes, root_changes], "before"),
        after=_counts([*changes, root_changes], "after"),
        uncovered=tuple(Uncovered(graph="fsdp2", node=ROOT, owner=o) for o in layout.uncovered),
        non_fsdp=(),
        seconds=seconds,
        notes=(*notes, *layout.order_notes),
        schedule=schedule,
        same_schedule=same_schedule,
    )

    def lists(per_bucket: tuple[tuple[int, ...], ...], root: tuple[int, ...]) -> tuple[tuple[str, tuple[str, ...]],
                                                                                          ...]:
        return ((ROOT, tuple(names[j] for j in root)),
                *((names[i], tuple(names[j] for j in targets)) for i, targets in enumerate(per_bucket)))

    return Fsdp2Record(
        record=record,
        world_size=layout.shard_size,
        forward_order=tuple(names[i] for i in layout.chain),
        backward_order=tuple(names[i] for i in layout.backward_chain),
        reshard_after_forward=tuple((b.name, b.reshard_after_forward) for b in layout.buckets),
        forward_prefetch=lists(layout.forward_lists, layout.root_forward),
        backward_prefetch=lists(layout.backward_lists, layout.root_backward),
        root_params=tuple(p.fqn for p in layout.root_params),
    )


def layout_schedule(layout: ShardLayout, groups: Sequence[tuple[str, int]]) -> ScheduleFingerprint:
    """The fingerprint of sharding by ``layout`` over the process groups ``groups`` (``(name, size)``: the mesh's,
    one per dimension): per group, one entry per ``fully_shard`` group in forward order, then the root's, each with
    its parameters (packing order, sizes), ``reshard_after_forward`` and prefetch lists. What every rank of the
    mesh must agree on for FSDP2's all-gathers and reduce-scatters to pair up."""
    names = [b.name for b in layout.buckets]

    def entry(group: str, size: int, bucket: str, params: tuple[ParamInfo, ...], detail: str, node: str) -> \
            ScheduledCollective:
        payload = tuple(f"{p.fqn} {p.numel} {p.unsharded_bytes}B{'' if p.requires_grad else ' frozen'}"
                        for p in params)
        return ScheduledCollective(
            kind="fsdp2_group", op="fully_shard", group=group, group_size=size,
            tensors=f"{len(params)} parameter{'' if len(params) == 1 else 's'}, "
                    f"{sum(p.unsharded_bytes for p in params)}B unsharded",
            bucket=bucket, payload=payload, detail=detail, node=node)

    def targets(indices: tuple[int, ...]) -> str:
        return "[" + ", ".join(names[j] for j in indices) + "]"

    out = []
    for group, size in groups:
        for i in layout.chain:
            b = layout.buckets[i]
            out.append(entry(group, size, b.name, b.params,
                             f"reshard_after_forward={b.reshard_after_forward}; forward prefetch "
                             f"{targets(layout.forward_lists[i])}; backward prefetch "
                             f"{targets(layout.backward_lists[i])}", b.resolved.modules[0]))
        out.append(entry(group, size, ROOT, layout.root_params,
                         f"forward prefetch {targets(layout.root_forward)}; backward prefetch "
                         f"{targets(layout.root_backward)}", ROOT))
    return ScheduleFingerprint(graph="fsdp2", collectives=tuple(out))


def _reduce_scatter_decision(b: LayoutBucket, position: int) -> DepthDecision:
    return DepthDecision(bucket=b.name, direction="backward", kind="reduce_scatter", position=position,
                         requested=b.resolved.reduce_scatter_delay, effective=NATIVE_REDUCE_SCATTER_DELAY,
                         inflight_bytes=0)


def _changes(params: tuple[ParamInfo, ...], backward_gather: bool) -> tuple[CollectiveChange, ...]:
    if not params:
        return ()
    gathered = sum(p.unsharded_bytes for p in params)
    out = [CollectiveChange(direction="forward", kind="all_gather", before=len(params), after=1,
                            unsharded_bytes=gathered)]
    if backward_gather:
        out.append(CollectiveChange(direction="backward", kind="all_gather", before=len(params), after=1,
                                    unsharded_bytes=gathered))
    trainable = [p for p in params if p.requires_grad]
    if trainable:
        out.append(CollectiveChange(direction="backward", kind="reduce_scatter", before=len(trainable), after=1,
                                    unsharded_bytes=sum(p.unsharded_bytes for p in trainable)))
    return tuple(out)


def _counts(changes: list[tuple[CollectiveChange, ...]], which: str) -> CollectiveCounts:
    total: Counter[tuple[str, str]] = Counter()
    for group in changes:
        for c in group:
            total[(c.direction, c.kind)] += c.before if which == "before" else c.after
    return CollectiveCounts(fsdp=tuple((d, k, n) for (d, k), n in sorted(total.items())), other=0)


def _bucket_record(b: LayoutBucket, changes: tuple[CollectiveChange, ...],
                   decisions: tuple[DepthDecision, ...]) -> BucketRecord:
    r = b.resolved
    return BucketRecord(
        name=r.name, entry_index=r.entry_index, entry_text=r.entry_text, modules=r.modules,
        **r.model_dump(include=set(DEPTH_FIELDS)), overridden_by=r.overridden_by,
        params=tuple(p.fqn for p in b.params), param_count=len(b.params), numel=sum(p.numel for p in b.params),
        unsharded_bytes=b.unsharded_bytes, sharded_bytes=sum(p.sharded_bytes for p in b.params),
        collectives=changes, decisions=tuple(d for d in decisions if d.bucket == r.name),
    )

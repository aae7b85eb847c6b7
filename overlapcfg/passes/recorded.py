"""What a pass records: the ``PassRecord`` it leaves on its graph (``gm.meta["overlapcfg"]``), each bucket's facts
read once from the collectives it covered and the merges the strategy made, and the graph's collectives tallied
before and after (``count_collectives``, ``group_traffic``). ``overlapcfg.passes.pipeline`` calls it last;
``explain`` reports what it holds and re-derives none of it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence

from torch import fx

from overlapcfg.config import OverlapConfig
from overlapcfg.graph.collectives import Collective
from overlapcfg.graph.merge import MergedCollective, attribute
from overlapcfg.graph.meta import record_pass
from overlapcfg.graph.record import (
    BucketRecord,
    CollectiveChange,
    CollectiveCounts,
    DepthDecision,
    GroupTraffic,
    PassRecord,
    ScheduleFingerprint,
    Uncovered,
)
from overlapcfg.passes.keep_unsharded import KeepResult, reshard_setting
from overlapcfg.resolve import ResolvedPlan

__all__ = ["build_record", "count_collectives", "group_traffic"]


def _bucket_records(cfg: OverlapConfig, plan: ResolvedPlan, covered: Sequence[tuple[int, Collective]],
                    merged: Sequence[MergedCollective], after: Sequence[Collective],
                    decisions: Sequence[DepthDecision], kept: KeepResult) -> tuple[BucketRecord, ...]:
    """Each bucket's facts, read once from the collectives it covers: its parameters (those its all-gathers carry,
    in graph order) and their sizes (each parameter counted once, however often it is gathered: unsharded as the
    all-gather brings it in, sharded as each rank of its group holds it), collective counts before and after,
    the scheduler's decisions. ``explain`` reports these; it re-derives none of them."""
    before_counts: list[Counter[tuple[str, str]]] = [Counter() for _ in plan.buckets]
    nbytes: list[Counter[tuple[str, str]]] = [Counter() for _ in plan.buckets]
    # Per bucket: the parameters one all-gather carries (its start's name where none are known) -> numel,
    # unsharded bytes, sharded bytes. Keyed by parameters, so a parameter gathered again counts once.
    sizes: list[dict[tuple[str | None, ...], tuple[int, int, int]]] = [{} for _ in plan.buckets]
    for index, c in covered:
        before_counts[index][(c.direction, c.kind)] += 1
        nbytes[index][(c.direction, c.kind)] += c.unsharded_bytes
        if c.kind == "all_gather":
            sizes[index].setdefault(c.params or (None, c.start.name), (
                c.unsharded_bytes // c.dtype.itemsize, c.unsharded_bytes, c.unsharded_bytes // (c.group_size or 1)))
    after_counts: list[Counter[tuple[str, str]]] = [Counter() for _ in plan.buckets]
    if merged:
        for m in merged:
            after_counts[m.bucket][(m.direction, m.kind)] += 1
    else:  # upstream strategies: attribute the resulting collectives the same way as the originals
        for index, c in attribute(after, plan)[0]:
            after_counts[index][(c.direction, c.kind)] += 1

    def changes(i: int) -> tuple[CollectiveChange, ...]:
        keys = sorted(set(before_counts[i]) | set(after_counts[i]),
                      key=lambda dk: (dk[0] != "forward", dk[1] != "all_gather", dk[1]))
        return tuple(CollectiveChange(direction=d, kind=k, before=before_counts[i][(d, k)],
                                      after=after_counts[i][(d, k)], unsharded_bytes=nbytes[i][(d, k)])
                     for d, k in keys)

    records = []
    for i, b in enumerate(plan.buckets):
        names = tuple(dict.fromkeys(p for carried in sizes[i] if carried[0] is not None for p in carried))
        records.append(BucketRecord(
            **dict(b), params=names, param_count=len(names), numel=sum(n for n, _, _ in sizes[i].values()),
            unsharded_bytes=sum(u for _, u, _ in sizes[i].values()),
            sharded_bytes=sum(s for _, _, s in sizes[i].values()), collectives=changes(i),
            decisions=tuple(d for d in decisions if d.bucket == b.name),
            reshard_after_forward=reshard_setting(cfg, plan, i), held_bytes=kept.held_bytes(i)))
    return tuple(records)


def build_record(gm: fx.GraphModule, cfg: OverlapConfig, graph_kind: str, plan: ResolvedPlan,
                 before: Sequence[Collective], after: Sequence[Collective], covered: Sequence[tuple[int, Collective]],
                 merged: Sequence[MergedCollective], decisions: Sequence[DepthDecision], started: float,
                 notes: tuple[str, ...], *, strategy_uses_plan: bool = True,
                 kept: KeepResult | None = None, schedule: ScheduleFingerprint | None = None) -> PassRecord:
    """The ``PassRecord`` of one pass over ``gm`` (its buckets, decisions, collective counts, what stayed
    uncovered, ``notes``, the ``schedule`` fingerprint of the final graph), left on ``gm``
    (``overlapcfg.graph.meta.record_pass``) and returned."""
    if strategy_uses_plan:
        _, uncovered = attribute(before, plan) if plan.buckets else ((), [c for c in before if c.fsdp])
    else:  # the strategy buckets by its own rules (auto) or not at all (none): "uncovered" would mislead
        uncovered = []
    uncovered = [*uncovered, *(c for c in before if c.unattributed and strategy_uses_plan)]
    name = graph_kind if graph_kind in ("forward", "backward") else "graph"
    record = PassRecord(
        strategy=cfg.strategy,
        graph_kind=graph_kind,
        buckets=_bucket_records(cfg, plan, covered, merged, after, decisions, kept or KeepResult()),
        decisions=tuple(decisions),
        before=count_collectives(before),
        after=count_collectives(after),
        uncovered=tuple(Uncovered(graph=name, node=c.start.name, owner=c.module_fqn) for c in uncovered),
        non_fsdp=tuple(c.start.name for c in before if not c.fsdp),
        groups=group_traffic(before, after),
        seconds=time.perf_counter() - started,
        notes=notes,
        schedule=schedule,
    )
    record_pass(gm, record)
    return record


def count_collectives(collectives: Iterable[Collective]) -> CollectiveCounts:
    """FSDP collectives per (direction, kind), and how many others."""
    counts: Counter[tuple[str, str]] = Counter()
    other = 0
    for c in collectives:
        if c.fsdp:
            counts[(c.direction, c.kind)] += 1
        else:
            other += 1
    return CollectiveCounts(fsdp=tuple((d, k, n) for (d, k), n in sorted(counts.items())), other=other)


def group_traffic(before: Iterable[Collective], after: Iterable[Collective]) -> tuple[GroupTraffic, ...]:
    """Per (group, role), sorted by group then role: counts before and after, bytes (before; merging keeps them)."""
    rows: dict[tuple[str, str], list[int]] = {}
    sizes: dict[str, int | None] = {}
    for which, collectives in ((0, before), (1, after)):
        for c in collectives:
            slot = rows.setdefault((c.group, c.role), [0, 0, 0])
            slot[which] += 1
            if which == 0:
                slot[2] += c.unsharded_bytes
            sizes[c.group] = sizes.get(c.group) or c.group_size
    return tuple(GroupTraffic(group=g, size=sizes.get(g), role=r, before=v[0], after=v[1], unsharded_bytes=v[2])
                 for (g, r), v in sorted(rows.items()))

"""``apply(gm, cfg)``: the graph pass. find collectives → attribute to buckets → merge → reorder → verify → recompile.

Nothing is changed until the plan has resolved against the graph: an unmatched pattern or a bad config raises
``OverlapConfigError`` with the graph untouched. The pass records what it did on ``gm.meta["overlapcfg"]``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

from torch import fx

from overlapcfg.errors import natural_key
from overlapcfg.graph.collectives import Collective, Direction, ModuleFqnFn, find_collectives
from overlapcfg.graph.merge import MergedCollective, attribute
from overlapcfg.graph.record import RECORD_KEY, BucketRecord, PassRecord, count_collectives
from overlapcfg.strategies.registry import StrategySpec, get_strategy
from overlapcfg.resolve import DepthSource, ResolvedPlan, resolve_plan
from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.load import ConfigSource
from overlapcfg.strategies.base import PassContext
from overlapcfg.graph.verify import summarize, verify

__all__ = ["GraphKind", "apply"]

logger = logging.getLogger(__name__)

GraphKind: TypeAlias = Literal["forward", "backward", "joint", "auto"]


def _default_module_fqn_fn() -> ModuleFqnFn:
    from overlapcfg.demo.tracing import module_fqn

    return module_fqn


def _model_fqns(graph: fx.Graph, fn: ModuleFqnFn, owners: Sequence[str]) -> list[str]:
    """Module FQNs visible in the graph (and all their parents), natural order: what patterns match against."""
    seen: dict[str, None] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            fqn = fn(node)
            if fqn:
                seen.setdefault(fqn)
    for owner in owners:
        seen.setdefault(owner)
    closed: dict[str, None] = {}
    for fqn in seen:
        parts = fqn.split(".")
        for i in range(1, len(parts) + 1):
            closed.setdefault(".".join(parts[:i]))
    return sorted(closed, key=natural_key)


def _ignored_settings(cfg: OverlapConfig, spec: StrategySpec, root: str) -> tuple[str, ...]:
    """Settings the selected strategy does not read: never silently dropped, always said in the record."""
    notes = []
    if not spec.uses_plan and cfg.plan is not None and cfg.plan.buckets:
        notes.append(f"{root}.plan is ignored: strategy {cfg.strategy!r} does not bucket by plan")
    if not spec.uses_plan and cfg.overrides:
        notes.append(f"{root}.overrides are ignored: strategy {cfg.strategy!r} does not bucket by plan")
    if not spec.uses_policy and cfg.policy != type(cfg.policy)():
        notes.append(f"{root}.policy is ignored: strategy {cfg.strategy!r} reads no policy")
    return tuple(notes)


def _forced_direction(kind: GraphKind) -> Direction | None:
    return kind if kind in ("forward", "backward") else None  # type: ignore[return-value]


def apply(
    gm: fx.GraphModule,
    cfg: ConfigSource,
    *,
    module_fqn_fn: ModuleFqnFn | None = None,
    module_fqns: Sequence[str] | None = None,
    graph_kind: GraphKind = "auto",
    debug: bool = False,
    config_root: str = "overlap",
    for_compiler: bool = False,
) -> fx.GraphModule:
    """Bucket and schedule the FSDP collectives of ``gm`` as ``cfg`` says; returns ``gm`` (modified in place).

    ``module_fqn_fn(node)`` names the module a node belongs to (default: our tracing records, else the node's
    module stack). ``module_fqns``: the model's module FQNs for pattern matching (default: those seen in the
    graph). ``graph_kind``: ``forward``/``backward`` for aot_autograd's separate graphs; ``auto`` reads each
    node's metadata. ``debug=True`` verifies the result (``overlapcfg.graph.verify``). ``config_root``: where the config
    sits in the user's config tree, so plan faults read ``trainer.overlap.plan.buckets[1]: ...``.
    ``for_compiler=True``: the graph goes on to a compiler that reads fake-tensor metadata (inductor), so every
    new node gets its own ``meta["val"]`` (slower; see ``compat.cached_merge_traces``).
    """
    cfg = load_config(cfg, root=config_root)
    started = time.perf_counter()
    fn = module_fqn_fn or _default_module_fqn_fn()
    collectives = find_collectives(gm.graph, fn, direction=_forced_direction(graph_kind))
    fsdp = [c for c in collectives if c.fsdp]
    spec = get_strategy(cfg.strategy)
    notes = _ignored_settings(cfg, spec, config_root)
    if not fsdp:
        logger.info("overlapcfg: no FSDP collectives in this graph (%d nodes); returned unchanged",
                    len(gm.graph.nodes))
        _record(gm, cfg, graph_kind, ResolvedPlan(()), collectives, collectives, (), (), (), started,
                ("no FSDP collectives: nothing to do", *notes))
        return gm

    owners = list(dict.fromkeys(c.module_fqn for c in fsdp if c.module_fqn))
    plan = ResolvedPlan(())
    if spec.uses_plan and cfg.plan is not None:
        fqns = list(module_fqns) if module_fqns is not None else _model_fqns(gm.graph, fn, owners)
        # A third-party policy need not have depths; the buckets then carry the defaults (and plan values).
        depths = cfg.policy if isinstance(cfg.policy, DepthSource) else None
        plan = resolve_plan(cfg.plan, fqns, owners, overrides=cfg.overrides, policy=depths,
                            path=f"{config_root}.plan", overrides_path=f"{config_root}.overrides")
    covered, uncovered = attribute(collectives, plan)
    ctx = PassContext(plan, cfg.policy, tuple(collectives), tuple(covered), tuple(uncovered),
                      _forced_direction(graph_kind), fn, fresh_fake_values=for_compiler)
    strategy = spec.factory(plan, cfg.policy)
    forced = _forced_direction(graph_kind)
    summary = summarize(gm, direction=forced) if debug else None

    merged = strategy.bucketer(gm, ctx)
    schedule = strategy.scheduler(gm, ctx, merged)
    gm.graph.lint()
    gm.recompile()
    if summary is not None:
        verify(summary, gm, direction=forced, pass_name=f"overlapcfg[{cfg.strategy}]")

    after = find_collectives(gm.graph, fn, direction=_forced_direction(graph_kind))
    record = _record(gm, cfg, graph_kind, plan, collectives, after, covered, merged, schedule.steps, started, notes)
    logger.info("overlapcfg[%s]: %d -> %d FSDP collectives in %d buckets, %.3fs", cfg.strategy,
                record.before.total_fsdp, record.after.total_fsdp, len(plan.buckets), record.seconds)
    return gm


def _bucket_records(plan: ResolvedPlan, covered: Sequence[tuple[int, Collective]],
                    merged: Sequence[MergedCollective], after: Sequence[Collective]) -> tuple[BucketRecord, ...]:
    before_counts: list[Counter[tuple[str, str]]] = [Counter() for _ in plan.buckets]
    nbytes: list[Counter[tuple[str, str]]] = [Counter() for _ in plan.buckets]
    params: list[dict[str, None]] = [{} for _ in plan.buckets]
    for index, c in covered:
        before_counts[index][(c.direction, c.kind)] += 1
        nbytes[index][(c.direction, c.kind)] += c.unsharded_bytes
        if c.kind == "all_gather" and c.param is not None:
            params[index].setdefault(c.param)
    after_counts: list[Counter[tuple[str, str]]] = [Counter() for _ in plan.buckets]
    if merged:
        for m in merged:
            after_counts[m.bucket][(m.direction, m.kind)] += 1
    else:  # upstream strategies: attribute the resulting collectives the same way as the originals
        for index, c in attribute(after, plan)[0]:
            after_counts[index][(c.direction, c.kind)] += 1

    def flat(counter: Counter[tuple[str, str]]) -> tuple[tuple[str, str, int], ...]:
        return tuple((d, k, n) for (d, k), n in sorted(counter.items()))

    return tuple(
        BucketRecord(b.name, b.entry_index, b.entry_text, b.modules, tuple(params[i]), flat(before_counts[i]),
                     flat(after_counts[i]), flat(nbytes[i]), b.forward_prefetch, b.backward_prefetch,
                     b.reduce_scatter_delay, b.overridden_by)
        for i, b in enumerate(plan.buckets)
    )


def _record(gm: fx.GraphModule, cfg: OverlapConfig, graph_kind: str, plan: ResolvedPlan,
            before: Sequence[Collective], after: Sequence[Collective], covered: Sequence[tuple[int, Collective]],
            merged: Sequence[MergedCollective], steps: Sequence[Any], started: float,
            notes: tuple[str, ...]) -> PassRecord:
    _, uncovered = attribute(before, plan) if plan.buckets else ((), [c for c in before if c.fsdp])
    record = PassRecord(
        strategy=cfg.strategy,
        graph_kind=graph_kind,
        buckets=_bucket_records(plan, covered, merged, after),
        steps=tuple(steps),
        before=count_collectives(before),
        after=count_collectives(after),
        uncovered=tuple((c.start.name, c.module_fqn) for c in uncovered),
        non_fsdp=tuple(c.start.name for c in before if not c.fsdp),
        seconds=time.perf_counter() - started,
        notes=notes,
    )
    gm.meta[RECORD_KEY] = record
    return record

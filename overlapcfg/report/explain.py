"""``explain(step, cfg)``: what the pass did to a step's graphs, per bucket, and what the step will cost.

Applying the config is ``overlapcfg.passes.applied``'s job (``apply_step``: copies, process groups, the pass);
this module is a function of its result (``AppliedStep``), which ``explain`` also takes directly. Every bucket
fact comes from the pass records (``gm.meta["overlapcfg"]``, ``overlapcfg.graph.record``): the parameters a
bucket's all-gathers carry and their sizes, the collectives before and after, the scheduler's decisions; the
records of the forward and backward graphs are combined here, nothing is re-derived from the trace.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.base import RankCount
from overlapcfg.config.contracts import contract_of
from overlapcfg.config.load import validate_value
from overlapcfg.cost.hardware import HardwareProfile, load_hardware
from overlapcfg.cost.node_costs import NodeCosts
from overlapcfg.cost.price import node_kind
from overlapcfg.cost.pricing import Pricing, pricing_from
from overlapcfg.cost.simulator import GroupPlacement, simulate, traced_group_size
from overlapcfg.errors import OverlapUsageError
from overlapcfg.graph.attribution import module_fqn
from overlapcfg.graph.collectives import find_collectives
from overlapcfg.graph.meta import merged_mark, pass_record
from overlapcfg.graph.ops import collective_kind
from overlapcfg.graph.record import BucketRecord, CollectiveChange, PassRecord
from overlapcfg.kinds import DIRECTIONS
from overlapcfg.module_paths import is_inside
from overlapcfg.passes.applied import AppliedStep, applied_graph, apply_graph, apply_step
from overlapcfg.passes.pipeline import GraphKind
from overlapcfg.passes.step import CapturedStep
from overlapcfg.report.eager_report import fsdp2_report, is_fsdp2_model
from overlapcfg.report.labels import KIND_LABELS
from overlapcfg.report.model import GraphReport, Report

__all__ = ["explain", "node_labels", "compact_order"]

SHOWN = 5
"""How many names a warning lists before it counts the rest (the JSON report holds them all)."""
MANY_LAYERS = 2
"""A bucket holding modules of more than this many layers gets a warning: its all-gather cannot overlap them."""

_LAYER = re.compile(r"^(.*?)(\d+)(?:\.|$)")


def node_labels(gm: fx.GraphModule, fqn_fn: Callable[[fx.Node], str | None] = module_fqn) -> dict[str, str]:
    """A short name for each collective start and wait (its bucket, else its owning module) and compute node."""
    record = pass_record(gm)
    buckets = record.buckets if record is not None else ()
    labels: dict[str, str] = {}
    for c in find_collectives(gm.graph, fqn_fn):
        mark = merged_mark(c.start)
        if mark is not None and mark.bucket < len(buckets):
            name = buckets[mark.bucket].name
        else:
            owner = c.module_fqn
            hit = next((b.name for b in buckets if owner and any(is_inside(owner, m) for m in b.modules)), None)
            name = hit or owner or c.start.name
        for n in (c.start, *c.waits):
            labels[n.name] = name
    for node in gm.graph.nodes:
        if node.name not in labels and node_kind(node) in ("compute", "memory"):
            labels[node.name] = fqn_fn(node) or ""
    return labels


def compact_order(gm: fx.GraphModule, labels: Mapping[str, str]) -> str:
    """``AG[layers.0] W[tok_embeddings] C×12 RS[layers.1] ...``: collectives by bucket, compute runs counted."""  # noqa: RUF002
    parts: list[str] = []
    run = 0
    for node in gm.graph.nodes:
        kind = node_kind(node)
        if kind == "compute":
            run += 1
            continue
        if kind not in ("collective", "wait"):
            continue
        if run:
            parts.append(f"C×{run}")
            run = 0
        if kind == "collective":
            label = KIND_LABELS.get(collective_kind(node) or "other", "COLL")
            parts.append(f"{label}[{labels.get(node.name, node.name)}]")
        else:
            parts.append(f"W[{labels.get(node.name, node.name)}]")
    if run:
        parts.append(f"C×{run}")
    return " ".join(parts)


def _bucket(recs: Sequence[BucketRecord], order: Mapping[str, int]) -> BucketRecord:
    """One bucket's records from the forward and backward passes, combined: collective counts added, decisions
    joined, held bytes added. Its parameters and their sizes are those of the first record whose all-gathers carry
    any (the forward's, where FSDP gathers every parameter before use; a later graph's gathers of the same
    parameters are not counted twice), plus any parameter only a later graph names; listed in model order where
    ``order`` (the step's parameter order) knows them, else as gathered."""
    first = recs[0]
    changes: dict[tuple[str, str], list[int]] = {}
    for rec in recs:
        for c in rec.collectives:
            slot = changes.setdefault((c.direction, c.kind), [0, 0, 0])
            slot[0] += c.before
            slot[1] += c.after
            slot[2] += c.unsharded_bytes
    sized = next((rec for rec in recs if rec.params or rec.unsharded_bytes), first)
    named = dict.fromkeys((*sized.params, *(p for rec in recs for p in rec.params)))
    params = tuple(sorted(named, key=lambda p: order.get(p, len(order)))) if order else tuple(named)
    return first.model_copy(update={
        "params": params, "param_count": len(params), "numel": sized.numel,
        "unsharded_bytes": sized.unsharded_bytes, "sharded_bytes": sized.sharded_bytes,
        "collectives": tuple(CollectiveChange(direction=d, kind=k, before=v[0], after=v[1], unsharded_bytes=v[2])
                             for (d, k), v in sorted(changes.items(), key=_change_order)),
        "decisions": tuple(d for rec in recs for d in rec.decisions),
        "held_bytes": sum(rec.held_bytes for rec in recs),
    })


def _change_order(item: tuple[tuple[str, str], list[int]]) -> tuple[int, int, str]:
    (direction, kind), _ = item
    return (DIRECTIONS.index(direction) if direction in DIRECTIONS else 2, kind != "all_gather", kind)


def _layers(names: Sequence[str]) -> int:
    return len({m.group(0).rstrip(".") for n in names if (m := _LAYER.match(n))})


def _warnings(buckets: Sequence[BucketRecord], records: Mapping[str, PassRecord]) -> list[str]:
    out: list[str] = []
    for b in buckets:
        if not any(c.before for c in b.collectives):
            out.append(f"bucket {b.name!r} (entry {b.entry_index} {b.entry_text!r}) has no FSDP collectives: its "
                       f"modules own no sharded parameters")
        layers = _layers(b.modules)
        if layers > MANY_LAYERS:
            out.append(f"bucket {b.name!r} (entry {b.entry_index} {b.entry_text!r}) spans {layers} layers: one "
                       f"all-gather brings them all in and nothing overlaps it within them")
    for graph, rec in records.items():
        for direction in DIRECTIONS:
            ags = [s for s in rec.decisions if s.kind == "all_gather" and s.direction == direction]
            capped = [s for s in ags if s.reason and "max_inflight_bytes" in s.reason]
            bindable = [s for s in ags if s.reason != "end of graph"]
            if bindable and len(capped) == len(bindable):
                eff = sorted({s.effective for s in capped})
                out.append(f"{graph}: max_inflight_bytes binds at every {direction} all-gather (effective depth "
                           f"{', '.join(map(str, eff))} instead of {capped[0].requested}); raise the cap or "
                           f"lower the depth")
        for direction in DIRECTIONS:
            ags = [s for s in rec.decisions if s.kind == "all_gather" and s.direction == direction]
            if ags and all(s.requested >= len(ags) for s in ags) and max(s.requested for s in ags) > len(ags):
                out.append(f"{graph}: {direction} prefetch depth {max(s.requested for s in ags)} is more than the "
                           f"{len(ags)} buckets there are: every all-gather is issued up front (effective depth "
                           f"{ags[0].effective} for the first bucket)")
        if rec.uncovered:
            owners = list(dict.fromkeys(u.owner or "?" for u in rec.uncovered))
            shown = ", ".join(owners[:SHOWN]) + (f" ... ({len(owners)} owners, all in report.json)"
                                                 if len(owners) > SHOWN else "")
            empty = not rec.buckets
            why = "the plan has no buckets" if empty else "outside every bucket"
            out.append(f"{graph}: {len(rec.uncovered)} FSDP collectives unbucketed, {why} (owners: {shown}); they "
                       "stay where the trace put them" + ("" if not empty else
                                                          "; set plan.require_full_coverage to make this an error"))
        # Notes (settings a strategy does not read, what was skipped) stay notes: GraphReport.notes, shown as such.
    return out


def _roles(rec: PassRecord) -> tuple[tuple[str, int], ...]:
    counts: dict[str, int] = {}
    for g in rec.groups:
        counts[g.role] = counts.get(g.role, 0) + g.before
    return tuple(sorted(counts.items()))


def _graph_report(name: str, gm: fx.GraphModule, rec: PassRecord, labels: Mapping[str, str]) -> GraphReport:
    return GraphReport(
        name=name, strategy=rec.strategy, nodes=len(gm.graph.nodes), collectives_before=rec.before.total_fsdp,
        collectives_after=rec.after.total_fsdp, non_fsdp=rec.non_fsdp,
        roles=_roles(rec), groups=rec.groups,
        uncovered=tuple(u.model_copy(update={"graph": name}) for u in rec.uncovered),
        order=compact_order(gm, labels), pass_seconds=rec.seconds, notes=rec.notes,
    )


def explain(step: CapturedStep | AppliedStep | fx.GraphModule | nn.Module,
            cfg: OverlapConfig | Mapping[str, Any] | None = None, *,
            hardware: HardwareProfile | str | None = None, world_size: int | None = None,
            graph_kind: GraphKind = "auto", groups: Mapping[str, GroupPlacement] | None = None,
            node_costs: NodeCosts | None = None, as_dtype: torch.dtype | None = None,
            pricing: Pricing | Mapping[str, Any] | None = None, pricing_path: str = "pricing") -> Report:
    """Apply ``cfg`` to copies of ``step``'s graphs (``overlapcfg.passes.apply_step``) and report per bucket;
    predict the step if ``hardware`` (and the untransformed step, ``Report.baseline``, where the untransformed
    graphs are at hand).

    ``step`` may also be what ``apply_step`` returned (an ``AppliedStep``: reported as it is, no ``cfg``), a model
    ``overlapcfg.fully_shard`` sharded (eager FSDP2: its record is reported), or one graph module: if ``apply``
    already transformed it, its record is read and nothing is re-run; otherwise ``cfg`` is applied to a copy
    (``graph_kind`` as for ``apply``) and the copy is reported. ``world_size``: the size the prediction is made for
    (default: the trace's). ``groups`` places process groups by name for the prediction
    (``overlapcfg.cost.simulator.GroupPlacement``: HSDP's replicate group across nodes); unplaced groups keep
    their traced size, the whole world scales to ``world_size``. ``as_dtype`` costs floating tensors as that dtype
    (bf16 mixed precision from an fp32 trace); ``pricing``: checkpointing, fusion, optimizer, attention backend,
    tokens (``overlapcfg.cost.pricing.Pricing``), its faults under ``pricing_path``.
    """
    if isinstance(step, AppliedStep):
        if cfg is not None:
            raise OverlapUsageError("explain: an AppliedStep carries the config it was applied with; pass no cfg")
        config = step.config
    elif cfg is None:
        raise OverlapUsageError("explain: pass the config to apply (cfg=...)")
    else:
        config = load_config(cfg)
    if world_size is not None:  # 0 is a fault, not "the trace's size"
        world_size = validate_value(RankCount, world_size, path="world_size")
    if isinstance(step, AppliedStep):
        return _report(step, hardware=hardware, world_size=world_size, groups=groups, node_costs=node_costs,
                       as_dtype=as_dtype, pricing=pricing, pricing_path=pricing_path)
    if is_fsdp2_model(step):
        if hardware is not None:
            raise OverlapUsageError(
                "explain: no prediction for eager FSDP2 (the cost model replays graphs); pass no hardware")
        # is_fsdp2_model(step) holds: step is the nn.Module fully_shard sharded
        return fsdp2_report(step, config)  # type: ignore[arg-type]
    if isinstance(step, fx.GraphModule):
        # The traced group size is written into every collective; a bare graph has no CapturedStep to ask.
        found = traced_group_size(step)
        if found is None and world_size is None:
            raise OverlapUsageError("explain: this graph has no collective that names its group size; pass world_size=")
        trace_ws = found or world_size or 1
        done = pass_record(step) is not None
        applied = applied_graph(step, config, world_size=trace_ws) if done else \
            apply_graph(step, config, world_size=trace_ws, graph_kind=graph_kind)
    elif isinstance(step, CapturedStep):
        applied = apply_step(step, config)
    else:
        raise OverlapUsageError(f"explain: expected a CapturedStep, an AppliedStep, a graph module or a model "
                                f"overlapcfg.fully_shard sharded, got {type(step).__name__}")
    return _report(applied, hardware=hardware, world_size=world_size, groups=groups, node_costs=node_costs,
                   as_dtype=as_dtype, pricing=pricing, pricing_path=pricing_path)


def _report(applied: AppliedStep, *, hardware: HardwareProfile | str | None, world_size: int | None,
            groups: Mapping[str, GroupPlacement] | None, node_costs: NodeCosts | None,
            as_dtype: torch.dtype | None = None, pricing: Pricing | Mapping[str, Any] | None = None,
            pricing_path: str = "pricing") -> Report:
    """The report of ``applied``: a function of it (and of the hardware the prediction is for)."""
    config, traced = applied.config, applied.step
    graphs = {a.name: a.graph for a in applied.graphs}
    records = {a.name: a.record for a in applied.graphs}
    labels = {a.name: node_labels(a.graph, a.module_fqn_fn) for a in applied.graphs}
    by_name: dict[str, list[BucketRecord]] = {}
    for rec in records.values():
        for b in rec.buckets:
            by_name.setdefault(b.name, []).append(b)
    order = {p: i for i, p in enumerate(traced.param_fqns)} if traced is not None else {}
    buckets = tuple(_bucket(recs, order) for recs in by_name.values())
    simulation = baseline = None
    if hardware is not None:
        hw = load_hardware(hardware)
        ws, traced_ws = world_size or applied.world_size, traced.world_size if traced is not None else None
        priced = pricing_from(pricing, path=pricing_path)
        simulation = simulate(list(graphs.values()), hw, world_size=ws, names=list(graphs), labels=labels,
                              traced_world_size=traced_ws, groups=groups, node_costs=node_costs, as_dtype=as_dtype,
                              pricing=priced, pricing_path=pricing_path)
        untransformed = [a.original for a in applied.graphs if a.original is not None]
        if untransformed:  # the "before" the table shows, kept in the report so report.json says it too
            baseline = simulate(untransformed, hw, world_size=ws, names=list(graphs), traced_world_size=traced_ws,
                                groups=groups, node_costs=node_costs, as_dtype=as_dtype, pricing=priced,
                                pricing_path=pricing_path)
    report = Report(
        strategy=config.strategy,
        plan_name=config.plan.name if config.plan is not None and contract_of(config.strategy).uses_plan else None,
        config=config.model_dump(mode="json"),
        world_size=applied.world_size, buckets=buckets,
        graphs=tuple(_graph_report(n, gm, records[n], labels[n]) for n, gm in graphs.items()),
        warnings=tuple(_warnings(buckets, records)), simulation=simulation, baseline=baseline,
        mesh=traced.mesh_groups if traced is not None else (),
    )
    return report.attach(graphs.get("forward"), graphs.get("backward"))

"""Rich renderables for reports and comparisons. Rendering only: every number comes from the report data
(``overlapcfg.report.model``), which this module imports and draws; ``print(report)`` and ``rich.print(report)``
reach these tables, and ``report.timeline(path)`` / ``comparison.timeline(path)`` the writers of ``timeline``, through
``overlapcfg.results.present``, called at the end of this module (the package imports it, and the data names it as
its ``presented_by``, so they are registered wherever a report exists)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from overlapcfg.cost.prediction import CostSource, Simulation
from overlapcfg.errors import OverlapStateError
from overlapcfg.report.bucket_table import bucket_table
from overlapcfg.report.labels import (
    LEGEND,
    ROLE_LABELS,
    fmt_bytes,
    fmt_change,
    fmt_order,
    fmt_pct,
    fmt_rate,
    fmt_seconds,
)
from overlapcfg.report.model import Comparison, Report
from overlapcfg.report.timeline import write_run_timeline
from overlapcfg.results import PIPED_WIDTH, plain_text, present

__all__ = ["PIPED_WIDTH", "assumptions_line", "comparison_table", "cost_sources_line", "groups_table", "plain_text",
           "rate_text", "report_table"]

SHOWN_UNCOVERED = 5
"""Uncovered collectives the graphs table names before it counts the rest (``report.json`` holds them all)."""


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _change(before: float, after: float) -> str:
    return "" if not before else f" ({fmt_change(after, before, 0)})"


def _busy(stream: str) -> Callable[[Simulation], float]:
    return lambda s: next((t.busy_seconds for t in s.streams if t.stream == stream), 0.0)


PART_LABELS = {"matmul": "matmul (FLOP-counted kernels)", "attention": "fused attention",
               "memory": "memory-bound kernels", "other": "other (issuing collectives, timed views)"}
"""How the prediction table names each part of compute (``Simulation.compute_parts``)."""


def _part(part: str) -> Callable[[Simulation], float]:
    return lambda s: next((p.seconds for p in s.compute_parts if p.part == part), 0.0)


def cost_sources_line(sources: Sequence[CostSource], node_costs: str | None = None) -> str:
    """``compute: 812 measured 41.2 ms, 37 roofline 1.3 ms; collectives: 17 fitted 9.1 ms``: which source priced
    how many nodes and how much time (``Simulation.cost_sources``); ``node_costs`` says what was measured."""
    parts: dict[str, list[str]] = {}
    for s in sources:
        parts.setdefault(s.part, []).append(f"{s.nodes} {s.source} {fmt_seconds(s.seconds)}")
    text = "; ".join(f"{part}: {', '.join(items)}" for part, items in parts.items())
    return text + (f" (measured: {node_costs})" if node_costs else "")


def rate_text(rate: Any) -> str:
    """``14.8k tok/s per GPU, MFU 38.2%`` from anything with ``tokens_per_second`` and ``mfu``; empty where
    neither is known."""
    parts = []
    if getattr(rate, "tokens_per_second", None) is not None:
        parts.append(f"{fmt_rate(rate.tokens_per_second)} per GPU")
    if getattr(rate, "mfu", None) is not None:
        parts.append(f"MFU {fmt_pct(rate.mfu)}")
    return ", ".join(parts)


def assumptions_line(sim: Simulation) -> str:
    """What the prediction assumed besides the hardware: checkpointing, fusion, optimizer
    (``Simulation.pricing``), in one line."""
    pricing = sim.pricing or {}
    parts = []
    if sim.recompute:
        parts.append(f"checkpointing {sim.recompute}")
    if pricing.get("fusion"):
        parts.append(f"fusion {pricing['fusion']}")
    if sim.optimizer and sim.optimizer != "none":
        parts.append(f"after the backward: {sim.optimizer}")
    if sim.throughput_note:
        parts.append(sim.throughput_note)
    return "assumed: " + "; ".join(parts) if parts else ""


def _simulation(report: Report, sim: Simulation, baseline: Simulation | None = None) -> Table:
    """The prediction; with ``baseline`` (the untransformed step), a "before" column and the change of each time.

    The lower bound bounds the step time (it sits under it); with several process groups, communication is their
    sum while the bound counts the busiest group alone, so each group's own time is shown under the sum."""
    caption = f"priced by {cost_sources_line(sim.cost_sources, sim.node_costs)}" if sim.cost_sources else ""
    assumed = assumptions_line(sim)
    table = Table(title=f"Prediction: {sim.hardware}, {_predicted_at(report, sim)}", show_header=baseline is not None,
                  caption="\n".join(x for x in (caption, assumed) if x) or None)
    table.add_column("metric", style="bold")
    if baseline is not None:
        table.add_column("before (no pass)", justify="right")
    table.add_column("after" if baseline is not None else "value", justify="right")
    comm = [t.stream for t in sim.streams if t.stream.startswith("comm:")]  # one per process group
    several = len(comm) > 1
    rows: list[tuple[str, Callable[[Simulation], float | int | None], Callable[..., str]]] = [
        ("step time", lambda s: s.step_seconds, fmt_seconds),
        ("  lower bound: max(compute + unhidable, busiest group)" if several else
         "  lower bound: max(compute + unhidable, communication)", lambda s: s.lower_bound_seconds, fmt_seconds),
        ("  tokens/s per GPU", lambda s: s.tokens_per_second, fmt_rate),
        ("  MFU: 6 N tokens / peak", lambda s: s.mfu, fmt_pct),
        ("  by the graph's FLOPs", lambda s: s.graph_mfu, fmt_pct),
        ("compute", lambda s: s.compute_seconds, fmt_seconds),
    ]
    shown = {p.part for p in (*sim.compute_parts, *(baseline.compute_parts if baseline is not None else ()))}
    rows += [(f"  {PART_LABELS[part]}", _part(part), fmt_seconds) for part in PART_LABELS if part in shown]
    if sim.contention_seconds > 0 or (baseline is not None and baseline.contention_seconds > 0):
        rows.append(("contention: compute slowed by collectives", lambda s: s.contention_seconds, fmt_seconds))
    rows += [
        ("communication, all groups summed" if several else "communication", lambda s: s.comm_seconds, fmt_seconds),
    ]
    if several:
        rows += [(f"  {report.group_label(stream.removeprefix('comm:'))}", _busy(stream), fmt_seconds)
                 for stream in comm]
    rows += [
        ("exposed communication", lambda s: s.exposed_comm_seconds, fmt_seconds),
        ("overlap", lambda s: s.overlap_ratio, _pct),
        ("peak all-gathers in flight", lambda s: s.peak_inflight_bytes, fmt_bytes),
        ("peak unsharded parameters", lambda s: s.peak_unsharded_param_bytes, fmt_bytes),
        ("peak activations (graph-allocated)", lambda s: s.peak_activation_bytes, fmt_bytes),
    ]
    for label, value, fmt in rows:
        if baseline is None:
            table.add_row(escape(label), fmt(value(sim)))
            continue
        after = fmt(value(sim))
        if fmt is fmt_seconds and value(baseline) is not None:
            # a seconds row's values are floats (rows formatted with fmt_seconds hold times)
            after += _change(value(baseline), value(sim))  # type: ignore[arg-type]
        table.add_row(escape(label), fmt(value(baseline)), after)
    return table


def _predicted_at(report: Report, sim: Simulation) -> str:
    """``world size 64 (traced at 2)``: the size a prediction is for, and the trace's where they differ, so a
    prediction never reads as being for the size of the tables above it."""
    traced = f" (traced at {report.world_size})" if report.world_size != sim.world_size else ""
    return f"world size {sim.world_size}{traced}"


def _source(report: Report) -> str:
    """How the report's buckets came to be at their world size: a trace, or eager FSDP2 sharding (no graph)."""
    return "sharded" if report.graphs and all(g.nodes == 0 for g in report.graphs) else "traced"


def _no_buckets(report: Report) -> Text:
    """What stands in for an empty bucket table (``auto`` merges by itself, ``none`` leaves the graph): the counts,
    not a table with headers and no rows."""
    before = sum(g.collectives_before for g in report.graphs)
    after = sum(g.collectives_after for g in report.graphs)
    what = (f"the strategy merged FSDP collectives by itself, {before} → {after} (graphs table and order lines "
            "below)" if after < before else f"nothing merged, the {before} FSDP collectives stay as traced")
    return Text.assemble((f"overlapcfg: strategy {report.strategy}, {_source(report)} at world size "
                          f"{report.world_size}", "bold"), f"\nno plan buckets: {what}")


def report_table(report: Report, *, baseline: Simulation | None = None) -> Group:
    """The whole report: buckets, graphs, order lines, notes, warnings, a legend, the prediction.

    ``baseline``: the prediction for the untransformed step, shown as a "before" column next to the report's;
    default: the report's own (``Report.baseline``).
    """
    baseline = baseline if baseline is not None else report.baseline
    title = f"overlapcfg: strategy {report.strategy}" + (f", plan {report.plan_name}" if report.plan_name else "")
    at = f"{_source(report)} at world size {report.world_size}"
    buckets = (bucket_table(title, report.buckets, world_size=report.world_size, source=_source(report))
               if report.buckets else _no_buckets(report))
    graphs = Table(title=f"graphs, {at}")
    for col in ("graph", "nodes", "FSDP collectives", "non-FSDP left alone", "uncovered", "pass time"):
        graphs.add_column(col)
    for g in report.graphs:
        uncovered = ", ".join(f"{u.node} ({u.owner})" for u in g.uncovered[:SHOWN_UNCOVERED]) or "—"
        if len(g.uncovered) > SHOWN_UNCOVERED:
            uncovered = f"{len(g.uncovered)}: {uncovered}, … (all in report.json)"
        nodes = str(g.nodes) if g.nodes else "—"  # eager FSDP2 has no graph
        graphs.add_row(g.name, nodes, f"{g.collectives_before} → {g.collectives_after}",
                       escape(_left_alone(g.non_fsdp)), escape(uncovered), fmt_seconds(g.pass_seconds))
    parts: list[RenderableType] = [buckets, graphs]
    groups = groups_table(report)
    if groups is not None:
        parts.append(groups)
    for g in report.graphs:
        parts.append(Text.assemble((f"{g.name} order: ", "bold"), fmt_order(g.order)))
    notes = list(dict.fromkeys(f"{g.name}: {n}" for g in report.graphs for n in g.notes))
    if notes:
        parts.append(Text("notes:", style="bold"))
        parts.extend(Text(f"  • {n}") for n in notes)
    if report.warnings:
        parts.append(Text("warnings:", style="bold yellow"))
        parts.extend(Text(f"  • {w}", style="yellow") for w in report.warnings)
    parts.append(Text("\n".join(LEGEND), style="dim"))
    if report.simulation is not None:
        parts.append(_simulation(report, report.simulation, baseline))
    return Group(*parts)


def _left_alone(names: tuple[str, ...], shown: int = 3) -> str:
    """A few node names, then a count (tensor parallel leaves dozens; all of them are in ``report.json``)."""
    if len(names) <= shown:
        return ", ".join(names) or "—"
    return f"{len(names)}: {', '.join(names[:shown])} … (by group below)"


def groups_table(report: Report) -> Table | None:
    """Collectives per process group and role, before → after, with the bytes each group moves per step; shown
    when there is more than one group or anything but FSDP traffic (HSDP, tensor parallel), so a 1-D FSDP
    report stays as it was."""
    rows = [(g.name, t) for g in report.graphs for t in g.groups]
    if len({t.group for _, t in rows}) < 2 and all(t.role.startswith("fsdp_") for _, t in rows):
        return None
    table = Table(title=f"process groups, {_source(report)} at world size {report.world_size} (role: what the pass "
                        "may do with it)")
    for col in ("graph", "group", "ranks", "role", "collectives before → after", "bytes per step"):
        table.add_column(col, justify="right" if col in ("ranks", "bytes per step") else "left")
    for name, t in rows:
        table.add_row(name, escape(report.group_label(t.group)), "?" if t.size is None else str(t.size),
                      ROLE_LABELS.get(t.role, t.role), f"{t.before} → {t.after}", fmt_bytes(t.unsharded_bytes))
    return table


def comparison_table(comparison: Comparison) -> Table:
    first = comparison.rows[0] if comparison.rows else None
    title = "compare" + (f": {first.simulation.hardware}, {_predicted_at(first.report, first.simulation)}"
                         if first else "")
    # Light rules and no wrapping of names or values (a cut name is unreadable); only the headers wrap.
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for col in ("config", "strategy", "step\ntime", "tok/s\nper GPU", "MFU", "lower\nbound", "exposed\ncomm", "overlap",
                "peak in\nflight", "peak\nunsharded", "FSDP\ncolls", "pass\ntime"):  # pass time: wall clock, whole ms
        table.add_column(col, justify="left" if col in ("config", "strategy") else "right", no_wrap=True)
    best = min((r.simulation.step_seconds for r in comparison.rows), default=None)
    for r in comparison.rows:
        s = r.simulation
        style = "bold green" if best is not None and s.step_seconds == best else None
        table.add_row(escape(r.name), r.strategy, fmt_seconds(s.step_seconds), fmt_rate(s.tokens_per_second),
                      fmt_pct(s.mfu), fmt_seconds(s.lower_bound_seconds),
                      fmt_seconds(s.exposed_comm_seconds), _pct(s.overlap_ratio), fmt_bytes(s.peak_inflight_bytes),
                      fmt_bytes(s.peak_unsharded_param_bytes), str(r.collectives), f"{r.pass_seconds * 1e3:.0f} ms",
                      style=style)
    return table


def _report_timeline(report: Report, path: Path) -> Path:
    if report.simulation is None:
        raise OverlapStateError("Report.timeline: this report has no prediction to draw; explain it with a "
                                "hardware profile (overlapcfg.explain(step, cfg, hardware='h100_nvlink'))")
    name = report.strategy + (f" {report.plan_name}" if report.plan_name else "")
    return write_run_timeline([(name, report.simulation)], path, mesh={group: dim for dim, group in report.mesh},
                              title=f"{report.simulation.hardware}, {_predicted_at(report, report.simulation)}")


def _comparison_timeline(comparison: Comparison, path: Path) -> Path:
    return write_run_timeline([(r.name, r.simulation) for r in comparison.rows], path,
                              mesh={group: dim for r in comparison.rows for dim, group in r.report.mesh},
                              title=f"{comparison.hardware}, world size {comparison.world_size}")


present(Report, draw=report_table, timeline=_report_timeline)
present(Comparison, draw=comparison_table, timeline=_comparison_timeline)

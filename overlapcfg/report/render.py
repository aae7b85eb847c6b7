"""Rich renderables for reports and comparisons. Rendering only: every number comes from the report data."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from overlapcfg.report.labels import KIND_LABELS, fmt_bytes, fmt_count, fmt_seconds

if TYPE_CHECKING:
    from overlapcfg.report.compare import Comparison
    from overlapcfg.report.model import Report, Simulation

__all__ = ["comparison_table", "report_table"]

_DIR = {"forward": "fw", "backward": "bw"}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _depths(report_bucket: object) -> str:
    b = report_bucket
    parts = []
    for label, field, direction, kind in (("fw", "forward_prefetch", "forward", "all_gather"),
                                          ("bw", "backward_prefetch", "backward", "all_gather"),
                                          ("rs", "reduce_scatter_delay", "backward", "reduce_scatter")):
        requested = getattr(b, field)
        eff = [d.effective for d in b.decisions if (d.direction, d.kind) == (direction, kind)]
        shown = str(requested) if not eff or eff == [requested] else f"{requested}→{eff[0]}"
        parts.append(f"{label} {shown}")
    return " ".join(parts)


def _simulation(sim: Simulation) -> Table:
    table = Table(title=f"Prediction: {sim.hardware}, world size {sim.world_size}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, value in (
        ("step time", fmt_seconds(sim.step_seconds)),
        ("lower bound max(compute, comm)", fmt_seconds(sim.lower_bound_seconds)),
        ("compute", fmt_seconds(sim.compute_seconds)),
        ("communication", fmt_seconds(sim.comm_seconds)),
        ("exposed communication", fmt_seconds(sim.exposed_comm_seconds)),
        ("overlap", _pct(sim.overlap_ratio)),
        ("peak all-gathers in flight", fmt_bytes(sim.peak_inflight_bytes)),
        ("peak unsharded parameters", fmt_bytes(sim.peak_unsharded_param_bytes)),
        ("peak activations (graph-allocated)", fmt_bytes(sim.peak_activation_bytes)),
    ):
        table.add_row(label, value)
    return table


def report_table(report: Report) -> Group:
    buckets = Table(title=f"overlapcfg: strategy {report.strategy}"
                          + (f", plan {report.plan_name}" if report.plan_name else ""))
    for col, kw in (("bucket", {"style": "bold"}), ("entry", {}), ("modules", {}), ("params", {"justify": "right"}),
                    ("elements", {"justify": "right"}), ("unsharded", {"justify": "right"}),
                    ("sharded", {"justify": "right"}), ("collectives before → after", {}), ("depths", {}),
                    ("why", {"style": "yellow"})):
        buckets.add_column(col, **kw)
    for b in report.buckets:
        colls = ", ".join(f"{_DIR[c.direction]} {KIND_LABELS.get(c.kind, c.kind)} {c.before}→{c.after}"
                          for c in b.collectives) or "none"
        modules = ", ".join(b.modules) if len(b.modules) <= 3 else f"{b.modules[0]} … ({len(b.modules)})"
        reasons = "; ".join(dict.fromkeys(d.reason for d in b.decisions if d.reason and d.reason != "end of graph"))
        buckets.add_row(escape(b.name), escape(f"[{b.entry_index}] {b.entry_text}"), escape(modules),
                        str(b.param_count), fmt_count(b.numel), fmt_bytes(b.unsharded_bytes),
                        fmt_bytes(b.sharded_bytes), colls, _depths(b), escape(reasons))
    graphs = Table(title="graphs")
    for col in ("graph", "nodes", "FSDP collectives", "non-FSDP left alone", "uncovered", "pass time"):
        graphs.add_column(col)
    for g in report.graphs:
        uncovered = ", ".join(f"{u.node} ({u.owner})" for u in g.uncovered) or "—"
        graphs.add_row(g.name, str(g.nodes), f"{g.collectives_before} → {g.collectives_after}",
                       escape(", ".join(g.non_fsdp) or "—"), escape(uncovered), fmt_seconds(g.pass_seconds))
    parts: list[object] = [buckets, graphs]
    for g in report.graphs:
        parts.append(Text.assemble((f"{g.name} order: ", "bold"), g.order))
    notes = list(dict.fromkeys(f"{g.name}: {n}" for g in report.graphs for n in g.notes))
    if notes:
        parts.append(Text("notes:", style="bold"))
        parts.extend(Text(f"  • {n}") for n in notes)
    if report.warnings:
        parts.append(Text("warnings:", style="bold yellow"))
        parts.extend(Text(f"  • {w}", style="yellow") for w in report.warnings)
    if report.simulation is not None:
        parts.append(_simulation(report.simulation))
    return Group(*parts)


def comparison_table(comparison: Comparison) -> Table:
    first = comparison.rows[0].simulation if comparison.rows else None
    title = "compare" + (f": {first.hardware}, world size {first.world_size}" if first else "")
    table = Table(title=title)
    for col in ("config", "strategy", "step time", "lower bound", "exposed comm", "overlap", "peak in flight",
                "peak unsharded", "collectives", "pass time"):
        table.add_column(col, justify="left" if col in ("config", "strategy") else "right")
    best = min((r.simulation.step_seconds for r in comparison.rows), default=None)
    for r in comparison.rows:
        s = r.simulation
        style = "bold green" if best is not None and s.step_seconds == best else None
        table.add_row(escape(r.name), r.strategy, fmt_seconds(s.step_seconds), fmt_seconds(s.lower_bound_seconds),
                      fmt_seconds(s.exposed_comm_seconds), _pct(s.overlap_ratio), fmt_bytes(s.peak_inflight_bytes),
                      fmt_bytes(s.peak_unsharded_param_bytes), str(r.collectives), fmt_seconds(r.pass_seconds),
                      style=style)
    return table

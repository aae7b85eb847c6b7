"""Drawing a ``TuneResult``: rich tables (top candidates, Pareto front, presets, where time is still lost) and a
PNG of the Pareto front with the presets marked. Rendering only: every number comes from the result."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table

from overlapcfg.files import write_atomic
from overlapcfg.report.labels import fmt_bytes, fmt_seconds
from overlapcfg.tuning.candidates import Candidate
from overlapcfg.tuning.result import TuneResult

__all__ = ["tune_tables", "write_front_png"]

SHOWN_STALLS = 8


def _pct(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.2f}%" if base > 0 else "—"


def _candidates(title: str, rows: tuple[Candidate, ...], result: TuneResult) -> Table:
    base = result.best_preset
    table = Table(title=title, box=box.SIMPLE_HEAD)
    table.add_column("candidate", min_width=44)
    for col in ("step", "vs best preset", "exposed comm", "peak in flight", "peak unsharded", "fits"):
        table.add_column(col, justify="right")
    for c in rows:
        mark = "[bold green]★[/bold green] " if c is result.best or c.config == result.config else ""
        table.add_row(mark + c.name, fmt_seconds(c.step_seconds),
                      _pct(c.step_seconds, base.step_seconds) if base is not None else "—",
                      fmt_seconds(c.score.exposed_comm_seconds), fmt_bytes(c.peak_inflight_bytes),
                      fmt_bytes(c.score.peak_unsharded_param_bytes), "yes" if result.fits(c) else "[red]no[/red]")
    return table


def _summary(result: TuneResult) -> Table:
    s = result.score
    table = Table(title=f"Tuned for {result.hardware} at {result.world_size} ranks", show_header=False,
                  box=box.SIMPLE_HEAD)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note")
    v = result.verification
    table.add_row("predicted step", fmt_seconds(s.step_seconds), result.best.name)
    if v is not None:
        table.add_row("full apply + verify + simulate", fmt_seconds(v.simulation.step_seconds),
                      f"quick model {100 * v.agreement:.3f}% apart")
    table.add_row("exposed communication", fmt_seconds(s.exposed_comm_seconds), "")
    table.add_row("lower bound: max(compute, comm)", fmt_seconds(s.lower_bound_seconds),
                  f"tuned {_pct(s.step_seconds, s.lower_bound_seconds)}")
    table.add_row("... + unhidable first AG / last RS", fmt_seconds(s.unhidable_bound_seconds),
                  f"tuned {_pct(s.step_seconds, s.unhidable_bound_seconds)}")
    table.add_row("peak all-gathers in flight", fmt_bytes(s.peak_inflight_bytes),
                  f"budget {fmt_bytes(result.memory_budget)}" if result.memory_budget else "no budget")
    table.add_row("peak unsharded parameters", fmt_bytes(s.peak_unsharded_param_bytes), "")
    best = result.best_preset
    if best is not None:
        table.add_row("best preset in budget", fmt_seconds(best.step_seconds),
                      f"{best.name} (tuned {_pct(s.step_seconds, best.step_seconds)})")
    table.add_row("searched", f"{result.evaluated} candidates",
                  f"{result.arms} groupings, {result.seconds:.1f} s (profile {result.profile_seconds:.1f} s"
                  + (f", check {v.seconds:.1f} s)" if v is not None else ")"))
    return table


def _stalls(result: TuneResult) -> Table:
    table = Table(title="Where the tuned step still waits (quick model)", box=box.SIMPLE_HEAD)
    for col in ("graph", "waits on", "bucket", "at", "stall"):
        table.add_column(col, justify="right" if col in ("at", "stall") else "left")
    for s in sorted(result.stalls, key=lambda s: -s.seconds)[:SHOWN_STALLS]:
        table.add_row(s.graph, "all-gather" if s.kind == "all_gather" else "reduce-scatter", s.bucket,
                      fmt_seconds(s.at), fmt_seconds(s.seconds))
    return table


def tune_tables(result: TuneResult) -> Group:
    """Summary, top candidates, Pareto front, presets and remaining stalls, for ``Console.print``."""
    presets = tuple(sorted(result.presets, key=lambda c: c.step_seconds))
    parts = [_summary(result), _candidates("Top candidates within the budget", result.top, result),
             _candidates("Pareto front: step time vs peak all-gathers in flight", result.pareto, result),
             _candidates("Shipped presets on the same trace", presets, result)]
    if result.stalls:
        parts.append(_stalls(result))
    return Group(*parts)


def _preset_points(result: TuneResult) -> list[tuple[float, float, list[str]]]:
    """Presets at the same point (``torch_manual`` and ``default`` of one plan) share a marker, fastest first."""
    points: dict[tuple[int, float], list[str]] = {}
    for p in sorted(result.presets, key=lambda c: (c.step_seconds, c.name)):
        points.setdefault((p.peak_inflight_bytes, round(p.step_seconds, 9)), []).append(p.name)
    return [(b / 2**30, 1e3 * s, names) for (b, s), names in points.items()]


def write_front_png(result: TuneResult, path: Path) -> Path:
    """Every candidate (grey), the Pareto front, the presets (numbered, listed beside) and the winner, step time
    against peak in-flight bytes, with the budget and both lower bounds. The view is the region around the front
    and the tuned point; presets outside it are listed with their numbers all the same."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    gib = 2**30
    s, best = result.score, result.best
    top = 1e3 * max(1.15 * best.step_seconds, min(p.step_seconds for p in result.presets) * 1.02
                    if result.presets else 0.0)
    bottom = 1e3 * s.lower_bound_seconds * 0.98
    right = 1.15 * max([best.peak_inflight_bytes / gib, (result.memory_budget or 0) / gib,
                        *(c.peak_inflight_bytes / gib for c in result.pareto if 1e3 * c.step_seconds <= top)])
    fig, ax = plt.subplots(figsize=(15, 6.5), dpi=110)
    ax.scatter([c.peak_inflight_bytes / gib for c in result.candidates],
               [1e3 * c.step_seconds for c in result.candidates], s=6, color="#BBBBBB", label="candidates")
    front = result.pareto
    ax.plot([c.peak_inflight_bytes / gib for c in front], [1e3 * c.step_seconds for c in front], "-o",
            color="#1f77b4", markersize=4, label="Pareto front")
    listing = []
    for k, (x, y, names) in enumerate(_preset_points(result), start=1):
        ax.scatter([x], [y], marker="s", s=30, color="#FF7F0E", zorder=4)
        ax.annotate(str(k), (x, y), fontsize=8, xytext=(4, 3), textcoords="offset points")
        where = "" if x <= right and y <= top else ", off the view"
        shown = names[0] + (f" (+{len(names) - 1} alike)" if len(names) > 1 else "")
        listing.append(f"{k}. {shown}: {y:.1f} ms, {x:.2f} GiB{where}")
    ax.scatter([], [], marker="s", color="#FF7F0E", label="shipped presets (numbered)")
    ax.scatter([best.peak_inflight_bytes / gib], [1e3 * best.step_seconds], marker="*", s=220, color="#2CA02C",
               zorder=5, label=f"tuned: {fmt_seconds(best.step_seconds)}")
    ax.axhline(1e3 * s.lower_bound_seconds, ls="--", color="#555555", lw=1, label="max(compute, comm)")
    ax.axhline(1e3 * s.unhidable_bound_seconds, ls=":", color="#555555", lw=1,
               label="+ unhidable first all-gather / last reduce-scatter")
    if result.memory_budget:
        ax.axvline(result.memory_budget / gib, color="#D62728", lw=1, label=f"budget {fmt_bytes(result.memory_budget)}")
    ax.set_xlim(0, right)
    ax.set_ylim(bottom, top)
    ax.set_xlabel("peak all-gathers in flight (GiB)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(f"overlapcfg tune: {result.hardware}, {result.world_size} ranks, {result.evaluated} candidates")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.text(0.63, 0.5, "shipped presets\n" + "\n".join(listing), fontsize=7, va="center", family="monospace")
    fig.subplots_adjust(left=0.06, right=0.61, top=0.93, bottom=0.09)
    try:
        return write_atomic(path, fig.savefig)
    finally:
        plt.close(fig)

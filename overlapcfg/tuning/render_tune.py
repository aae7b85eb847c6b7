"""Drawing a ``TuneResult``: rich tables (top candidates, Pareto front, presets, where time is still lost); the PNG
of the Pareto front is ``overlapcfg.tuning.front`` (re-exported here). Rendering only: every number comes from the
result. Registered with ``overlapcfg.results.present`` at the end, so ``print(result)``, ``result.plot(path)`` and
``result.timeline(path)`` draw with the same functions the command calls."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from overlapcfg.errors import OverlapStateError
from overlapcfg.report.labels import fmt_bytes, fmt_change, fmt_pct, fmt_rate, fmt_seconds
from overlapcfg.report.timeline import write_run_timeline
from overlapcfg.results import present
from overlapcfg.tuning.candidates import Candidate
from overlapcfg.tuning.front import write_front_png
from overlapcfg.tuning.tune_result import TuneResult

__all__ = ["tune_tables", "write_front_png"]

SHOWN_STALLS = 8


def _pct(value: float, base: float) -> str:
    return fmt_change(value, base)


def _candidates(title: str, rows: tuple[Candidate, ...], result: TuneResult) -> Table:
    """One row per candidate. Numbers never wrap or shrink (a cut number is a wrong number): the name column
    alone gives way, folding long names onto a second line, so the table fits 80 columns with every value whole."""
    base = result.best_preset
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("candidate", ratio=1, min_width=16, overflow="fold")
    # MFU only where the step's tokens and parameters are known (a column of dashes would only cost width).
    with_mfu = any(result.rate(c.step_seconds).mfu is not None for c in rows)
    for col in ("step", *(("MFU",) if with_mfu else ()), "vs best\npreset", "exposed\ncomm", "peak in\nflight",
                "peak\nunsharded", "fits"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in rows:
        mark = "[bold green]★[/bold green] " if c is result.best or c.config == result.config else ""
        mfu = (fmt_pct(result.rate(c.step_seconds).mfu),) if with_mfu else ()
        table.add_row(mark + escape(c.name), fmt_seconds(c.step_seconds), *mfu,
                      _pct(c.step_seconds, base.step_seconds) if base is not None else "—",
                      fmt_seconds(c.score.exposed_comm_seconds), fmt_bytes(c.peak_inflight_bytes),
                      fmt_bytes(c.score.peak_unsharded_param_bytes), "yes" if result.fits(c) else "[red]no[/red]")
    return table


def _summary(result: TuneResult) -> Table:
    s = result.score
    table = Table(title=f"Tuned for {result.hardware} at {result.world_size} ranks", show_header=False,
                  box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("what", style="bold", overflow="fold")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("note", ratio=1, overflow="fold")
    v = result.verification
    table.add_row("predicted step", fmt_seconds(s.step_seconds), escape(result.best.name))
    rate = result.rate_text(s.step_seconds)
    if rate:
        table.add_row("throughput", fmt_rate(result.rate(s.step_seconds).tokens_per_second), escape(rate))
    tie = result.tie_note()
    if tie is not None:
        table.add_row("fastest found", fmt_seconds(result.fastest.step_seconds), escape(tie))
    if v is not None:
        table.add_row("full apply + verify + simulate", fmt_seconds(v.simulation.step_seconds),
                      f"quick model {100 * v.agreement:.3f}% apart")
    table.add_row("exposed communication", fmt_seconds(s.exposed_comm_seconds), "")
    table.add_row("lower bound on every config", fmt_seconds(result.lower_bound_seconds),
                  f"tuned {_pct(s.step_seconds, result.lower_bound_seconds)}: compute as traced vs the busiest "
                  "stream as few collectives as can be")
    table.add_row("bound of the tuned grouping", fmt_seconds(s.unhidable_bound_seconds),
                  f"tuned {_pct(s.step_seconds, s.unhidable_bound_seconds)}: with its copies and the unhidable "
                  "first AG / last RS")
    table.add_row("peak all-gathers in flight", fmt_bytes(s.peak_inflight_bytes),
                  f"budget {fmt_bytes(result.memory_budget)}" if result.memory_budget else "no memory budget")
    table.add_row("peak unsharded parameters", fmt_bytes(s.peak_unsharded_param_bytes), "")
    best = result.best_competitor
    if best is not None:
        table.add_row("best you could pick instead", fmt_seconds(best.step_seconds),
                      f"{escape(best.name)} (tuned {_pct(s.step_seconds, best.step_seconds)})")
    table.add_row("searched", f"{result.evaluated} candidates",
                  f"{result.arms} groupings, {result.seconds:.1f} s (profile {result.profile_seconds:.1f} s, "
                  f"competitors {result.competitor_seconds:.1f} s"
                  + (f", check {v.seconds:.1f} s)" if v is not None else ")"))
    return table


def _stalls(result: TuneResult) -> Table:
    table = Table(title=f"Where the tuned step still waits (quick model, {result.world_size} ranks)",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("graph", "waits on", "bucket", "at", "stall"):
        right = col in ("at", "stall")
        table.add_column(col, justify="right" if right else "left", no_wrap=col != "bucket",
                         overflow="fold", ratio=1 if col == "bucket" else None)
    for s in sorted(result.stalls, key=lambda s: -s.seconds)[:SHOWN_STALLS]:
        table.add_row(s.graph, "all-gather" if s.kind == "all_gather" else "reduce-scatter", escape(s.bucket),
                      fmt_seconds(s.at), fmt_seconds(s.seconds))
    return table


def tune_tables(result: TuneResult) -> Group:
    """Summary, top candidates, Pareto front, presets and remaining stalls, for ``Console.print``."""
    presets = tuple(sorted(result.presets, key=lambda c: c.step_seconds))
    at = f" ({result.hardware}, {result.world_size} ranks)"  # every table is for the size the search was made at
    parts = [_summary(result), _candidates("Top candidates within the budget" + at, result.top, result),
             _candidates("Pareto front: step time vs peak all-gathers in flight" + at, result.pareto, result),
             _candidates("Shipped presets on the same trace" + at, presets, result),
             _candidates("Strategies that schedule by their own rules (applied and simulated)" + at,
                         tuple(sorted(result.competitors, key=lambda c: c.step_seconds)), result)]
    if result.stalls:
        parts.append(_stalls(result))
    return Group(*parts)


def _winner_timeline(result: TuneResult, path: Path) -> Path:
    v = result.verification
    if v is None:
        raise OverlapStateError("TuneResult.timeline: the winner was not applied and simulated (tune(..., "
                                "verify=False)); tune with verify=True, or overlapcfg.explain(step, result.config, "
                                "hardware=...).timeline(path)")
    return write_run_timeline([(result.best.name, v.simulation)], path,
                              mesh={group: dim for dim, group in v.report.mesh},
                              title=f"tuned: {result.hardware}, world size {result.world_size}")


present(TuneResult, draw=tune_tables, plot=write_front_png, timeline=_winner_timeline)

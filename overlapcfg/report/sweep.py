"""The summary of a sweep (``overlapcfg -m ...``): one row per job, what it changed and what it is predicted to cost.

Each job prints its own full report; this table, printed once after the last job, is what compares them. The
command-line overrides every job shares go into the title, the ones that vary label the rows. Rendering only:
every number comes from the jobs' reports.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.markup import escape
from rich.table import Table

from overlapcfg.report.labels import fmt_bytes, fmt_seconds
from overlapcfg.report.model import Report

__all__ = ["split_overrides", "sweep_table"]

Job = tuple[Sequence[str], Report]
"""A job's command-line overrides (as Hydra lists them) and its report."""


def split_overrides(jobs: Sequence[Sequence[str]]) -> tuple[list[str], list[list[str]]]:
    """The overrides every job has (in first-seen order), and per job the ones that vary."""
    shared = [o for o in dict.fromkeys(o for job in jobs for o in job) if all(o in job for job in jobs)]
    return shared, [[o for o in job if o not in shared] for job in jobs]


def sweep_table(jobs: Sequence[Job], numbers: Sequence[int] | None = None) -> Table:
    """One row per job in sweep order; the fastest predicted step is highlighted (jobs without a prediction,
    such as ``sharding=fsdp2``, show ``—``). ``numbers``: the jobs' own numbers (Hydra's), where some jobs of the
    sweep are missing (failed); default 0, 1, ..."""
    shared, varying = split_overrides([overrides for overrides, _ in jobs])
    sizes = {(r.world_size, r.simulation.world_size if r.simulation else None) for _, r in jobs}
    title = f"sweep: {len(jobs)} jobs" + (f" (all with {' '.join(shared)})" if shared else "")
    if len(sizes) == 1:  # one world size for every row: the title says it; else each row does
        ((traced, predicted),) = sizes
        title += f", world size {traced}" if predicted in (None, traced) else \
            f", traced at world size {traced}, predicted at {predicted}"
    table = Table(title=escape(title), box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("job", justify="right", no_wrap=True)
    table.add_column("overrides")
    if len(sizes) > 1:
        table.add_column("world\nsize", justify="right", no_wrap=True)
    for col in ("buckets", "FSDP colls\nfw + bw", "step\ntime", "exposed\ncomm", "overlap", "peak in\nflight"):
        table.add_column(col, justify="right", no_wrap=True)
    steps = [r.simulation.step_seconds for _, r in jobs if r.simulation is not None]
    best = min(steps) if len(steps) > 1 else None
    for i, ((_, report), changed) in enumerate(zip(jobs, varying, strict=True)):
        sim = report.simulation
        collectives = " + ".join(f"{g.collectives_after}" for g in report.graphs) or "—"
        overlap = "—" if sim is None or sim.overlap_ratio is None else f"{100 * sim.overlap_ratio:.1f}%"
        style = "bold green" if sim is not None and sim.step_seconds == best else None
        number = numbers[i] if numbers is not None else i
        size = [_sizes(report)] if len(sizes) > 1 else []
        table.add_row(str(number), escape(" ".join(changed) or "(none)"), *size, str(len(report.buckets)), collectives,
                      fmt_seconds(sim.step_seconds if sim else None),
                      fmt_seconds(sim.exposed_comm_seconds if sim else None), overlap,
                      fmt_bytes(sim.peak_inflight_bytes if sim else None), style=style)
    return table


def _sizes(report: Report) -> str:
    """``2`` (traced, no prediction or predicted there), ``2→64`` (traced at 2, predicted at 64)."""
    predicted = report.simulation.world_size if report.simulation else report.world_size
    return str(report.world_size) if predicted == report.world_size else f"{report.world_size}→{predicted}"

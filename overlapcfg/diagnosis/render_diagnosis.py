"""How a ``DiagnoseResult`` is shown (registered with ``overlapcfg.results.present``): the tables
``overlapcfg mode=diagnose`` prints and ``print(result)`` shows (ranks that disagree first, then per rank and step,
per bucket, arrival skew, and the proposal with the changes it was chosen from), and ``result.timeline(path)``, the
pictured step of every rank drawn by the existing timeline renderer. Rendering only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from overlapcfg.cost.prediction import Event, Simulation
from overlapcfg.diagnosis.diagnosis_result import DiagnoseResult
from overlapcfg.diagnosis.steps import RankStep
from overlapcfg.errors import OverlapStateError
from overlapcfg.report.labels import KIND_LABELS, fmt_bytes
from overlapcfg.report.timeline import write_run_timeline
from overlapcfg.results import present

__all__ = ["diagnose_table", "step_runs"]

SHOWN_SKEWS = 5


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1e3:.2f}"


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    return table


def diagnose_table(r: DiagnoseResult) -> Group:
    parts: list[RenderableType] = []
    if r.divergence:
        lines = [Text("RANKS DISAGREE: they issued different collectives; this job would hang (or fail) on a real "
                      "cluster", style="bold red")]
        for d in r.divergence:
            lines.append(Text(f"  rank {d.rank} ({d.file}), collective #{d.position}"
                              f"{f' (step {d.step})' if d.step is not None else ''}: rank {d.reference} issued "
                              f"{d.expected}; rank {d.rank} issued {d.found}"))
        parts += lines
    parts.append(Text(f"{len(r.files)} traces, ranks {', '.join(map(str, r.ranks))} of "
                      f"{r.world_size if r.world_size is not None else '?'} ({r.device}"
                      f"{', ' + r.backend if r.backend else ''}), steps {', '.join(map(str, r.steps))}: step "
                      f"{_ms(r.measured_step_s)} ms ± {_ms(r.noise_s)}, exposed communication "
                      f"{_ms(r.exposed_s)} ms a step"))
    steps = _table("per rank and step (ms)", ["rank", "step", "step", "compute", "comm", "exposed", "idle",
                                               "collectives"])
    for s in r.rank_steps:
        steps.add_row(str(s.rank), str(s.step), _ms(s.step_s), _ms(s.compute_s), _ms(s.comm_s), _ms(s.exposed_s),
                      _ms(s.idle_s), str(s.collectives))
    parts.append(steps)
    buckets = _table(f"per bucket, per step (ms; {r.collectives} collectives, {r.unattributed} unattributed, "
                     f"{r.other} not FSDP's)",
                     ["bucket", "collectives", "bytes", "comm", "exposed", "overlapped", "peak memory", "from"])
    for b in r.buckets:
        buckets.add_row(escape(b.bucket), b.kinds, fmt_bytes(b.bytes), _ms(b.comm_s), _ms(b.exposed_s),
                        _ms(b.overlapped_s), fmt_bytes(b.peak_memory), b.source)
    parts.append(buckets)
    if r.skew:
        skew = _table("arrival skew: how long the first rank waited for the last (largest)",
                      ["collective", "step", "#", "skew ms", "last rank"])
        for k in r.skew[:SHOWN_SKEWS]:
            skew.add_row(f"{KIND_LABELS.get(k.kind, k.kind)}[{escape(k.bucket or '?')}]", str(k.step), str(k.index),
                         _ms(k.skew_s), str(k.last_rank))
        parts.append(skew)
        if r.slowest_rank is not None:
            parts.append(Text(f"slowest rank: {r.slowest_rank} (arrived last for the most time in total)"))
    if r.candidates:
        cands = _table(f"changes, replayed on the measured step (replay of the step as measured: "
                       f"{_ms(r.replayed_step_s)} ms)", ["change", "step ms", "gain ms", "extra memory", "note"])
        for c in r.candidates:
            note = c.reason or ("" if c.fits_budget else "over the memory budget")
            cands.add_row(escape(c.name), _ms(c.predicted_step_s), _ms(c.gain_s), fmt_bytes(c.extra_bytes),
                          escape(note))
        parts.append(cands)
    parts.append(Text(f"verdict: {r.verdict}", style="bold"))
    parts += [Text(f"note: {n}", style="dim") for n in r.notes]
    return Group(*parts)


def step_runs(steps: Sequence[RankStep], world_size: int) -> list[tuple[str, Simulation]]:
    """Measured steps as timeline runs (one per rank), in the simulator's event vocabulary."""
    return [(f"rank {s.rank} · step {s.step}", _simulation(s, world_size)) for s in steps]


def _simulation(step: RankStep, world_size: int) -> Simulation:
    """A measured step in the simulator's event vocabulary (times from the step's start)."""
    a = step.start
    events: list[Event] = [Event("step", "compute", "compute", "compute", (s - a) / 1e6, (e - a) / 1e6)
                           for s, e in step.compute_spans]
    for c in step.collectives:
        label = c.bucket or "unattributed"
        events.append(Event("step", f"{c.kind}#{c.index}", f"comm:{c.group or 0}", c.kind, (c.start - a) / 1e6,
                            (c.end - a) / 1e6, label, c.nbytes or 0))
        if c.end > c.need:
            events.append(Event("step", f"wait#{c.index}", "compute", "wait", (max(c.need, c.start) - a) / 1e6,
                                (c.end - a) / 1e6, label, waits_on=c.kind))
    return Simulation(hardware="measured", world_size=world_size, step_seconds=step.seconds,
                      compute_seconds=step.compute, comm_seconds=step.comm, exposed_comm_seconds=step.exposed,
                      overlap_ratio=max(0.0, 1 - step.exposed / step.comm) if step.comm else None,
                      lower_bound_seconds=max(step.compute, step.comm), peak_inflight_bytes=0,
                      peak_unsharded_param_bytes=0, peak_activation_bytes=None).with_events(tuple(events))


def _diagnose_timeline(r: DiagnoseResult, path: Path) -> Path:
    if not r.pictured:
        raise OverlapStateError("DiagnoseResult.timeline: this result has no measured step to draw (it was read "
                                "back from JSON); draw it where diagnose ran")
    runs = step_runs(r.pictured, r.world_size or len(r.ranks))
    return write_run_timeline(runs, path, title=f"measured step {r.pictured[0].step}: {len(runs)} ranks, exposed "
                                                "communication hatched, collectives labelled with their bucket")


present(DiagnoseResult, draw=diagnose_table, timeline=_diagnose_timeline)

"""The tables ``overlapcfg mode=diagnose`` prints and ``print(result)`` shows: ranks that disagree first, then per
rank and step, per bucket, arrival skew, and the proposal with the changes it was chosen from. Rendering only."""

from __future__ import annotations

import io

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from overlapcfg.diagnosis.result import DiagnoseResult, as_renderable, as_text
from overlapcfg.report.labels import KIND_LABELS, fmt_bytes

__all__ = ["diagnose_table", "render_text"]

SHOWN_SKEWS = 5


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1e3:.2f}"


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    return table


@as_renderable.register
def diagnose_table(r: DiagnoseResult) -> Group:
    parts: list[object] = []
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
    return Group(*parts)  # type: ignore[arg-type]


@as_text.register
def render_text(r: DiagnoseResult, width: int = 120) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(diagnose_table(r))
    return buf.getvalue()

"""Timelines of simulated steps: a Chrome trace (Perfetto) and a PNG Gantt chart (matplotlib, Agg backend).

One "process" per strategy, one "thread" per stream (``compute`` first, then ``comm:<group>``, named by mesh
dimension where the report knows the mesh: ``comm: dp_shard (group 3)``), so several strategies line up on the
same time axis. Stalls (the compute stream waiting on a collective) are events of their own on the compute
stream, and say which kind of collective they wait on (``wait AG[layers.0]``; in the PNG the collective's colour,
hatched): they are what a schedule should remove.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from overlapcfg.cost.prediction import Event, Simulation
from overlapcfg.cost.simulator import COMPUTE_STREAM
from overlapcfg.files import write_atomic
from overlapcfg.report.labels import KIND_LABELS
from overlapcfg.report.model import Comparison

__all__ = ["COLORS", "backward_start", "bar_label", "chrome_trace", "stream_label", "write_chrome_trace",
           "write_gantt_png", "write_run_timeline", "write_timeline"]

COLORS = {
    "compute": "#4C72B0",
    "memory": "#9DB4D8",
    "wait": "#D62728",
    "all_gather": "#FF9F1C",
    "reduce_scatter": "#2CA02C",
    "all_reduce": "#9467BD",
    "other": "#8C564B",
}
_LEGEND = {
    "compute": "compute (FLOP-bound)",
    "memory": "compute (memory-bound)",
    "wait": "stall: waiting on a collective",
    "wait:all_gather": "stall: waiting on an all-gather",
    "wait:reduce_scatter": "stall: waiting on a reduce-scatter",
    "wait:all_reduce": "stall: waiting on an all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "other": "other collective",
}
Run = tuple[str, Simulation]
_DPI = 110
_CHAR_PX = 6.4
"""Width of one character of a 7 pt bar label at ``_DPI`` (about 0.6 em), to judge whether a label fits."""
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+(?:[-–]\d+)?)(?=\.|$)")
"""A whole dotted numeric segment (``layers.12``, ``layers.0-3``), not digits inside a name (``w3``)."""


def _streams(sim: Simulation) -> list[str]:
    comm = sorted({e.stream for e in sim.events if e.stream != COMPUTE_STREAM})
    return [COMPUTE_STREAM, *comm]


def _name(e: Event) -> str:
    """``AG[layers.0]`` for a collective, ``wait AG[layers.0]`` for compute stalled on one, else the node."""
    if e.kind == "wait":
        return f"wait {KIND_LABELS.get(e.waits_on, 'COLL')}[{e.label or e.node}]"
    prefix = KIND_LABELS.get(e.kind)
    if prefix:
        return f"{prefix}[{e.label or e.node}]"
    return e.node


def _wait_key(e: Event) -> str:
    """How a bar is coloured and listed in the legend: a stall by the kind it waits on."""
    return f"wait:{e.waits_on}" if e.kind == "wait" and f"wait:{e.waits_on}" in _LEGEND else e.kind


def stream_label(stream: str, mesh: Mapping[str, str] | None = None) -> str:
    """``comm:3`` -> ``comm: dp_shard (group 3)`` where ``mesh`` (group name -> mesh dimension) names it."""
    group = stream.removeprefix("comm:")
    if mesh and stream != group and group in mesh:
        return f"comm: {mesh[group]} (group {group})"
    return stream


def chrome_trace(runs: Sequence[Run], mesh: Mapping[str, str] | None = None) -> dict[str, object]:
    """The Chrome trace-event JSON object (``traceEvents``, microseconds); ``mesh``: group name -> mesh dimension,
    to name the communication threads."""
    events: list[dict[str, object]] = []
    for pid, (name, sim) in enumerate(runs, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tids = {s: i for i, s in enumerate(_streams(sim))}
        for stream, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": stream_label(stream, mesh)}})
        start = backward_start(sim)
        if start is not None:  # a marker across the run's tracks where the backward graph begins
            events.append({"ph": "i", "s": "p", "name": "backward starts", "pid": pid, "tid": 0, "ts": start * 1e6})
        for e in sim.events:
            args: dict[str, object] = {"graph": e.graph, "node": e.node}
            if e.label:
                args["module"] = e.label
            if e.nbytes:
                args["bytes"] = e.nbytes
            if e.waits_on:
                args["waits_on"] = e.waits_on
            events.append({"ph": "X", "name": _name(e), "cat": e.kind, "pid": pid, "tid": tids[e.stream],
                           "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "overlapcfg.report.timeline",
                          "runs": [{"name": n, "hardware": s.hardware, "world_size": s.world_size,
                                    "step_seconds": s.step_seconds} for n, s in runs]}}


def write_chrome_trace(runs: Sequence[Run], path: str | Path, mesh: Mapping[str, str] | None = None) -> Path:
    return write_atomic(path, json.dumps(chrome_trace(runs, mesh)))


def _short(label: str) -> str:
    """A bucket label for a narrow bar: its layer index or range (``layers.12`` -> ``12``), else 3 letters."""
    found = _LAYER_INDEX.findall(label)
    return found[0] if found else label[:3]


def bar_label(label: str, width_px: float, *, prefix: str = "") -> str | None:
    """What fits on a bar ``width_px`` wide: ``prefix`` and the whole bucket name, else ``prefix`` and its layer
    index, else the prefix alone (a stall's ``AG``), else nothing."""
    tries = (prefix + label, prefix + _short(label), prefix.strip()) if prefix else (label, _short(label))
    return next((t for t in tries if t and len(t) * _CHAR_PX + 4 <= width_px), None)


def _bar_style(kind: str, stream: str) -> dict[str, Any]:
    """Colours of one kind of bar. A stall wears the colour of the collective it waits on, hatched in the stall
    red, so an all-gather stall and a reduce-scatter stall are told apart at a glance. White edges keep
    back-to-back collectives apart; compute kernels are too many and too thin for them."""
    if kind.startswith("wait:"):
        return {"facecolor": COLORS.get(kind.removeprefix("wait:"), "#777777"), "edgecolor": COLORS["wait"],
                "hatch": "////", "linewidth": 0.6}
    edge = {"edgecolor": "white", "linewidth": 0.4} if stream != COMPUTE_STREAM else {"edgecolor": "none"}
    return {"facecolor": COLORS.get(kind, "#777777"), **edge}


def backward_start(sim: Simulation) -> float | None:
    """When the step's backward graph starts (its first event), or None for a single graph."""
    return min((e.start for e in sim.events if e.graph == "backward"), default=None)


def write_gantt_png(runs: Sequence[Run], path: str | Path, *, title: str = "",
                    mesh: Mapping[str, str] | None = None) -> Path:
    """One lane per (strategy, stream); collectives and stalls labelled with their bucket (in full where the bar
    is wide enough, else its layer index), a stall drawn in the colour of the collective it waits on, hatched, and
    a dashed line where the backward graph starts. ``mesh``: group name -> mesh dimension, for lane names."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes: list[tuple[str, str, Simulation]] = [(n, s, sim) for n, sim in runs for s in _streams(sim)]
    horizon = max((sim.step_seconds for _, sim in runs), default=0.0) or 1.0
    scale, unit = (1e3, "ms") if horizon >= 1e-3 else (1e6, "µs")
    fig_h = 1.2 + 0.42 * len(lanes) + 0.25 * len(runs)
    fig, ax = plt.subplots(figsize=(16, max(3.0, fig_h)), dpi=_DPI)
    # Label widths are judged in pixels: the axes span about 85% of the figure over 1.02 x the horizon.
    px_per_unit = 16 * _DPI * 0.85 / (horizon * scale * 1.02)
    used: dict[str, None] = {}
    yticks, ylabels = [], []
    spans: dict[str, list[float]] = {}
    y = 0.0
    previous = None
    for name, stream, sim in reversed(lanes):
        if previous is not None and previous != name:
            y += 0.5  # a gap between strategies
        previous = name
        spans.setdefault(name, []).append(y)
        events = [e for e in sim.events if e.stream == stream]
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for e in events:
            by_kind.setdefault(_wait_key(e), []).append((e.start * scale, (e.end - e.start) * scale))
        for kind, bars in by_kind.items():
            used.setdefault(kind)
            ax.broken_barh(bars, (y - 0.38, 0.76), **_bar_style(kind, stream))
        for e in events:
            if stream == COMPUTE_STREAM and e.kind != "wait":
                continue  # compute kernels: too many to name; a stall names the bucket it waits for
            prefix = f"{KIND_LABELS.get(e.waits_on, '')} " if e.kind == "wait" else ""
            label = bar_label(e.label or e.node, (e.end - e.start) * scale * px_per_unit, prefix=prefix)
            if label is not None:
                ax.text((e.start + e.end) / 2 * scale, y, label, ha="center", va="center", fontsize=7,
                        clip_on=True, color="black")
        ax.plot([sim.step_seconds * scale] * 2, [y - 0.45, y + 0.45], color="black", linewidth=1.2)
        yticks.append(y)
        ylabels.append(f"{name} · {stream_label(stream, mesh)}")
        y += 1.0
    for name, sim in runs:
        start = backward_start(sim)
        if start is None:
            continue
        low, high = min(spans[name]) - 0.5, max(spans[name]) + 0.5
        ax.plot([start * scale] * 2, [low, high], color="black", linestyle="--", linewidth=0.9)
        ax.text(start * scale, high - 0.08, " backward →", ha="left", va="bottom", fontsize=7)
    ax.set_yticks(yticks, ylabels, fontsize=9)
    ax.set_xlabel(f"time ({unit}); black tick = predicted step end; dashed line = backward starts; "
                  "bars name their bucket (or its layer index)")
    ax.set_xlim(0, horizon * scale * 1.02)
    ax.set_ylim(-0.7, y - 0.3)
    ax.grid(axis="x", linestyle=":", alpha=0.5)
    ax.set_title(title or "simulated step timeline")
    ax.legend(handles=[Patch(label=_LEGEND.get(k, k), **_bar_style(k, "")) for k in _LEGEND if k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=min(6, len(used)) or 1, fontsize=9,
              frameon=False)
    fig.tight_layout()
    try:
        return write_atomic(path, fig.savefig)
    finally:
        plt.close(fig)


def write_run_timeline(runs: Sequence[Run], path: str | Path, *, title: str = "",
                       mesh: Mapping[str, str] | None = None) -> Path:
    """One timeline file of ``runs``, its format taken from the name: ``.json`` a Chrome trace, ``.png`` a Gantt
    chart (what ``Report.timeline`` and ``Comparison.timeline`` write, and the command through them)."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        return write_chrome_trace(runs, path, mesh)
    if path.suffix.lower() == ".png":
        return write_gantt_png(runs, path, title=title, mesh=mesh)
    raise AssertionError(f"overlapcfg: no timeline format for {path.name!r} (the caller checks .json / .png)")


def write_timeline(comparison: Comparison, directory: str | Path, *, stem: str = "timeline") -> tuple[Path, Path]:
    """Write ``<stem>.json`` (Chrome trace: open in https://ui.perfetto.dev) and ``<stem>.png`` (Gantt) of every
    row of ``comparison`` (``comparison.timeline(path)`` writes one of them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return comparison.timeline(directory / f"{stem}.json"), comparison.timeline(directory / f"{stem}.png")

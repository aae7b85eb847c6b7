"""Rich tables for a measurement (predicted vs measured, per config) and a calibrated profile. Rendering only.
Registered with ``overlapcfg.results.present`` at the end, so ``print(measurement)`` and ``print(profile)`` (what
``calibrate`` returns) show the tables the command prints."""

from __future__ import annotations

import statistics

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from overlapcfg.cost.hardware import HardwareProfile
from overlapcfg.cost.measured_fits import ROUGH_FIT
from overlapcfg.measuring.measure_result import CalibratedProfile, Measurement
from overlapcfg.report.labels import fmt_bytes, fmt_pct, fmt_rate, fmt_seconds
from overlapcfg.report.render import cost_sources_line
from overlapcfg.results import present

__all__ = ["calibration_table", "measurement_table"]


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def measurement_table(m: Measurement) -> Group:
    """Per config: predicted and measured step (with the spread), the error, exposed communication, both
    rankings; then the summary and where each prediction's numbers came from."""
    profiled = any(c.predicted_profiled_step_s is not None for c in m.configs)
    table = Table(title=f"predicted ({m.hardware.name}) vs measured: {m.backend} x {m.world_size} on {m.device}, "
                        f"median of {m.steps} steps", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    columns = ["config", "predicted\nms", "measured\nms", "±\nms", "error", "exposed\npred. ms",
               "exposed\nmeas. ms", "rank\npred.", "rank\nmeas.", "tok/s pred.\n/ meas.", "MFU pred.\n/ meas."]
    if profiled:
        columns[5:5] = ["profiled\nms", "error\nprofiled"]
        columns.append("rank\nprof.")
    for col in columns:
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    ranks = {key: {n: i + 1 for i, n in enumerate(m.ranking(key))}
             for key in ("predicted_step_s", "predicted_profiled_step_s", "measured_step_s")}
    for c in m.configs:
        row = [escape(c.name), _ms(c.predicted_step_s), _ms(c.measured_step_s), _ms(c.measured_spread_s / 2),
               _pct(c.error), _ms(c.predicted_exposed_s), _ms(c.measured_exposed_s),
               str(ranks["predicted_step_s"][c.name]), str(ranks["measured_step_s"][c.name]),
               f"{fmt_rate(c.predicted_tokens_per_second)} / {fmt_rate(c.measured_tokens_per_second)}",
               f"{fmt_pct(c.predicted_mfu, 2)} / {fmt_pct(c.measured_mfu, 2)}"]
        if profiled:
            row[5:5] = [_ms(c.predicted_profiled_step_s), _pct(c.profiled_error)]
            row.append(str(ranks["predicted_profiled_step_s"].get(c.name, "—")))
        table.add_row(*row)
    lines = [f"median |error|: {_pct(m.median_abs_error()).lstrip('+')} on {m.hardware.name}"
             + (f", {_pct(m.median_abs_error(profiled=True)).lstrip('+')} with measured node costs" if profiled
                else "")]
    cal = m.hardware.calibration
    if cal is not None and cal.rough_fits:
        lines.append(f"! {m.hardware.name} has rough fits, which every prediction on it inherits: "
                     f"{', '.join(cal.rough_fits)}")
    first = m.configs[0]
    lines.append(f"predicted ({first.name}) priced by {cost_sources_line(first.cost_sources)}")
    if profiled:
        lines.append(f"profiled ({first.name}) priced by "
                     f"{cost_sources_line(first.profiled_cost_sources, m.node_costs)}")
    ratios: dict[str, list[float]] = {}
    for c in m.configs:
        for k in c.collectives:
            if k.measured_s is not None and k.predicted_s > 0:
                ratios.setdefault(k.kind, []).append(k.measured_s / k.predicted_s)
    if ratios:
        each = ", ".join(f"{kind} x{statistics.median(r):.2f}" for kind, r in ratios.items())
        lines.append(f"collectives in the steps against the profile (median measured / predicted duration): {each}")
    uneven = [c for c in m.configs if c.uneven_exposed()]
    if uneven:
        each = ", ".join(f"{c.name} " + " / ".join(_ms(x) for x in c.measured_exposed_by_rank_s) + " ms"
                         for c in uneven)
        lines.append(f"! the ranks waited unequally (exposed communication of rank 0 / rank 1 / ...): {each}. The "
                     "rank that waits longer is mostly waiting for a slower one to issue its collectives (ranks "
                     "running at different speeds: a straggler, or another job on the same cores); the prediction "
                     "is for ranks at one speed, and the measured exposed column is the mean of the ranks.")
    walls = [c.measured_wall_s - c.measured_step_s for c in m.configs]
    lines.append(f"measured: time inside the compiled graphs (what is predicted); the step spends another "
                 f"{fmt_seconds(min(walls))}–{fmt_seconds(max(walls))} outside them (loss, optimizer, Python)"
                 + (f", {fmt_seconds(m.between_graphs_s)} of it between the forward and the backward graphs, across "
                    "which the ranks drift apart" if m.between_graphs_s else "") + ". "
                 "±: half the interquartile range of the steps. profiled: the prediction with measured node "
                 "durations. exposed: collective time the compute thread or stream waited for, "
                 + _exposed_in(m) + ".")
    return Group(table, *(Text(line, style="dim" if i else "bold") for i, line in enumerate(lines)))


def calibration_table(profile: HardwareProfile) -> Group:
    """The fitted numbers of a calibrated profile with their residuals, and what came from the datasheet."""
    cal = profile.calibration
    table = Table(title=f"calibrated profile {profile.name!r}", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False)
    for col in ("what", "link", "latency\n/ overhead", "bandwidth\n/ rate", "issue\n(caller)", "resid-\nual",
                "sizes"):
        table.add_column(col, justify="left" if col in ("what", "link") else "right", no_wrap=True)
    for link_name, link in (("intra", profile.collectives and profile.collectives.intra_node),
                            ("inter", profile.collectives and profile.collectives.inter_node)):
        if not link:
            continue
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            fit = getattr(link, kind)
            if fit is None:
                continue
            samples = [k for g in (cal.groups if cal else ()) for k in g.collectives
                       if k.kind == kind and g.inter_node == (link_name == "inter")]
            residual = max((k.residual for k in samples), default=0.0)
            sizes = (f"{fmt_bytes(min(min(k.sizes) for k in samples))}–{fmt_bytes(max(max(k.sizes) for k in samples))}"
                     if samples else "")
            issue = fmt_seconds(fit.issue_latency) + (f" + n/{fit.issue_bandwidth / 1e9:.1f}GB/s"
                                                      if fit.issue_bandwidth else "")
            table.add_row(kind, link_name, fmt_seconds(fit.latency) + " /step", f"{fit.bandwidth / 1e9:.2f} GB/s",
                          issue, _residual(residual), sizes)
    for sk in (cal.skew if cal else ()):
        fitted = profile.skew
        table.add_row(f"skew {escape(sk.group)}", f"{sk.ranks} ranks",
                      f"{fmt_seconds(fitted.absolute) if fitted else '—'} sd",
                      f"{100 * fitted.relative:.2f}% of compute, {1e3 * (fitted.diffusion ** 0.5):.2g} ms/s^0.5"
                      if fitted else "", "", _residual(sk.residual),
                      f"{len(sk.compute_seconds)} lengths")
        if fitted is not None and fitted.wake:
            last = fitted.wake[-1]
            table.add_row(f"wake-up {escape(sk.group)}", f"{sk.ranks} ranks", f"+{fmt_seconds(last.extra)}",
                          f"after {fmt_seconds(last.idle)} idle", "", "", f"{len(fitted.wake)} points")
    for k in (cal.kernels if cal else ()):
        unit = "GFLOP/s" if k.what.startswith("matmul") else "GB/s"
        table.add_row(k.what.split(" (")[0], "", fmt_seconds(k.overhead), f"{k.rate / 1e9:.1f} {unit}", "",
                      _residual(k.residual), f"{len(k.shapes)} kernels")
    attention = profile.achievable.attention if profile.achievable is not None and cal is not None else None
    for backend, points in (attention.backends.items() if attention is not None else ()):
        for p in points:
            table.add_row(f"attention {escape(backend)}", f"{p.seq_len} x {p.head_dim}", "",
                          f"{100 * p.forward:.0f}% / {100 * p.backward:.0f}% of peak", "", "", "fwd / bwd")
    for c in (cal.contention if cal else ()):
        fit = profile.contention_for(c.inter_node)
        if fit is None:
            continue
        table.add_row(f"contention {escape(c.group)}", "inter" if c.inter_node else "intra",
                      f"compute +{100 * fit.compute_slowdown:.0f}%", f"comm +{100 * fit.comm_slowdown:.0f}%", "",
                      _residual(c.residual), f"{len(c.compute_seconds)} runs, {fmt_bytes(c.collective_bytes)}")
        if c.start_delay_seconds and c.start_delay_bytes is not None:
            table.add_row(f"start delay {escape(c.group)}", "inter" if c.inter_node else "intra",
                          f"+{fmt_seconds(fit.start_delay)}", "under compute, on an idle link", "", "",
                          f"mean of {len(c.start_delay_seconds)} runs, {fmt_bytes(c.start_delay_bytes)}")
    notes = [Text(f"  • {n}", style="dim") for n in (cal.notes if cal else ())]
    if cal is not None and cal.rough_fits:
        notes.insert(0, Text(f"  ! rough: {', '.join(cal.rough_fits)}", style="bold yellow"))
    return Group(table, *notes)


def _residual(x: float) -> str:
    """A residual, in bold red when it makes the fit rough (``ROUGH_FIT``)."""
    text = f"{100 * x:.0f}%"
    return f"[bold red]{text}![/bold red]" if x > ROUGH_FIT else text


present(Measurement, draw=measurement_table)
present(CalibratedProfile, draw=calibration_table)


def _exposed_in(m: Measurement) -> str:
    """Where the exposed column was measured: one place for every config, or each place with its configs (a config
    whose waits could not be timed is measured in the profiled steps, the rest in the timed ones)."""
    where: dict[str, list[str]] = {}
    for c in m.configs:
        where.setdefault(c.measured_exposed_in, []).append(c.name)
    if len(where) <= 1:
        return f"in the {next(iter(where), 'profiled steps')}"
    return "; ".join(f"in the {place} for {', '.join(names)}" for place, names in where.items())

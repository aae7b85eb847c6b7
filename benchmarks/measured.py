"""Is the prediction right on this machine? Calibrate, tune on the calibrated profile, measure, compare.

On 2 gloo ranks of this machine (one thread each), with the demo at its command defaults (4 layers, dim 64,
vocabulary 8192, 8 x 128 tokens a step, reshard after forward):

1. ``overlapcfg.calibrate`` on the world group at the demo's matmul shapes (the profile is written to
   ``benchmarks/results/calibrated.yaml``, not to your profile directory);
2. ``overlapcfg.tune`` of the traced step on the calibrated profile;
3. ``overlapcfg.measure`` of the ``measure.configs`` of ``conf/overlapcfg.yaml`` (no pass; depths 0, 1, 2; two
   plans; torch's own ``torch_manual``) and the tuned config, on real steps;
4. predictions for the same graphs on the datasheet ``cpu_gloo`` profile, on the calibrated one, and on the
   calibrated one with the node durations measured on the ``none`` config (profile-guided).

Prints a table per config and the summary the issue asks for: median |predicted - measured| / measured per
profile, and whether the tuned config measures no slower than the best preset within the spread (the larger of
the two configs' interquartile ranges). The machine's load average before and after is printed and stored: other
processes on a 2-core machine move every number, so rerun when it was high.

    python benchmarks/measured.py [--quick] [--steps 10] [--budget 60]

Writes ``benchmarks/results/measured.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

import overlapcfg
from overlapcfg.config.presets import command_conf_dir
from overlapcfg.cost.hardware import HardwareProfile, save_hardware
from overlapcfg.cost.node_costs import NodeCosts
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.demo.job import compare_configs, demo_spec
from overlapcfg.measuring.calibration import profile_header
from overlapcfg.measuring.kernels import MatmulMix, matmul_mix
from overlapcfg.measuring.render import calibration_table

RESULTS = Path(__file__).resolve().parent / "results"


def _calibrate(rank: int, world_size: int, mix: MatmulMix, budget: float) -> dict[str, Any]:
    profile = overlapcfg.calibrate(step=mix, name="calibrated", base="cpu_gloo", budget_s=budget, save=False)
    return profile.model_dump(mode="json", exclude_none=True)


def _measure(rank: int, world_size: int, settings: dict[str, Any], configs: dict[str, dict[str, Any]],
             hardware: dict[str, Any], steps: int, warmup: int) -> tuple[dict[str, Any], dict[str, Any]]:
    from overlapcfg.demo.measure_job import demo_step
    from overlapcfg.demo.settings import demo_settings

    result = overlapcfg.measure(demo_step(demo_settings(settings)), configs,
                                hardware=HardwareProfile.model_validate(hardware), steps=steps, warmup=warmup,
                                profiled_steps=2)
    costs = result.measured_node_costs
    return result.to_dict(), costs.to_dict() if costs is not None else {}


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 timed steps, a 20 s calibration")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per config (default 10; quick 5)")
    parser.add_argument("--budget", type=float, default=None, help="calibration seconds (default 60; quick 20)")
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 10)
    budget = args.budget or (20.0 if args.quick else 60.0)
    console = Console(width=150)
    load_before = os.getloadavg()
    console.print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
                  f"({os.cpu_count()} cores)")
    started = time.perf_counter()

    with initialize_config_dir(config_dir=str(command_conf_dir()), version_base="1.3"):
        cfg = compose("overlapcfg")
    spec = demo_spec(cfg)
    names, presets = compare_configs(cfg, key="measure.configs")
    step = overlapcfg.trace_train_step(spec.llama_config(), world_size=2, reshard_after_forward=True,
                                       batch=spec.batch, seq_len=spec.seq_len)
    console.print(f"traced the demo ({spec.model.n_layers} layers, dim {spec.model.dim}, vocab "
                  f"{spec.model.vocab_size}, {spec.batch} x {spec.seq_len} tokens) in {step.trace_seconds:.1f} s")

    mix = matmul_mix([step.forward, step.backward])
    calibrated = HardwareProfile.model_validate(
        run_on_gloo(_calibrate, mix, budget, world_size=2, timeout_s=budget * 4 + 120)[0])
    RESULTS.mkdir(parents=True, exist_ok=True)
    save_hardware(calibrated, RESULTS / "calibrated.yaml", header=profile_header(calibrated))
    console.print(calibration_table(calibrated))

    tuned = overlapcfg.tune(step, hardware=calibrated, memory_budget=None)
    console.print(f"tuned on the calibrated profile: {tuned.best.name} ({tuned.evaluated} candidates, "
                  f"{tuned.seconds:.1f} s), predicted {tuned.best.step_seconds * 1e3:.1f} ms")
    configs = {n: c.model_dump(mode="json") for n, c in zip(names, presets, strict=True)}
    configs["tuned"] = tuned.config.model_dump(mode="json")
    settings = spec.model_dump(mode="json", include={"model", "batch", "seq_len", "reshard_after_forward"})
    measured_dict, costs_dict = run_on_gloo(_measure, settings, configs, calibrated.model_dump(mode="json"), steps,
                                            2 if args.quick else 3, world_size=2, timeout_s=1800)[0]
    measurement = overlapcfg.Measurement.from_json(measured_dict)
    costs = NodeCosts.from_json(costs_dict)
    load_after = os.getloadavg()

    rows = _predictions(step, configs, calibrated, costs, measurement)
    table = Table(title=f"predicted vs measured: gloo x 2, 1 thread a rank, median of {steps} steps "
                        f"(graph time; ± half the IQR)")
    for col in ("config", "measured ms", "±", "cpu_gloo ms", "error", "calibrated ms", "error",
                "calibrated + node costs ms", "error", "exposed meas.", "exposed calib."):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['measured'] * 1e3:.1f}", f"{r['spread'] * 5e2:.1f}",
                      f"{r['cpu_gloo'] * 1e3:.1f}", _pct(r["cpu_gloo_error"]), f"{r['calibrated'] * 1e3:.1f}",
                      _pct(r["calibrated_error"]), f"{r['profiled'] * 1e3:.1f}", _pct(r["profiled_error"]),
                      f"{r['measured_exposed'] * 1e3:.1f}", f"{r['calibrated_exposed'] * 1e3:.1f}")
    console.print(table)
    summary = _summary(rows)
    for key, value in summary.items():
        console.print(f"{key}: {value}")
    console.print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; "
                  f"total {time.perf_counter() - started:.0f} s")
    out = RESULTS / "measured.json"
    out.write_text(json.dumps({"schema": "overlapcfg.benchmark.measured/1", "load_before": load_before,
                               "load_after": load_after, "steps": steps, "calibration_budget_s": budget,
                               "tuned": {"name": tuned.best.name, "config": configs["tuned"]},
                               "summary": summary, "rows": rows, "measurement": measured_dict}, indent=2))
    console.print(f"wrote {out} and {RESULTS / 'calibrated.yaml'}")


def _predictions(step: Any, configs: dict[str, dict[str, Any]], calibrated: HardwareProfile, costs: NodeCosts,
                 measurement: Any) -> list[dict[str, Any]]:
    """Each config predicted on cpu_gloo, calibrated, and calibrated with measured node costs, from the traced
    graphs (the graphs the ranks ran: the same names and shapes), next to what was measured."""
    rows = []
    for name, cfg in configs.items():
        m = measurement.config(name)
        datasheet = overlapcfg.explain(step, cfg, hardware="cpu_gloo").simulation
        fitted = overlapcfg.explain(step, cfg, hardware=calibrated).simulation
        profiled = overlapcfg.explain(step, cfg, hardware=calibrated, node_costs=costs).simulation
        row = {"name": name, "measured": m.measured_step_s, "spread": m.measured_spread_s,
               "measured_exposed": m.measured_exposed_s, "measured_wall": m.measured_wall_s,
               "cpu_gloo": datasheet.step_seconds, "calibrated": fitted.step_seconds,
               "profiled": profiled.step_seconds, "calibrated_exposed": fitted.exposed_comm_seconds,
               "rank_prediction_on_rank0": m.predicted_step_s}
        for key in ("cpu_gloo", "calibrated", "profiled"):
            row[f"{key}_error"] = (row[key] - m.measured_step_s) / m.measured_step_s
        rows.append(row)
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    def median_abs(key: str) -> float:
        return statistics.median(abs(r[f"{key}_error"]) for r in rows)

    presets = [r for r in rows if r["name"] != "tuned"]
    best = min(presets, key=lambda r: r["measured"])
    tuned = next(r for r in rows if r["name"] == "tuned")
    slack = max(best["spread"], tuned["spread"])
    return {
        "median |error| cpu_gloo": f"{100 * median_abs('cpu_gloo'):.1f}%",
        "median |error| calibrated": f"{100 * median_abs('calibrated'):.1f}%",
        "median |error| calibrated + node costs": f"{100 * median_abs('profiled'):.1f}%",
        "best preset (measured)": f"{best['name']} {best['measured'] * 1e3:.1f} ms (±{best['spread'] * 5e2:.1f})",
        "tuned (measured)": f"{tuned['measured'] * 1e3:.1f} ms (±{tuned['spread'] * 5e2:.1f})",
        "tuned no slower than the best preset within the spread": tuned["measured"] <= best["measured"] + slack,
        "ranking measured": [r["name"] for r in sorted(rows, key=lambda r: r["measured"])],
        "ranking calibrated": [r["name"] for r in sorted(rows, key=lambda r: r["calibrated"])],
        "ranking cpu_gloo": [r["name"] for r in sorted(rows, key=lambda r: r["cpu_gloo"])],
    }


if __name__ == "__main__":
    main()

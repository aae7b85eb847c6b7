"""``overlapcfg.tune`` on a Llama-3-8B-shaped model against every config a user could pick instead.

The model is traced once on the meta device (fake tensors, no weights; as ``schedule_quality.py``), at fake world
size 2, and tuned for FSDP world sizes 8, 64, 128 and 512 on ``h100_nvlink`` and ``a100_ib``, tensors costed as
bf16, priced as a compiled torchtitan-like step runs (``--predict``, default: torchtitan's selective activation
checkpointing, inductor's fusion, AdamW with gradient clipping after the backward: ``overlapcfg.cost.pricing``).
Each search is the whole of ``tune``: profile (one real apply), grid, per-bucket refinement, the competitors' real
applies (``none``, ``auto``, ``auto`` + ``collective_bucketing``; made once and re-simulated per case), and the
winner's check by a real apply + verify + simulate.

The competitors are simulated here the same way, independently of the tuner: ``none``, torch's automatic
scheduler (``strategy: auto``) with and without ``collective_bucketing``, ``torch_manual`` (upstream's depth-1
pass on ``llama_layers``), the torchtitan-like default (``llama_layers`` + policy ``default``, what torchtitan's
graph trainer builds in code) and every shipped plan x policy preset that fits the model.

    python benchmarks/tune.py [--layers 32] [--budget none|4GiB] [--world-sizes 8 64 128 512] [--png]
                              [--predict activation_checkpointing=selective fusion=inductor ...]

Prints a rich table (with the tuned step's tokens/s per GPU and MFU) and writes benchmarks/results/tune.json (plus
tuned YAML per case, and the Pareto PNG with ``--png``). Targets (issue 36): tuned <= every competitor in every
case; the printed lower bound is never above any config printed; each search at least 2,000 candidates in at most
7 s on a quiet machine; the predicted MFU on h100_nvlink at 8 ranks within 30-40 %, on a100_ib within 45-60 %
(what public runs of this shape measure; checked, never fitted) for the schedule those runs used (torchtitan-like:
``PUBLIC_SCHEDULE``), with the tuned schedule's MFU printed beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from overlapcfg.config import load_config, preset_names
from overlapcfg.demo import LLAMA3_8B
from overlapcfg.demo.tracing import trace_train_step
from overlapcfg.errors import OverlapConfigError
from overlapcfg.report.compare import compare_reports
from overlapcfg.report.explain import explain
from overlapcfg.report.labels import fmt_bytes, fmt_change, fmt_pct, fmt_rate, fmt_seconds
from overlapcfg.tuning import tune
from overlapcfg.tuning.render_tune import write_front_png

RESULTS = Path(__file__).resolve().parent / "results"
HARDWARE = ("h100_nvlink", "a100_ib")
WORLD_SIZES = (8, 64, 128, 512)
PREDICT = {"activation_checkpointing": "selective", "fusion": "inductor", "optimizer": "adamw", "grad_clip": True}
"""What the benchmark prices besides the hardware: a compiled torchtitan-like training step."""
COMPETITORS: dict[str, dict[str, Any]] = {
    "none": {"strategy": "none"},
    "auto": {"strategy": "auto", "policy": "auto"},
    "auto + bucketing": {"strategy": "auto", "policy": {"collective_bucketing": True}},
    "torch_manual": {"strategy": "torch_manual", "plan": "llama_layers", "policy": {}},
    "torchtitan-like": {"plan": "llama_layers", "policy": "default"},
}
"""Named competitors (the table's columns); every shipped preset is added as ``preset <plan> / <policy>``."""
PUBLIC_SCHEDULE = "torchtitan-like"
"""The schedule the public runs this benchmark is checked against ran (torchtitan's FSDP defaults: one bucket per
block, prefetch 1): the MFU check compares that schedule's prediction with them, like with like. The tuned step's MFU
is printed beside it; no public run used the tuned schedule, so nothing measured checks it."""


def _presets() -> dict[str, dict[str, Any]]:
    out = {}
    for plan in preset_names("plan"):
        for policy in preset_names("policy"):
            try:
                cfg = load_config({"plan": plan, "policy": policy})
            except OverlapConfigError:
                continue
            if cfg.strategy == "manual":
                out[f"preset {plan} / {policy}"] = {"plan": plan, "policy": policy}
    return out


def _explained(step: Any, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each config applied once (what it does to the graph does not depend on the predicted machine)."""
    out = {}
    for name, cfg in configs.items():
        try:
            out[name] = explain(step, cfg)
        except OverlapConfigError:  # a preset whose plan does not fit the model (torchtitan_layers: lm_head)
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA3_8B.n_layers)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--budget", default="none", help="peak all-gathers in flight (bf16 bytes); 'none': no budget")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--png", action="store_true", help="also write the Pareto front of each case")
    parser.add_argument("--out", type=Path, default=RESULTS / "tune.json")
    parser.add_argument("--predict", nargs="*", default=[], metavar="KEY=VALUE",
                        help="prediction settings over the defaults (overlapcfg.cost.pricing.Pricing)")
    args = parser.parse_args()
    predict = {**PREDICT, **dict(_setting(kv) for kv in args.predict)}
    console = Console(width=220)
    budget = None if args.budget.lower() == "none" else args.budget
    model = dataclasses.replace(LLAMA3_8B, n_layers=args.layers)

    started = time.perf_counter()
    step = trace_train_step(model, device="meta", reshard_after_forward=True, batch=1, seq_len=args.seq_len)
    trace_s = time.perf_counter() - started
    console.print(f"traced {args.layers}-layer Llama-3-8B shape on meta in {trace_s:.1f} s")
    started = time.perf_counter()
    explained = _explained(step, {**COMPETITORS, **_presets()})
    console.print(f"applied {len(explained)} competitor configs in {time.perf_counter() - started:.1f} s")

    table = Table(title=f"overlapcfg tune vs every config a user could pick: Llama-3-8B shape ({args.layers} layers), "
                        f"1 x {args.seq_len} tokens, bf16, budget {budget or 'none'} in flight; priced "
                        + ", ".join(f"{k} {v}" for k, v in predict.items()))
    columns = ["hardware", "ranks", "tuned", "tok/s/GPU", "MFU", *COMPETITORS, "best preset", "tuned ≤ all (margin)",
               "lower bound", "tuned vs bound", "bound ≤ all", "candidates", "search"]
    for col in columns:
        table.add_column(col, justify="left" if col == "hardware" else "right")
    chosen = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for hw in HARDWARE:
        for ws in args.world_sizes:
            r = tune(step, hardware=hw, world_size=ws, memory_budget=budget, as_dtype=torch.bfloat16,
                     pricing=predict)
            tuned = r.verification.simulation.step_seconds if r.verification is not None else r.score.step_seconds
            rate = r.rate(tuned)
            rows = compare_reports(step, list(explained.values()), hardware=hw, names=list(explained), world_size=ws,
                                   as_dtype=torch.bfloat16, pricing=predict).rows
            sims = {row.name: row.simulation for row in rows}
            fits = {n: s for n, s in sims.items()
                    if budget is None or s.peak_inflight_bytes <= _bytes(budget)}
            presets = {n: s for n, s in fits.items() if n.startswith("preset ")}
            best_name = min(presets, key=lambda n: presets[n].step_seconds) if presets else None
            worst_margin = min((s.step_seconds - tuned) / s.step_seconds for s in fits.values())
            bound = getattr(r, "lower_bound_seconds", None) or r.score.lower_bound_seconds
            printed = [tuned, r.score.step_seconds, *(s.step_seconds for s in sims.values()),
                       *(c.step_seconds for c in r.candidates)]
            bound_ok = all(bound <= p * (1 + 1e-9) for p in printed)
            cells = [(fmt_seconds(sims[n].step_seconds) + (f" ({fmt_pct(sims[n].mfu)} MFU)"
                                                           if n == PUBLIC_SCHEDULE and sims[n].mfu else ""))
                     if n in sims else "—" for n in COMPETITORS]
            table.add_row(hw, str(ws), fmt_seconds(tuned), fmt_rate(rate.tokens_per_second), fmt_pct(rate.mfu), *cells,
                          fmt_seconds(presets[best_name].step_seconds) if best_name else "—",
                          ("yes" if worst_margin >= -1e-9 else "[red]no[/red]") + f" ({100 * worst_margin:+.2f}%)",
                          fmt_seconds(bound), fmt_change(tuned, bound), "yes" if bound_ok else "[red]no[/red]",
                          str(r.evaluated), f"{r.seconds:.1f} s (competitors {r.competitor_seconds:.1f} s)")
            chosen.append(f"{hw} x {ws}: tuned = {r.best.name}; best preset = "
                          f"{best_name.removeprefix('preset ') if best_name else '—'}")
            (args.out.parent / f"tuned_{hw}_{ws}.yaml").write_text(r.to_yaml())
            if args.png:
                write_front_png(r, args.out.parent / f"tune_front_{hw}_{ws}.png")
            sim = r.verification.simulation if r.verification is not None else None
            results.append({"hardware": hw, "world_size": ws, "tuned_seconds": tuned, "tuned_name": r.best.name,
                            "tokens_per_second_per_gpu": rate.tokens_per_second, "mfu": rate.mfu,
                            "graph_mfu": sim.graph_mfu if sim is not None else None,
                            "compute_parts": {p.part: p.seconds for p in sim.compute_parts} if sim else None,
                            "exposed_comm_seconds": sim.exposed_comm_seconds if sim else None,
                            "recompute": sim.recompute if sim else None,
                            "tuned_config": r.config.model_dump(mode="json"),
                            "quick_seconds": r.score.step_seconds, "lower_bound_seconds": bound,
                            "bound_below_everything_printed": bound_ok,
                            "tuned_no_slower_than_every_competitor": worst_margin >= -1e-9,
                            "smallest_margin": worst_margin, "candidates": r.evaluated, "search_seconds": r.seconds,
                            "competitor_seconds": r.competitor_seconds,
                            "peak_inflight_bytes": r.score.peak_inflight_bytes,
                            "competitors": {n: {"step_seconds": s.step_seconds, "mfu": s.mfu,
                                                "exposed_comm_seconds": s.exposed_comm_seconds,
                                                "compute_seconds": s.compute_seconds,
                                                "peak_inflight_bytes": s.peak_inflight_bytes}
                                            for n, s in sims.items()}})
            console.print(f"  {hw} x {ws}: tuned {fmt_seconds(tuned)}, {r.rate_text(tuned)} ({r.best.name}; "
                          f"{r.evaluated} candidates, "
                          f"{r.seconds:.1f} s, in flight {fmt_bytes(r.score.peak_inflight_bytes)}); smallest margin "
                          f"over a competitor {100 * worst_margin:+.2f}%")
        table.add_section()
    console.print(table)
    for line in chosen:
        console.print(f"  {line}")
    met = all(x["tuned_no_slower_than_every_competitor"] and x["bound_below_everything_printed"] for x in results)
    console.print(f"target (tuned <= every competitor, bound <= everything printed, every case): "
                  f"{'met' if met else 'NOT met'}")
    speed = all(x["candidates"] >= 2000 and x["search_seconds"] <= 7.0 for x in results)
    console.print(f"target (>= 2,000 candidates in <= 7 s, every case; time it on a quiet machine): "
                  f"{'met' if speed else 'NOT met'} (load average now {os.getloadavg()[0]:.1f})")
    ours = sum(x["search_seconds"] - x["competitor_seconds"] <= 7.0 for x in results)
    console.print(f"  the search less its competitors (torch's own auto pass, applied once per step, the first case "
                  f"pays it): <= 7 s in {ours} of {len(results)} cases; with them in "
                  f"{sum(x['search_seconds'] <= 7.0 for x in results)} of {len(results)}")
    ranges = {"h100_nvlink": (0.30, 0.40), "a100_ib": (0.45, 0.60)}
    for x in results:
        low, high = ranges.get(x["hardware"], (0.0, 1.0))
        like = x["competitors"].get(PUBLIC_SCHEDULE, {}).get("mfu")
        if x["world_size"] == 8 and like is not None:
            inside = low <= like <= high
            console.print(f"check (public runs of this shape: {100 * low:.0f}-{100 * high:.0f} % MFU, on the schedule "
                          f"they ran, {PUBLIC_SCHEDULE}): {x['hardware']} x 8 predicts {100 * like:.1f} % "
                          f"({'inside' if inside else 'OUTSIDE'}); the tuned schedule {100 * x['mfu']:.1f} % "
                          "(one no public run used: the tuner's own prediction)")
    args.out.write_text(json.dumps({"schema": "overlapcfg.benchmark.tune/3", "model": dataclasses.asdict(model),
                                    "seq_len": args.seq_len, "budget": budget, "trace_seconds": trace_s,
                                    "predict": predict, "load_average": os.getloadavg(),
                                    "target_met": met, "results": results}, indent=2))
    console.print(f"wrote {args.out}")


def _setting(text: str) -> tuple[str, Any]:
    """``key=value`` of ``--predict``, the value read as YAML (``true``, ``8192``, ``selective``)."""
    import yaml

    key, _, value = text.partition("=")
    return key, yaml.safe_load(value)


def _bytes(budget: str) -> int:
    from overlapcfg.config.base import ByteCount
    from overlapcfg.config.load import validate_value

    return int(validate_value(ByteCount, budget, path="budget"))


if __name__ == "__main__":
    main()

"""``overlapcfg.tune`` on a Llama-3-8B-shaped model: tuned vs the best preset vs ``torch_manual`` vs the bounds.

The model is traced once on the meta device (fake tensors, no weights; as ``schedule_quality.py``), at fake world
size 2, and tuned for FSDP world sizes 8 and 64 on ``h100_nvlink`` and ``a100_ib``, tensors costed as bf16. Each
search is the whole of ``tune``: profile (one real apply), grid, per-bucket refinement, and the winner's check by
a real apply + verify + simulate.

    python benchmarks/tune.py [--layers 32] [--budget 4GiB] [--png]

Prints a rich table and writes benchmarks/results/tune.json (plus tuned YAML per case, and the Pareto PNG with
``--png``). Targets (benchmark, not test): tuned within 3 % of max(compute, comm) at 64 ranks on both profiles,
never worse than torch_manual; each 32-layer search under 60 s with at least 200 candidates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from overlapcfg.demo import LLAMA3_8B
from overlapcfg.demo.tracing import trace_train_step
from overlapcfg.report.labels import fmt_bytes, fmt_change, fmt_seconds
from overlapcfg.tuning import tune
from overlapcfg.tuning.render import write_front_png

RESULTS = Path(__file__).resolve().parent / "results"
HARDWARE = ("h100_nvlink", "a100_ib")
WORLD_SIZES = (8, 64)


def _pct(value: float, base: float) -> str:
    return fmt_change(value, base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA3_8B.n_layers)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--budget", default="4GiB", help="peak all-gathers in flight (bf16 bytes); 'none': no budget")
    parser.add_argument("--png", action="store_true", help="also write the Pareto front of each case")
    args = parser.parse_args()
    console = Console(width=200)
    budget = None if args.budget.lower() == "none" else args.budget
    model = dataclasses.replace(LLAMA3_8B, n_layers=args.layers)

    started = time.perf_counter()
    step = trace_train_step(model, device="meta", reshard_after_forward=True, batch=1, seq_len=args.seq_len)
    trace_s = time.perf_counter() - started
    console.print(f"traced {args.layers}-layer Llama-3-8B shape on meta in {trace_s:.1f} s")

    table = Table(title=f"overlapcfg tune: Llama-3-8B shape ({args.layers} layers), 1 x {args.seq_len} tokens, bf16, "
                        f"budget {budget or 'none'} in flight")
    for col in ("hardware", "ranks", "tuned", "full check", "best preset", "torch_manual", "max(comp, comm)",
                "tuned vs it", "+ unhidable", "tuned vs it", "in flight", "candidates", "per s", "search"):
        table.add_column(col, justify="left" if col in ("hardware", "best preset") else "right")
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = []
    for hw in HARDWARE:
        for ws in WORLD_SIZES:
            r = tune(step, hardware=hw, world_size=ws, memory_budget=budget, as_dtype=torch.bfloat16)
            s, v = r.score, r.verification
            best = r.best_preset
            manual = next(p for p in r.presets if p.name == "torch_manual llama_layers")
            search_s = r.seconds - r.profile_seconds - (v.seconds if v is not None else 0.0)
            table.add_row(hw, str(ws), fmt_seconds(s.step_seconds),
                          fmt_seconds(v.simulation.step_seconds) if v else "—",
                          f"{best.name} {fmt_seconds(best.step_seconds)}" if best else "—",
                          fmt_seconds(manual.step_seconds), fmt_seconds(s.lower_bound_seconds),
                          _pct(s.step_seconds, s.lower_bound_seconds), fmt_seconds(s.unhidable_bound_seconds),
                          _pct(s.step_seconds, s.unhidable_bound_seconds), fmt_bytes(s.peak_inflight_bytes),
                          str(r.evaluated), f"{r.evaluated / search_s:.0f}", f"{r.seconds:.1f} s")
            (RESULTS / f"tuned_{hw}_{ws}.yaml").write_text(r.to_yaml())
            if args.png:
                write_front_png(r, RESULTS / f"tune_front_{hw}_{ws}.png")
            results.append({"hardware": hw, "world_size": ws, "tuned": r.to_dict(), "search_seconds": search_s,
                            "torch_manual_seconds": manual.step_seconds,
                            "best_preset": None if best is None else {"name": best.name,
                                                                      "step_seconds": best.step_seconds}})
            console.print(f"  {hw} x {ws}: {r.best.name}: {fmt_seconds(s.step_seconds)} ({r.evaluated} candidates, "
                          f"{r.seconds:.1f} s: profile {r.profile_seconds:.1f} s, search {search_s:.1f} s, check "
                          f"{v.seconds if v else 0.0:.1f} s)")
        table.add_section()
    console.print(table)
    out = RESULTS / "tune.json"
    out.write_text(json.dumps({"schema": "overlapcfg.benchmark.tune/1", "model": dataclasses.asdict(model),
                               "seq_len": args.seq_len, "budget": budget, "trace_seconds": trace_s,
                               "results": results}, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()

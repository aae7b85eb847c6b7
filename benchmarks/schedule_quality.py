"""Schedule quality on a Llama-3-8B-shaped model: predicted step time and exposed communication per plan/policy.

The model is built on the meta device and traced with fake tensors (no weights are allocated), once, at fake world
size 2; every prediction re-sizes the collectives for FSDP world sizes 8 and 64 (the all-gather output is the
unsharded size whatever the traced world size). Tensors are costed as bf16 by default (mixed-precision training
from the fp32 trace; ``--dtype fp32`` costs them as traced). Local batch 1 x 8192 tokens, as torchtitan's Llama 3
8B recipe.

    python benchmarks/schedule_quality.py [--layers 32] [--seq-len 8192] [--timeline] [--no-hsdp]

An HSDP section follows: the same shape traced on a 2 x 2 (dp_replicate x dp_shard) mesh and predicted for 8 nodes
x 8 GPUs (shard 8 inside a node, replicate 8 across nodes), with and without bucketing the gradient all-reduces
(``torch_manual`` leaves them, one per parameter, as upstream does; ``manual`` buckets them per bucket).

Prints a rich table and writes benchmarks/results/schedule_quality.json (plus a timeline with ``--timeline``).
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

from overlapcfg.cost.simulator import GroupPlacement
from overlapcfg.demo import LLAMA3_8B
from overlapcfg.demo.dims import ParallelDims
from overlapcfg.demo.tracing import trace_train_step
from overlapcfg.report.compare import compare_reports
from overlapcfg.report.explain import explain
from overlapcfg.report.labels import fmt_bytes, fmt_seconds
from overlapcfg.report.timeline import write_timeline

RESULTS = Path(__file__).resolve().parent / "results"
HARDWARE = ("h100_nvlink", "a100_ib")
WORLD_SIZES = (8, 64)
CAP = "3GiB"
"""Traced (fp32) bytes: two 8B layers (2 x 0.87 GB) fit, three do not; the embedding (2.1 GB) plus a layer fits."""


def configs() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("none", {"strategy": "none"}),
                                   ("torch_manual", {"strategy": "torch_manual", "plan": "llama_layers"})]
    for k in (1, 2, 3):
        out.append((f"manual depth {k}", {"plan": "llama_layers", "policy": {
            "forward_prefetch": k, "backward_prefetch": k, "reduce_scatter_delay": 1}}))
    out.append((f"manual depth 3, cap {CAP}", {"plan": "llama_layers", "policy": {
        "forward_prefetch": 3, "backward_prefetch": 3, "reduce_scatter_delay": 1, "max_inflight_bytes": CAP}}))
    return out


HSDP_NODES, HSDP_GPUS = 8, 8


def hsdp_configs() -> list[tuple[str, dict]]:
    d1 = {"forward_prefetch": 1, "backward_prefetch": 1, "reduce_scatter_delay": 1}
    return [("none", {"strategy": "none"}),
            ("torch_manual (all-reduces unbucketed)", {"strategy": "torch_manual", "plan": "llama_layers"}),
            ("manual depth 1, all_reduce_delay 0", {"plan": "llama_layers", "policy": {**d1, "all_reduce_delay": 0}}),
            ("manual depth 1, all_reduce_delay 1", {"plan": "llama_layers", "policy": d1}),
            ("manual depth 2, all_reduce_delay 2", {"plan": "llama_layers", "policy": {
                "forward_prefetch": 2, "backward_prefetch": 2, "reduce_scatter_delay": 2}})]


def hsdp_section(model: object, args: argparse.Namespace, as_dtype: torch.dtype | None,
                 console: Console) -> list[dict]:
    """HSDP at 8 nodes x 8 GPUs: one prediction per hardware profile and config; returns the JSON rows."""
    started = time.perf_counter()
    step = trace_train_step(model, device="meta", reshard_after_forward=True, batch=args.batch, seq_len=args.seq_len,
                            parallel=ParallelDims(dp_replicate=2, dp_shard=2))
    console.print(f"traced the HSDP (2 x 2) step in {time.perf_counter() - started:.1f} s")
    shard, replicate = step.group_of("dp_shard"), step.group_of("dp_replicate")
    groups = {shard: GroupPlacement(HSDP_GPUS, inter_node=False),
              replicate: GroupPlacement(HSDP_NODES, inter_node=True)}
    names, reports = [], []
    for name, cfg in hsdp_configs():
        reports.append(explain(step, cfg))
        names.append(name)
    table = Table(title=f"HSDP, {HSDP_NODES} nodes x {HSDP_GPUS} GPUs (shard {HSDP_GPUS} inside a node, replicate "
                        f"{HSDP_NODES} across nodes), predicted per step")
    for col in ("hardware", "config", "step", "lower bound", "exposed comm", "replicate-group busy",
                "shard-group busy", "all-reduces", "peak AG in flight"):
        table.add_column(col, justify="left" if col in ("hardware", "config") else "right")
    rows = []
    for hw in HARDWARE:
        comparison = compare_reports(step, reports, hardware=hw, names=names, world_size=HSDP_NODES * HSDP_GPUS,
                                     as_dtype=as_dtype, groups=groups)
        for row in comparison.rows:
            s = row.simulation
            busy = {t.stream: t.busy_seconds for t in s.streams}
            ars = sum(1 for n in row.report.backward.graph.nodes
                      if n.op == "call_function" and "all_reduce" in str(n.target))
            table.add_row(hw, row.name, fmt_seconds(s.step_seconds), fmt_seconds(s.lower_bound_seconds),
                          fmt_seconds(s.exposed_comm_seconds), fmt_seconds(busy.get(f"comm:{replicate}", 0.0)),
                          fmt_seconds(busy.get(f"comm:{shard}", 0.0)), str(ars), fmt_bytes(s.peak_inflight_bytes))
            rows.append({"hardware": hw, "nodes": HSDP_NODES, "gpus_per_node": HSDP_GPUS, "all_reduces": ars,
                         **row.to_dict()})
        table.add_section()
    console.print(table)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA3_8B.n_layers)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--timeline", action="store_true", help="also write a timeline (h100_nvlink, 64 ranks)")
    parser.add_argument("--no-hsdp", action="store_true", help="skip the HSDP section")
    args = parser.parse_args()
    console = Console(width=170)
    model = dataclasses.replace(LLAMA3_8B, n_layers=args.layers)
    as_dtype = torch.bfloat16 if args.dtype == "bf16" else None

    started = time.perf_counter()
    step = trace_train_step(model, device="meta", reshard_after_forward=True, batch=args.batch,
                            seq_len=args.seq_len)
    trace_s = time.perf_counter() - started
    console.print(f"traced {args.layers}-layer Llama-3-8B shape on meta in {trace_s:.1f} s: "
                  f"{len(step.forward.graph.nodes)} forward / {len(step.backward.graph.nodes)} backward nodes")

    names, reports, pass_s = [], [], {}
    for name, cfg in configs():
        t0 = time.perf_counter()
        reports.append(explain(step, cfg))
        names.append(name)
        pass_s[name] = time.perf_counter() - t0
        console.print(f"  {name}: explain {pass_s[name]:.1f} s")

    table = Table(title=f"Llama-3-8B shape ({args.layers} layers), batch {args.batch} x {args.seq_len} tokens, "
                        f"{args.dtype}, predicted per step")
    for col in ("hardware", "ranks", "config", "step", "lower bound", "exposed comm", "overlap", "compute",
                "comm", "peak AG in flight", "peak unsharded"):
        table.add_column(col, justify="left" if col in ("hardware", "config") else "right")
    results = []
    for hw in HARDWARE:
        for ws in WORLD_SIZES:
            comparison = compare_reports(step, reports, hardware=hw, names=names, world_size=ws, as_dtype=as_dtype)
            for row in comparison.rows:
                s = row.simulation
                table.add_row(hw, str(ws), row.name, fmt_seconds(s.step_seconds), fmt_seconds(s.lower_bound_seconds),
                              fmt_seconds(s.exposed_comm_seconds),
                              "—" if s.overlap_ratio is None else f"{100 * s.overlap_ratio:.1f}%",
                              fmt_seconds(s.compute_seconds), fmt_seconds(s.comm_seconds),
                              fmt_bytes(s.peak_inflight_bytes), fmt_bytes(s.peak_unsharded_param_bytes))
                results.append({"hardware": hw, "world_size": ws, **row.to_dict(),
                                "explain_seconds": pass_s[row.name]})
            table.add_section()
            if args.timeline and hw == "h100_nvlink" and ws == 64:
                RESULTS.mkdir(parents=True, exist_ok=True)
                paths = write_timeline(comparison, RESULTS, stem="schedule_quality_timeline")
                console.print(f"timeline: {', '.join(map(str, paths))}")
    console.print(table)
    hsdp = [] if args.no_hsdp else hsdp_section(model, args, as_dtype, console)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "schedule_quality.json"
    out.write_text(json.dumps({"schema": "overlapcfg.benchmark.schedule_quality/2", "model": dataclasses.asdict(model),
                               "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype,
                               "trace_seconds": trace_s, "results": results, "hsdp": hsdp}, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()

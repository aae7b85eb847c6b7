"""One GPU check, in one shot: does the pass hold on a GPU, and what does it cost there?

Three parts, each a table and a section of the JSON:

1. **One rank, a real group** (NCCL on CUDA, gloo on CPU; world size 1, so the collectives are real calls that
   move data into the gathered buffers): the demo Llama, SimpleFSDP-sharded (``overlapcfg.shard_module``), compiled
   with ``overlapcfg.backend(cfg, compiler=...)`` for strategy ``none``, depth 1 (``llama_layers`` at the
   ``default`` depths) and depth 2 (the ``aggressive`` depths), both with ``insert_overlap_deps`` as inductor
   wants it. Each config trains ``--steps`` SGD steps from the same weights on the same batch; the losses of every
   step and the gradients of the last must be **bitwise equal** to ``none``'s. Per config: compile time (the first
   step less a steady one), the pass's seconds (its ``PassRecord``, forward + backward) and share of that, the
   median step, and on CUDA the peak memory. A second ``none`` compile is the control (it must equal the first);
   deterministic algorithms are on (warn-only) unless ``--nondeterministic``.
2. **Eight ranks, a fake group, an 8B-shaped step, compiled and not run**: a Llama-3-8B-shaped 2-layer model
   (``LLAMA3_8B`` dims), sharded for 8 ranks, captured under a fake process group of 8 (the capture runs the step
   once with communication-free collectives), traced with inductor's decompositions; ``--fake-config`` applied to
   copies of its graphs and each lowered by inductor from the graphs' fake inputs
   (``compat.compile_fx_from_fake_inputs``): kernels generated and compiled for the device, nothing run with them.
3. **Calibrate** on this device (``overlapcfg.calibrate`` at world size 1: no collective to time, so the memory
   bandwidth and the matmul rate at part 1's matmul shapes and dtype, on top of ``h100_nvlink`` on CUDA and
   ``cpu_gloo`` on CPU).

On a GPU (the default sizes, about 2-3 minutes on an H100/H200; the target is under 5)::

    python benchmarks/gpu_check.py

On CPU, small sizes (what the test suite runs: ``tests/benchmarks/test_gpu_check.py``)::

    python benchmarks/gpu_check.py --device cpu --small

Compiler: inductor on CUDA; on CPU the backend's ``eager`` compiler for part 1 (the same transformed graphs run as
they are, which is what bitwise parity is about; inductor's C++ build of three configs takes minutes on a small
CPU machine: ``--compiler inductor`` runs it anyway) and inductor for CPU in part 2 (the lowering is the point of
that part). Without a GPU, inductor cannot lower for CUDA at all, not even the fake-group graphs: it reads the
device's properties and the CUDA RNG state ("Found no NVIDIA driver"). Exit status 1 when a config is not bitwise
equal to ``none`` or a part failed (its error is in the table and the JSON).

Writes ``benchmarks/results/gpu_check.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Compile cold, every run: a warm on-disk cache from an earlier run would make compile times meaningless. Set before
# torch is imported (inductor reads it then); a directory the caller chose is kept. cuBLAS needs its workspace fixed
# before CUDA starts for deterministic algorithms (``--nondeterministic`` leaves them off).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="overlapcfg-gpu-check-inductor-"))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import overlapcfg
from overlapcfg import compat
from overlapcfg.capture import shard_module
from overlapcfg.demo import LLAMA3_8B, Llama, LlamaConfig, cross_entropy_loss
from overlapcfg.demo.tracing import demo_batch
from overlapcfg.measuring.kernels import matmul_mix
from overlapcfg.measuring.render_measure import calibration_table
from overlapcfg.passes import apply_step
from overlapcfg.passes.backend import GraphBackend
from overlapcfg.passes.compile import INDUCTOR_SETTINGS

RESULTS = Path(__file__).resolve().parent / "results"

_DEPTH1 = {"forward_prefetch": 1, "backward_prefetch": 1, "reduce_scatter_delay": 1}
_DEPTH2 = {"forward_prefetch": 2, "backward_prefetch": 2, "reduce_scatter_delay": 2}
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"strategy": "none"},
    "none again": {"strategy": "none"},
    "depth 1": {"plan": "llama_layers", "policy": {**_DEPTH1, "insert_overlap_deps": True}},
    "depth 2": {"plan": "llama_layers", "policy": {**_DEPTH2, "insert_overlap_deps": True}},
}
"""Part 1's configs; ``none`` is the reference the others must equal bit for bit. ``none again`` is the control: a
second compile of the same step must equal the first, or the setup itself is not reproducible (a kernel with atomics,
say) and a difference of the others says nothing about the pass."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What parts 1 and 2 build: part 1's model and batch, part 2's shape (8B dims, ``fake_layers`` layers)."""

    model: LlamaConfig
    batch: int
    seq_len: int
    fake_model: LlamaConfig
    fake_batch: int
    fake_seq_len: int
    fake_world: int = 8


GPU_SIZES = Sizes(
    model=LlamaConfig(vocab_size=32000, dim=2048, n_layers=2, n_heads=16, n_kv_heads=8, ffn_hidden=5632,
                      max_seq_len=2048),
    batch=4, seq_len=1024,
    fake_model=dataclasses.replace(LLAMA3_8B, n_layers=2), fake_batch=1, fake_seq_len=2048)
SMALL_SIZES = Sizes(
    # Part 1 at one layer: what it checks (each config's losses and gradients bitwise those of no pass, the pass
    # merging the collectives it ran: three buckets at one layer, two ahead at depth 2) does not depend on the depth,
    # and each of its four configs compiles the model (dynamo's and aot's time grows with the layers).
    model=LlamaConfig(n_layers=1), batch=2, seq_len=16,
    # Part 2 at one layer: what it checks (the pass rewrites the fake group's graphs and inductor lowers them) does
    # not depend on the depth, and on CPU a second layer costs a third more (part 2: 61 vs 46 CPU s on 2 cores).
    fake_model=LlamaConfig(vocab_size=512, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=256),
    fake_batch=1, fake_seq_len=32)


# --- part 1: one rank, a real group --------------------------------------------------------------------------------

@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """A real default process group of one rank in this process: NCCL on CUDA, gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    return run


def run_config(label: str, cfg: dict[str, Any], sizes: Sizes, device: torch.device, compiler: str, steps: int,
               param_dtype: torch.dtype | None) -> dict[str, Any]:
    """``steps`` SGD steps of a fresh model compiled with the pass; the losses, last gradients and timings."""
    compat.dynamo_reset()
    model = shard_module(Llama(sizes.model, device=device, seed=0), world_size=1, rank=0,
                         reshard_after_forward=True, param_dtype=param_dtype,
                         reduce_dtype=torch.float32 if param_dtype is not None else None)
    backend = overlapcfg.backend(cfg, compiler=compiler, model=model)  # type: ignore[arg-type]
    lowering: list[float] = []
    backend.compiler = _timed(backend.compiler, lowering)
    if backend.bw_compiler is not None:
        backend.bw_compiler = _timed(backend.bw_compiler, lowering)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens, targets = demo_batch(sizes.model.vocab_size, batch=sizes.batch, seq_len=sizes.seq_len, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, grads = [], [], {}
    for i in range(steps):
        _sync(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(compiled(tokens), targets)
        loss.backward()
        if i == steps - 1:
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - started)
        losses.append(loss.detach().clone())
    records = {name: gm.meta["overlapcfg"] for name, gm in backend.graphs.items()}
    steady = statistics.median(times[1:]) if len(times) > 1 else float("nan")
    compile_s = times[0] - steady
    pass_s = sum(r.seconds for r in records.values())
    result = {
        "config": label, "overlap": cfg, "losses": [float(x) for x in losses],
        "first_step_s": times[0], "step_s": steady, "steps_s": times, "compile_s": compile_s,
        "lowering_s": sum(lowering), "pass_s": pass_s, "pass_share": pass_s / compile_s if compile_s > 0 else None,
        "collectives": {name: [r.before.total_fsdp, r.after.total_fsdp] for name, r in records.items()},
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    compat.dynamo_reset()
    return {**result, "_losses": losses, "_grads": grads, "_graphs": list(backend.graphs.values())}


def bitwise(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Whether ``other``'s losses (every step) and last gradients equal ``reference``'s bit for bit."""
    losses = len(reference["_losses"]) == len(other["_losses"]) and all(
        torch.equal(a, b) for a, b in zip(reference["_losses"], other["_losses"], strict=True))
    names = list(reference["_grads"])
    grads = names == list(other["_grads"]) and all(torch.equal(reference["_grads"][n], other["_grads"][n])
                                                   for n in names)
    worst = 0.0
    for n in names:
        if n in other["_grads"]:
            worst = max(worst, float((reference["_grads"][n].float() - other["_grads"][n].float()).abs().max()))
    return {"losses_equal": losses, "grads_equal": grads, "max_grad_abs_diff": worst}


def one_rank(sizes: Sizes, device: torch.device, compiler: str, steps: int, param_dtype: torch.dtype | None,
             calibrate_s: float, cache_bytes: int | None = None) -> dict[str, Any]:
    """Part 1 (and part 3, which needs the same live group)."""
    runs: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"configs": [], "calibration": None}
    with one_rank_group(device) as backend:
        out["backend"] = backend
        for label, cfg in CONFIGS.items():
            try:
                runs[label] = run_config(label, cfg, sizes, device, compiler, steps, param_dtype)
            except Exception as err:
                runs[label] = {"config": label, "overlap": cfg, "error": _error(err)}
        reference = runs["none"]
        for run in runs.values():
            row = {k: v for k, v in run.items() if not k.startswith("_")}
            if "error" not in run and "error" not in reference:
                row.update(bitwise(reference, run))
            out["configs"].append(row)
        graphs = next((r["_graphs"] for r in runs.values() if "_graphs" in r), [])
        out["calibration"] = calibrate(graphs, device, calibrate_s, cache_bytes)
    return out


# --- part 2: eight ranks, a fake group, compiled and not run -------------------------------------------------------

def fake_group_compile(sizes: Sizes, device: torch.device, cfg: dict[str, Any],
                       param_dtype: torch.dtype | None) -> dict[str, Any]:
    """Capture the 8B-shaped step under a fake group of ``sizes.fake_world`` ranks (inductor's decompositions),
    apply ``cfg`` and lower each graph with inductor from its fake inputs."""
    out: dict[str, Any] = {"model": dataclasses.asdict(sizes.fake_model), "world_size": sizes.fake_world,
                           "overlap": cfg, "graphs": []}
    compat.dynamo_reset()
    started = time.perf_counter()
    # The weights' values do not matter (the step runs once, for its graphs, with collectives that move nothing):
    # allocate without drawing 1.3 billion random numbers on the host.
    unsharded = Llama(sizes.fake_model, device="meta").to_empty(device=device)
    model = shard_module(unsharded, world_size=sizes.fake_world, rank=0, reshard_after_forward=True,
                         param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None)
    del unsharded
    tokens, targets = demo_batch(sizes.fake_model.vocab_size, batch=sizes.fake_batch, seq_len=sizes.fake_seq_len,
                                 device=device)
    capture = GraphBackend(model=model, decompositions=compat.inductor_decompositions())
    with compat.fake_process_group(sizes.fake_world, 0):
        cross_entropy_loss(torch.compile(model, backend=capture, fullgraph=True)(tokens), targets).backward()
    compat.dynamo_reset()
    step = capture.step()
    del model, tokens, targets
    out["capture_s"] = time.perf_counter() - started
    applied = apply_step(step, overlapcfg.load_config(cfg))
    with step.process_groups(), compat.inductor_config_patch(dict(INDUCTOR_SETTINGS)):
        for graph in applied.graphs:
            begun = time.perf_counter()
            compiled = compat.compile_fx_from_fake_inputs(graph.graph, is_backward=graph.name == "backward")
            out["graphs"].append({
                "graph": graph.name, "nodes": len(graph.graph.graph.nodes), "pass_s": graph.record.seconds,
                "fsdp_before": graph.record.before.total_fsdp, "fsdp_after": graph.record.after.total_fsdp,
                "buckets": len(graph.record.buckets), "lowering_s": time.perf_counter() - begun,
                "compiled": type(compiled).__name__})
    return out


# --- part 3: calibrate ---------------------------------------------------------------------------------------------

def calibrate(graphs: list[Any], device: torch.device, budget_s: float,
              cache_bytes: int | None = None) -> dict[str, Any]:
    """``overlapcfg.calibrate`` in part 1's live group at its graphs' matmul shapes (not saved)."""
    try:
        profile = overlapcfg.calibrate(step=matmul_mix(graphs), name="gpu_check", budget_s=budget_s, save=False,
                                       device=device, cache_bytes=cache_bytes)
    except Exception as err:
        return {"error": _error(err)}
    return {"profile": profile.model_dump(mode="json", exclude_none=True), "_profile": profile}


# --- the run -------------------------------------------------------------------------------------------------------

def _error(err: BaseException) -> str:
    """The root cause in one line: the innermost chained exception (dynamo wraps a backend's error in
    ``BackendCompilerFailed``, whose own message ends with advice on logging)."""
    while err.__cause__ is not None:
        err = err.__cause__
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"[:500]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{1000 * seconds:.1f} ms"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def render(result: dict[str, Any], console: Console) -> None:
    part1 = result.get("one_rank", {})
    table = Table(title=f"1. one rank, {part1.get('backend', '?')}, compiler {result['compiler']}: "
                        f"{result['steps']} steps from the same weights")
    for col in ("config", "FSDP collectives fw / bw", "losses bitwise", "grads bitwise", "compile", "pass (share)",
                "step (median)", "peak memory"):
        table.add_column(col)
    for row in part1.get("configs", []):
        if "error" in row:
            table.add_row(row["config"], f"[red]{row['error']}", "", "", "", "", "", "")
            continue
        coll = " / ".join(f"{a}->{b}" for a, b in row["collectives"].values())
        yes = {True: "[green]yes", False: "[red]no"}
        share = f"{_s(row['pass_s'])} ({100 * row['pass_share']:.1f} %)" if row.get("pass_share") else _s(row["pass_s"])
        memory = f"{row['peak_memory_bytes'] / 2**30:.2f} GiB" if row.get("peak_memory_bytes") else "-"
        table.add_row(row["config"], coll, yes.get(row.get("losses_equal"), "-"), yes.get(row.get("grads_equal"), "-"),
                      _s(row["compile_s"]), share, _ms(row["step_s"]), memory)
    console.print(table)
    part2 = result.get("fake_group", {})
    layers = result["sizes"]["fake_model"]["n_layers"]
    table = Table(title=f"2. {result['sizes']['fake_world']} fake ranks, 8B-shaped {layers}-layer step, lowered by "
                        f"inductor for {result['device']}, not run")
    for col in ("graph", "nodes", "FSDP collectives", "buckets", "pass", "inductor lowering", "compiled"):
        table.add_column(col)
    if "error" in part2:
        table.add_row("[red]failed", part2["error"], "", "", "", "", "")
    for g in part2.get("graphs", []):
        table.add_row(g["graph"], str(g["nodes"]), f"{g['fsdp_before']}->{g['fsdp_after']}", str(g["buckets"]),
                      _s(g["pass_s"]), _s(g["lowering_s"]), g["compiled"])
    console.print(table)
    calibration = part1.get("calibration") or {}
    if "_profile" in calibration:
        console.print(calibration_table(calibration["_profile"]))
    elif calibration:
        console.print(f"3. calibrate: [red]{calibration.get('error')}")
    console.print(f"total {result['total_s']:.1f} s; {'[green]ok' if result['ok'] else '[red]FAILED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes everywhere (the CPU test's sizes)")
    parser.add_argument("--compiler", choices=("inductor", "eager"), default=None,
                        help="part 1's compiler (default: inductor on CUDA, eager on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="part 1's steps per config (default 10; small 3)")
    parser.add_argument("--param-dtype", choices=("bfloat16", "float32"), default=None,
                        help="all-gathered parameter dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--fake-config", choices=tuple(CONFIGS), default="depth 2",
                        help="the config part 2 applies before lowering")
    parser.add_argument("--calibrate-s", type=float, default=None, help="calibration budget (default 30; small 5)")
    parser.add_argument("--cache-mib", type=int, default=None,
                        help="the last-level cache calibration times memory beyond (default: what the device reports)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="leave torch.use_deterministic_algorithms off (on by default, warn-only: a kernel "
                             "without a deterministic version warns instead of failing)")
    parser.add_argument("--skip", choices=("one_rank", "fake_group"), nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    sizes = SMALL_SIZES if args.small else GPU_SIZES
    compiler = args.compiler or ("inductor" if device.type == "cuda" else "eager")
    steps = args.steps or (3 if args.small else 10)
    dtype_name = args.param_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    param_dtype = None if dtype_name == "float32" else getattr(torch, dtype_name)
    calibrate_s = args.calibrate_s if args.calibrate_s is not None else (5.0 if args.small else 30.0)
    logging.basicConfig(level=logging.WARNING)
    if not args.nondeterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    console = Console(width=150)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(), "torch": torch.__version__, "overlapcfg": overlapcfg.__version__,
        "overlapcfg_from": str(Path(overlapcfg.__file__).parent),
        "compiler": compiler, "steps": steps, "param_dtype": dtype_name, "sizes": dataclasses.asdict(sizes),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    ok = True
    if "one_rank" not in args.skip:
        result["one_rank"] = one_rank(sizes, device, compiler, steps, param_dtype, calibrate_s,
                                      None if args.cache_mib is None else args.cache_mib * 2**20)
        rows = result["one_rank"]["configs"]
        ok = all("error" not in r and r.get("losses_equal", True) and r.get("grads_equal", True) for r in rows)
        ok = ok and "error" not in (result["one_rank"]["calibration"] or {})
    if "fake_group" not in args.skip:
        try:
            result["fake_group"] = fake_group_compile(sizes, device, CONFIGS[args.fake_config], param_dtype)
        except Exception as err:
            result["fake_group"] = {"error": _error(err), "traceback": traceback.format_exc()}
            ok = False
    result["total_s"] = time.perf_counter() - started
    result["ok"] = ok
    render(result, console)
    calibration = result.get("one_rank", {}).get("calibration") or {}
    calibration.pop("_profile", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    console.print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Training jobs traced by the user's own ``torch.profiler``, for ``tests/diagnosis`` and
``benchmarks/diagnose_routes.py`` (spawned by ``run_on_gloo``, so everything here is importable by name).

A Hugging Face ``LlamaForCausalLM`` (nobody here wrote it), sharded through one of three routes, trains a few steps;
then ``torch.profiler.profile(schedule=..., on_trace_ready=...)`` records ``PROFILED`` steps and each rank exports its
own Chrome trace (``<out>/<run>/rank<r>.json``), as a user's training loop would. overlapcfg's measuring runner is
not involved: the traces are what any job would write.

- ``fsdp2``: ``overlapcfg.fully_shard(model, cfg, mesh=...)`` (eager FSDP2);
- ``lightning``: Lightning's ``Trainer`` with ``ModelParallelStrategy`` and ``overlapcfg.integrations.lightning
  .parallelize`` in ``configure_model``; the profiler steps from a ``Callback``;
- ``compiled``: ``overlapcfg.shard_module`` (SimpleFSDP) and ``torch.compile(model,
  backend=overlapcfg.backend(cfg, model=model))``.

Each run also times ``TIMED`` unprofiled steps (the slowest rank's wall time per step), which the benchmark reports.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROFILED = 3
TIMED = 4
WARM = 2
HIDDEN, LAYERS, VOCAB, BATCH, SEQ = 64, 2, 128, 2, 16

LEAVES = ["model.embed_tokens", "model.layers.*.self_attn.*", "model.layers.*.mlp.*",
          "model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm", "lm_head"]
POOR = {"plan": {"buckets": LEAVES}, "policy": {"forward_prefetch": 0, "backward_prefetch": 0}}
"""Every parameter its own bucket (each Llama module owns one weight), nothing prefetched (eager FSDP2 has no
reduce-scatter delay of its own: its reduce-scatters are 1 behind, always)."""
POOR_COMPILED = {**POOR, "policy": {**POOR["policy"], "reduce_scatter_delay": 0}}
GOOD_COMPILED = {"plan": "hf_decoder_layers", "policy": {"forward_prefetch": 2, "backward_prefetch": 2}}
"""The embedding, one bucket per decoder layer, the norm with the head; two buckets in flight: the compiled route
overlaps on CPU (NOTES), so prefetch hides communication."""
GOOD_EAGER = {"plan": "single_bucket"}
"""Eager FSDP2 on gloo blocks the issuing thread for every collective (NOTES): nothing overlaps, so the fewest
collectives and FSDP2 groups win; one bucket."""
CONFIGS = {("fsdp2", "poor"): POOR, ("fsdp2", "good"): GOOD_EAGER, ("lightning", "poor"): POOR,
           ("lightning", "good"): GOOD_EAGER, ("compiled", "poor"): POOR_COMPILED, ("compiled", "good"): GOOD_COMPILED}
"""``(route, quality) -> config`` of the jobs diagnosed."""


def llama(sizes: dict[str, int] | None = None) -> torch.nn.Module:
    import transformers

    s = {"hidden": HIDDEN, "layers": LAYERS, "vocab": VOCAB, **(sizes or {})}
    config = transformers.LlamaConfig(hidden_size=s["hidden"], intermediate_size=2 * s["hidden"],
                                      num_hidden_layers=s["layers"], num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=s["vocab"], max_position_embeddings=256, use_cache=False,
                                      attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def batches(rank: int, count: int, vocab: int, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(count):
        data = torch.randint(0, vocab, (BATCH, seq + 1), generator=torch.Generator().manual_seed(1000 * rank + i))
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out


def _loss(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _profiler(out: Path, rank: int, wait: int, profiled: int) -> torch.profiler.profile:
    out.mkdir(parents=True, exist_ok=True)
    name = str(out / f"rank{rank}.json")
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, profile_memory=True,
        schedule=torch.profiler.schedule(wait=wait, warmup=1, active=profiled),
        on_trace_ready=lambda p: p.export_chrome_trace(name))


def _slowest(times: list[float]) -> list[float]:
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _loop(step: Any, rank: int, out: Path, vocab: int, sizes: dict[str, int] | None) -> list[float]:
    """``WARM + TIMED`` steps, then the profiled ones; the slowest rank's seconds of the timed steps."""
    seq, profiled = (sizes or {}).get("seq", SEQ), (sizes or {}).get("profiled", PROFILED)
    timed = (sizes or {}).get("timed", TIMED)
    data = batches(rank, WARM + timed + 1 + profiled, vocab, seq)
    times = []
    with _profiler(out, rank, WARM + timed, profiled) as prof:
        for i, (tokens, targets) in enumerate(data):
            if i < WARM + timed:  # lined up for timing; the profiled steps run as a job runs them
                dist.barrier()
            start = time.perf_counter()
            step(tokens, targets)
            times.append(time.perf_counter() - start)
            prof.step()
    return _slowest(times)[WARM:WARM + timed]


def _fsdp2(cfg: Any, rank: int, out: Path, sizes: dict[str, int] | None, mesh: Any = None) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    import overlapcfg

    model = llama(sizes)
    overlapcfg.fully_shard(model, cfg, mesh=mesh if mesh is not None else init_device_mesh("cpu", (2,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        _loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()

    return _loop(step, rank, out, model.config.vocab_size, sizes)


def _compiled(cfg: Any, rank: int, out: Path, sizes: dict[str, int] | None) -> list[float]:
    import overlapcfg

    model = llama(sizes)
    overlapcfg.shard_module(model, reshard_after_forward=True)
    compiled = torch.compile(model, backend=overlapcfg.backend(cfg, model=model), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        _loss(compiled, tokens, targets).backward()
        opt.step()
        opt.zero_grad()

    return _loop(step, rank, out, model.config.vocab_size, sizes)


def _lightning(cfg: Any, rank: int, out: Path, sizes: dict[str, int] | None) -> list[float]:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from overlapcfg.integrations.lightning import parallelize

    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "RANK": str(rank), "WORLD_SIZE": "2"})
    seq = (sizes or {}).get("seq", SEQ)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama(sizes)

        def configure_model(self) -> None:
            parallelize(cfg)(self.model, self.device_mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.model, *batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    times: list[float] = []
    profiled, timed = (sizes or {}).get("profiled", PROFILED), (sizes or {}).get("timed", TIMED)
    total = WARM + timed + 1 + profiled
    prof = _profiler(out, rank, WARM + timed, profiled)

    class Steps(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.started)
            prof.step()

    module = Module()
    data = [tuple(t[0] for t in b) for b in batches(rank, 2 * total, module.model.config.vocab_size, seq)]
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=total, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0, callbacks=[Steps()],
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    with prof:
        trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return _slowest(times)[WARM:WARM + timed]


ROUTES = {"fsdp2": _fsdp2, "compiled": _compiled, "lightning": _lightning}


def route_job(rank: int, world_size: int, runs: list[tuple[str, str, Any]], out: str,
              sizes: dict[str, int] | None = None) -> dict[str, list[float]]:
    """``sizes``: ``hidden``, ``layers``, ``vocab``, ``seq`` of the model and batch, ``profiled`` and ``timed``
    steps (defaults: the module's constants)."""
    """Each ``(route, name, cfg)`` of ``runs`` in turn on this rank, its trace in ``<out>/<name>``; the timed steps
    of each."""
    torch.manual_seed(0)
    return {name: ROUTES[route](cfg, rank, Path(out) / name, sizes) for route, name, cfg in runs}


def diverging_job(rank: int, world_size: int, configs: list[Any], out: str) -> bool:
    """Eager FSDP2 with one config on ranks 0-1 and another on ranks 2-3 (``world_size`` 4), each pair sharding over
    a group of its own. Two ranks of one group given different configs cannot both leave a trace on gloo: the rank
    that receives a larger message than it posted aborts its process (and on NCCL both hang). Pairs keep each
    group's collectives matched, so every rank runs and exports its trace; the job's ranks disagree all the same."""
    from torch.distributed.device_mesh import DeviceMesh

    pairs = [dist.new_group([r, r + 1], timeout=datetime.timedelta(seconds=120)) for r in range(0, world_size, 2)]
    mesh = DeviceMesh.from_group(pairs[rank // 2], "cpu")
    # No timed steps: only the traces are read.
    _fsdp2(configs[rank // 2], rank, Path(out), {"layers": 1, "profiled": 2, "timed": 0}, mesh=mesh)
    return True

"""Train the demo Llama on several processes, its FSDP collectives bucketed and overlapped as ``overlap`` says.

    torchrun --nproc-per-node 2 examples/train_llama/train.py overlap/plan=per_block_split steps=20
    torchrun --nproc-per-node 2 examples/train_llama/train.py sharding=fsdp2 overlap.policy.forward_prefetch=2

Three ways to shard, one config (``sharding=``):

- ``simple_fsdp`` (default): SimpleFSDP-style sharding, the whole model compiled with
  ``torch.compile(backend=overlapcfg.backend(cfg))``; the pass rewrites the collectives in the fw/bw graphs.
- ``fsdp2``: eager FSDP2, ``overlapcfg.fully_shard(model, cfg, mesh=...)``: one ``fully_shard`` group per bucket,
  explicit prefetch lists from the policy.
- ``fsdp2_compile``: the same, plus each bucket's blocks' ``forward`` compiled (``fsdp2_backend``, ``aot_eager``
  by default); FSDP2's hooks run around the compiled forward, outside the graph.

A Hydra app of its own: ``conf/train.yaml`` mounts ``overlap: default`` from overlapcfg's shipped config tree
(found by overlapcfg's Hydra plugin), so every ``overlap.*`` override works here as in the ``overlapcfg``
command. gloo on CPU, NCCL when every rank has a GPU. Copy this file as the starting point of a real recipe:
the overlapcfg lines are marked ``# overlapcfg``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlapcfg
from overlapcfg.capture import shard_module
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.llama import cross_entropy_loss
from overlapcfg.demo.tracing import demo_batch
from overlapcfg.errors import OverlapConfigError, did_you_mean
from overlapcfg.passes.compile import backend

log = logging.getLogger("train_llama")

SHARDINGS = ("simple_fsdp", "fsdp2", "fsdp2_compile")


def _check_sharding(value: object) -> str:
    if value not in SHARDINGS:
        raise OverlapConfigError.single("sharding", f"expected one of {', '.join(SHARDINGS)}, got {value!r}"
                                                    f"{did_you_mean(str(value), SHARDINGS)}")
    return str(value)


def _init_distributed() -> tuple[int, int, torch.device]:
    """Join the group torchrun set up (RANK/WORLD_SIZE/LOCAL_RANK); a plain ``python train.py`` is one rank."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def train(cfg: DictConfig) -> list[float]:
    """``cfg.steps`` optimizer steps; returns the loss of each step averaged over ranks."""
    overlap = overlapcfg.from_hydra(cfg.overlap)  # overlapcfg: validate before any process group exists
    sharding = _check_sharding(cfg.sharding)
    rank, world_size, device = _init_distributed()
    try:
        model_cfg = LlamaConfig(**OmegaConf.to_container(cfg.model, resolve=True), max_seq_len=cfg.seq_len)
        model = Llama(model_cfg, device=device, seed=cfg.seed)
        compiled = _shard(model, overlap, cfg, sharding, rank, world_size, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        if rank == 0:
            log.info("training %d layers on %d ranks (%s), sharding %s, strategy %s, plan %s", model_cfg.n_layers,
                     world_size, device.type, sharding, overlap.strategy,
                     overlap.plan.name if overlap.plan else "-")
        losses = []
        for step in range(cfg.steps):
            tokens, targets = demo_batch(model_cfg.vocab_size, batch=cfg.batch, seq_len=cfg.seq_len,
                                         seed=cfg.seed + 1 + step * world_size + rank, device=device)
            optimizer.zero_grad(set_to_none=True)
            loss = cross_entropy_loss(compiled(tokens), targets)
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
            if rank == 0:
                log.info("step %d loss %.6f", step, losses[-1])
        return losses
    finally:
        dist.destroy_process_group()


def _shard(model: Llama, overlap: overlapcfg.OverlapConfig, cfg: DictConfig, sharding: str, rank: int,
           world_size: int, device: torch.device) -> nn.Module:
    """Shard ``model`` in place as ``sharding`` says; returns the module to call for a step."""
    if sharding == "simple_fsdp":
        shard_module(model, world_size=world_size, rank=rank, reshard_after_forward=cfg.reshard_after_forward)
        return torch.compile(model, fullgraph=True,  # overlapcfg: the pass runs on the fw/bw graphs
                             backend=backend(overlap, compiler=cfg.compiler))
    mesh = init_device_mesh(device.type, (world_size,))
    # overlapcfg: one fully_shard group per bucket of the plan, explicit prefetch lists from the policy
    overlapcfg.fully_shard(model, overlap, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
    report = overlapcfg.explain(model, overlap)  # what fully_shard did: buckets, prefetch lists, depths and why
    if sharding == "fsdp2_compile":
        # Compile the forward of each module FSDP2 wraps (the buckets' modules; for llama_layers the embedding,
        # each block, norm and output), not the module call: FSDP2 all-gathers, prefetches and reduce-scatters in
        # hooks around forward, so they run eagerly outside the graphs and the prefetch lists keep their meaning.
        fqns = [fqn for bucket in report.buckets for fqn in bucket.modules]
        for fqn in fqns:
            module = model.get_submodule(fqn)
            module.forward = torch.compile(module.forward, backend=cfg.fsdp2_backend, fullgraph=True)
        if rank == 0:
            log.info("compiled forward of %d modules with backend %s: %s", len(fqns), cfg.fsdp2_backend,
                     ", ".join(fqns))
    if rank == 0:
        log.info("FSDP2 %s", report.graph("fsdp2").order)
    return model


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    losses = train(cfg)
    if cfg.losses_file and int(os.environ["RANK"]) == 0:
        Path(cfg.losses_file).write_text(json.dumps(losses))


if __name__ == "__main__":
    main()  # a failure exits through Hydra (status 1) before this line
    overlapcfg.exit_process(0)  # FSDP2 keeps gloo's threads alive: leave without finalizing Python

"""Train the demo Llama with PyTorch Lightning's ``ModelParallelStrategy``, its FSDP2 groups and prefetch lists
from an overlap config (``overlapcfg.integrations.lightning.parallelize``).

    python examples/lightning/train.py                     # Lightning starts 2 CPU processes (gloo)
    python examples/lightning/train.py --steps 5 --config overlap.yaml
    torchrun --nproc-per-node 2 examples/lightning/train.py

The overlapcfg lines are marked ``# overlapcfg``: one import, one call in ``configure_model``. On GPUs pass
``--accelerator gpu`` (NCCL). Rank 0 prints the loss of every step and what FSDP2 was given
(``overlapcfg.explain``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

import overlapcfg
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.llama import cross_entropy_loss
from overlapcfg.demo.tracing import demo_batch
from overlapcfg.integrations.lightning import parallelize  # overlapcfg

DEFAULT_CONFIG = {"plan": "llama_layers", "policy": {"forward_prefetch": 2, "backward_prefetch": 2}}
"""One FSDP2 group per block, the embedding and [norm, output] as groups of their own, two groups in flight."""


class LitLlama(L.LightningModule):
    """The demo Llama; ``configure_model`` shards it the way the overlap config says."""

    def __init__(self, cfg: Any, n_layers: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.cfg = overlapcfg.load_config(cfg)
        self.model = Llama(LlamaConfig(n_layers=n_layers), seed=0)
        self.lr = lr
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        parallelize(self.cfg)(self.model, self.device_mesh)  # overlapcfg

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = cross_entropy_loss(self.model(tokens), targets)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def batches(rank: int, steps: int, vocab_size: int) -> DataLoader:
    """This rank's own batches (each rank trains on different data, as data parallelism does)."""
    data = [tuple(t[0] for t in demo_batch(vocab_size, batch=1, seed=1000 * rank + i)) for i in range(2 * steps)]
    return DataLoader(data, batch_size=2)


def trainer(steps: int, devices: int = 2, accelerator: str = "cpu") -> L.Trainer:
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, num_sanity_val_steps=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--config", type=Path, help="an overlap config YAML file (default: llama_layers, depth 2)")
    args = parser.parse_args(argv)
    run = trainer(args.steps, args.devices, args.accelerator)
    module = LitLlama(args.config or DEFAULT_CONFIG)
    run.fit(module, batches(run.global_rank, args.steps, module.model.config.vocab_size))
    if run.global_rank == 0:
        print("losses:", " ".join(f"{loss.item():.6f}" for loss in module.losses))
        print(overlapcfg.explain(module.model, module.cfg))
    overlapcfg.exit_process()  # FSDP2 keeps gloo's threads alive past teardown (see README, "Eager FSDP2")


if __name__ == "__main__":
    main()

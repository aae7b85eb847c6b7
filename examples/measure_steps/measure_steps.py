"""Calibrate this cluster, then measure a training step under three configs against the prediction.

    torchrun --nproc-per-node 2 examples/measure_steps/measure_steps.py [--layers 2] [--budget-s 10] [--steps 5]
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

import overlapcfg
from overlapcfg import shard_module
from overlapcfg.demo import Llama, LlamaConfig, cross_entropy_loss
from overlapcfg.demo.tracing import demo_batch
from overlapcfg.measuring.render_measure import calibration_table, measurement_table

parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
parser.add_argument("--layers", type=int, default=2, help="decoder layers of the demo model")
parser.add_argument("--budget-s", type=float, default=10.0, help="seconds calibration aims for (more: closer fits)")
parser.add_argument("--steps", type=int, default=5, help="timed steps per config (the median is reported)")
args = parser.parse_args()

config = LlamaConfig(n_layers=args.layers)
world_size = int(os.environ["WORLD_SIZE"])
# The step's matmul shapes for calibration, traced in this process before the real group exists.
traced = overlapcfg.trace_train_step(config, world_size=world_size, reshard_after_forward=True)

dist.init_process_group("gloo")  # "nccl" on GPUs (then build the model on the rank's device)
rank = dist.get_rank()
tokens, targets = demo_batch(config.vocab_size, seed=100 + rank)


def make_step(backend):
    """A fresh model compiled with the backend `measure` hands over; returns one training step."""
    model = shard_module(Llama(config, seed=0), world_size=world_size, rank=rank, reshard_after_forward=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad()
        cross_entropy_loss(compiled(tokens), targets).backward()
        optimizer.step()

    return step


# Rank 0 writes ~/.config/overlapcfg/hardware/my_cluster.yaml ($OVERLAPCFG_HOME/hardware if set).
profile = overlapcfg.calibrate(step=traced, name="my_cluster", budget_s=args.budget_s)
configs = {
    "none": {"strategy": "none"},
    "depth 1": {"plan": "llama_layers", "policy": "default"},
    "depth 2": {"plan": "llama_layers", "policy": "aggressive"},
}
result = overlapcfg.measure(make_step, configs, hardware=profile, steps=args.steps)
if rank == 0:
    Console(width=120).print(calibration_table(profile), measurement_table(result))
    Path("measure.json").write_text(result.to_json())
dist.destroy_process_group()
overlapcfg.exit_process()  # gloo's threads outlive the group: leave without finalizing Python

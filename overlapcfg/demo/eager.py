"""``overlapcfg sharding=fsdp2``: shard the demo Llama eagerly with ``overlapcfg.fully_shard`` (torch's FSDP2).

One process shards rank 0 of ``world_size`` under the communication-free fake process group (``fully_shard``
needs a group and a mesh, not communication); under ``torchrun`` (or wherever a default group already exists) the
real group is used instead and its size wins. Nothing runs on the model: the report is what the driver decided
and recorded (groups, prefetch lists, depths and why), read back with ``overlapcfg.report.explain(model, cfg)``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from overlapcfg import compat
from overlapcfg.config import OverlapConfig
from overlapcfg.demo.llama import Llama
from overlapcfg.demo.settings import DemoSettings
from overlapcfg.fsdp2 import fully_shard

__all__ = ["ShardedDemo", "process_group", "shard_demo"]

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class ShardedDemo:
    model: nn.Module
    rank: int
    world_size: int
    group: str
    """``fake`` (one process), ``torchrun`` (joined here from its environment) or ``existing``."""


@contextlib.contextmanager
def process_group(world_size: int) -> Iterator[tuple[int, int, str]]:
    """``(rank, world_size, kind)`` of the group to shard under: an initialized default group as it is; torchrun's
    environment joined with gloo (and left again); else rank 0 of ``world_size`` under the fake group."""
    if dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size(), "existing"
    elif all(k in os.environ for k in _TORCHRUN_ENV):
        dist.init_process_group("gloo")
        try:
            yield dist.get_rank(), dist.get_world_size(), "torchrun"
        finally:
            dist.destroy_process_group()
    else:
        with compat.fake_process_group(world_size, 0):
            yield 0, world_size, "fake"


def shard_demo(spec: DemoSettings, overlap: OverlapConfig, *, rank: int, world_size: int, group: str) -> ShardedDemo:
    """The demo Llama (CPU, seeded), sharded over ``world_size`` ranks of the current default group by
    ``overlapcfg.fully_shard(model, overlap, mesh=...)``; ``reshard_after_forward`` is the default of buckets that
    set none."""
    model = Llama(spec.llama_config())
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, overlap, mesh=mesh, reshard_after_forward=spec.reshard_after_forward)
    return ShardedDemo(model=model, rank=rank, world_size=world_size, group=group)

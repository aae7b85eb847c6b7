"""The demo model (a small Llama) and SimpleFSDP-style sharding for any module, used by tests, the CLI's demo and
users' quick checks. Tracing them into FX graphs lives in ``overlapcfg.demo.tracing``."""

from __future__ import annotations

from overlapcfg.demo.llama import LLAMA3_8B, Llama, LlamaConfig, cross_entropy_loss
from overlapcfg.demo.simple_fsdp import (
    AllGatherShard,
    gather_full_grads,
    is_sharded,
    shard_module,
    sharded_parameters,
    user_fqn,
)

__all__ = [
    "LLAMA3_8B",
    "AllGatherShard",
    "Llama",
    "LlamaConfig",
    "cross_entropy_loss",
    "gather_full_grads",
    "is_sharded",
    "shard_module",
    "sharded_parameters",
    "user_fqn",
]

"""The demo, on top of everything: a small Llama, its train-step tracing on meshes, the ``overlapcfg`` command and
the gloo harness. Nothing below this package imports it. The SimpleFSDP sharder it uses is public API in
``overlapcfg.capture`` (``shard_module`` and friends are re-exported here for older imports).

Exports are lazy so the command validates its config before paying for torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "LLAMA3_8B": "overlapcfg.demo.llama",
    "Llama": "overlapcfg.demo.llama",
    "LlamaConfig": "overlapcfg.demo.llama",
    "cross_entropy_loss": "overlapcfg.demo.llama",
    "AllGatherShard": "overlapcfg.capture.simple_fsdp",
    "gather_full_grads": "overlapcfg.capture.simple_fsdp",
    "is_sharded": "overlapcfg.capture.simple_fsdp",
    "shard_module": "overlapcfg.capture.simple_fsdp",
    "sharded_parameters": "overlapcfg.capture.simple_fsdp",
    "user_fqn": "overlapcfg.graph.attribution",
}

__all__ = [
    "AllGatherShard",
    "LLAMA3_8B",
    "Llama",
    "LlamaConfig",
    "cross_entropy_loss",
    "gather_full_grads",
    "is_sharded",
    "shard_module",
    "sharded_parameters",
    "user_fqn",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:
    from overlapcfg.capture.simple_fsdp import (
        AllGatherShard,
        gather_full_grads,
        is_sharded,
        shard_module,
        sharded_parameters,
    )
    from overlapcfg.demo.llama import LLAMA3_8B, Llama, LlamaConfig, cross_entropy_loss
    from overlapcfg.graph.attribution import user_fqn

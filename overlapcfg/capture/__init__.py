"""Capture: from your model to the ``CapturedStep`` that ``explain``, ``compare`` and ``tune`` take.

``shard_module`` (``simple_fsdp``) shards any ``nn.Module`` SimpleFSDP-style, so its FSDP collectives appear in the
graph; ``capture_step`` (``trace``) traces one training step of a sharded model, inside a job's process group or
under a fake one. Above ``passes`` (the backend it traces with, the ``CapturedStep`` it returns), beside ``report``
and below ``tuning`` and the demo, which uses it. Exports are lazy: importing this package imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "CapturedStep": "overlapcfg.passes.step",
    "ensure_process_group": "overlapcfg.passes.step",
    "capture_step": "overlapcfg.capture.trace",
    "default_loss": "overlapcfg.capture.trace",
    "AllGatherShard": "overlapcfg.capture.simple_fsdp",
    "gather_full_grads": "overlapcfg.capture.simple_fsdp",
    "is_sharded": "overlapcfg.capture.simple_fsdp",
    "shard_module": "overlapcfg.capture.simple_fsdp",
    "sharded_parameters": "overlapcfg.capture.simple_fsdp",
}

__all__ = ["AllGatherShard", "CapturedStep", "capture_step", "default_loss", "ensure_process_group",
           "gather_full_grads", "is_sharded", "shard_module", "sharded_parameters"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:
    from overlapcfg.capture.simple_fsdp import (
        AllGatherShard,
        gather_full_grads,
        is_sharded,
        shard_module,
        sharded_parameters,
    )
    from overlapcfg.capture.trace import capture_step, default_loss
    from overlapcfg.passes.step import CapturedStep, ensure_process_group

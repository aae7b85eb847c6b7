"""Eager FSDP2 from the same config as the compiled path: ``fully_shard(model, cfg)`` groups each bucket of the
plan into one ``torch.distributed.fsdp.fully_shard`` call and sets FSDP2's explicit prefetch lists from the policy.

Stages, one module each: ``checks`` (what the driver refuses or ignores) → ``tree`` (modules and parameter sizes)
→ ``prefetch`` (depths and the byte cap into prefetch lists, torch-free) → ``layout`` (everything decided, nothing
sharded) → ``shard`` (the side effects) → ``record`` (what was done, readable with ``explain(model)``).
Beside ``overlapcfg.passes`` in the layering: it reads config, resolve and the record vocabulary of
``overlapcfg.graph.record``, and nothing above it.
"""

from overlapcfg.fsdp2.layout import ShardLayout, plan_layout
from overlapcfg.fsdp2.record import RECORD_ATTR, Fsdp2Record, explain
from overlapcfg.fsdp2.shard import fully_shard

__all__ = ["RECORD_ATTR", "Fsdp2Record", "ShardLayout", "explain", "fully_shard", "plan_layout"]

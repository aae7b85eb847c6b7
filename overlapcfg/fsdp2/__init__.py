"""Eager FSDP2 from the same config as the compiled path: ``fully_shard(model, cfg)`` groups each bucket of the
plan into one ``torch.distributed.fsdp.fully_shard`` call and sets FSDP2's explicit prefetch lists from the policy.

Stages, one module each: ``checks`` (what the driver refuses or ignores) → ``tree`` (modules and parameter sizes)
→ ``prefetch`` (depths and the byte cap into prefetch lists, torch-free) → ``layout`` (everything decided, nothing
sharded) → ``shard`` (the side effects) → ``sharded`` (what was done, read back with ``read_record(model)``;
``overlapcfg.explain(model, cfg)`` reports it).
Beside ``overlapcfg.passes`` in the layering: it reads config, resolve and the record vocabulary of
``overlapcfg.graph.record``, and nothing above it.
"""

from overlapcfg.fsdp2.layout import ShardLayout, plan_layout
from overlapcfg.fsdp2.shard import fully_shard
from overlapcfg.fsdp2.sharded import RECORD_ATTR, Fsdp2Record, read_record

__all__ = ["RECORD_ATTR", "Fsdp2Record", "ShardLayout", "fully_shard", "plan_layout", "read_record"]

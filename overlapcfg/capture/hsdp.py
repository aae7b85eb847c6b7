"""The HSDP gradient-reduction orders ``shard_module`` offers. Torch-free, so settings that name one (the demo's
``parallel.hsdp_reduce``) validate before torch is imported."""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

__all__ = ["HSDP_REDUCE_ORDERS", "HsdpReduce"]

HsdpReduce: TypeAlias = Literal["all_reduce_first", "reduce_scatter_first"]
"""The order an HSDP gradient is reduced in: ``all_reduce_first`` is what torchtitan SimpleFSDP's DTensor
``hybrid_shard`` does (full-size all-reduce on the replicate group, then the reduce-scatter), ``reduce_scatter_first``
FSDP2's (reduce-scatter, then an all-reduce of the shard). See ``overlapcfg.capture.simple_fsdp``."""
HSDP_REDUCE_ORDERS: tuple[str, ...] = get_args(HsdpReduce)

"""How many ranks the demo is parallelized over, per mesh dimension: ``dp_replicate`` x ``dp_shard`` x ``tp``.

Torch-free, so the command's settings (``overlapcfg.demo.settings``) check a mesh against the model's sizes
before torch is imported; ``overlapcfg.demo.parallel`` builds the mesh and applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapcfg.capture.hsdp import HSDP_REDUCE_ORDERS, HsdpReduce
from overlapcfg.errors import OverlapConfigError

__all__ = ["HSDP_REDUCE_ORDERS", "MESH_DIMS", "HsdpReduce", "ParallelDims", "tensor_parallel_faults"]

MESH_DIMS: tuple[str, str, str] = ("dp_replicate", "dp_shard", "tp")
"""Outermost first, as torchtitan lays them out: TP innermost (neighbouring ranks), replicas outermost."""


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Mesh sizes of the demo. ``dp_replicate = tp = 1`` is plain FSDP over ``dp_shard`` ranks (no mesh at all)."""

    dp_replicate: int = 1
    """HSDP replicas: the gradient is also all-reduced over this many copies of the shard group."""
    dp_shard: int = 2
    """FSDP ranks each parameter is sharded over (dim 0)."""
    tp: int = 1
    """Tensor-parallel ranks (attention and feed-forward projections, ``parallelize_module``)."""
    sequence_parallel: bool = False
    """Also shard activations outside the projections along the sequence (norms, embedding, output); needs tp > 1."""
    hsdp_reduce: HsdpReduce = "all_reduce_first"
    """HSDP only: reduce the gradient over the replicas before or after the reduce-scatter."""

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OverlapConfigError(f"ParallelDims.{name} must be an integer >= 1, got {value!r}")
        if self.sequence_parallel and self.tp == 1:
            raise OverlapConfigError(
                "ParallelDims.sequence_parallel needs tp > 1 (it shards activations over the TP group)")
        if self.hsdp_reduce not in HSDP_REDUCE_ORDERS:
            raise OverlapConfigError(f"ParallelDims.hsdp_reduce must be one of {', '.join(HSDP_REDUCE_ORDERS)}, got "
                                     f"{self.hsdp_reduce!r}")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def is_1d(self) -> bool:
        """Plain FSDP: one group, the default one (graphs name group ``"0"``, as before meshes existed)."""
        return self.dp_replicate == 1 and self.tp == 1

    def describe(self) -> str:
        """``"2 x 2 (dp_replicate x dp_shard)"``: the dimensions larger than one (``"2 (dp_shard)"`` for FSDP)."""
        used = [(n, getattr(self, n)) for n in MESH_DIMS if getattr(self, n) > 1 or n == "dp_shard"]
        text = f"{' x '.join(str(v) for _, v in used)} ({' x '.join(n for n, _ in used)})"
        return text + (", sequence parallel" if self.sequence_parallel else "")


def tensor_parallel_faults(dims: ParallelDims, *, n_heads: int, kv_heads: int, ffn_hidden: int, vocab_size: int,
                           seq_len: int | None = None) -> list[tuple[str, str]]:
    """``(model size name, why)`` for each size the TP plan cannot split evenly over ``dims.tp`` ranks.

    Column-parallel ``wq``/``wk``/``wv``/``w1``/``w3`` split heads and the feed-forward width; with sequence
    parallel the embedding and output split the vocabulary and activations split the sequence (``seq_len``:
    the traced batch's, when known).
    """
    tp = dims.tp
    if tp == 1:
        return []
    sizes = {"n_heads": n_heads, "n_kv_heads": kv_heads, "ffn_hidden": ffn_hidden}
    if dims.sequence_parallel:
        sizes["vocab_size"] = vocab_size
        if seq_len is not None:
            sizes["seq_len"] = seq_len
    return [(name, f"{name}={value} is not divisible by parallel.tp={tp}")
            for name, value in sizes.items() if value % tp]

"""The demo job's own settings (``model.*``, ``world_size``, ``parallel.*``, ...), validated like every other
config: one pydantic model, faults at their command-line paths, closest field names for typos; no parsing of error
texts.

``world_size`` and ``parallel`` describe one mesh: ``world_size`` is the total number of ranks and ``parallel`` its
split into ``dp_replicate`` x ``dp_shard`` x ``tp``. Either may be left out: ``world_size=N`` alone is plain FSDP
over N ranks (``dp_shard`` = N / (``dp_replicate`` x ``tp``)); ``parallel.*`` alone gives ``world_size`` as their
product (``dp_shard`` defaults to 2). Both given must agree; anything else is a fault at ``world_size``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from overlapcfg.config.base import ConfigModel
from overlapcfg.config.load import validate_config
from overlapcfg.demo.dims import HsdpReduce, ParallelDims, tensor_parallel_faults

if TYPE_CHECKING:
    from overlapcfg.demo.llama import LlamaConfig

__all__ = ["SHARDINGS", "DemoModel", "DemoParallel", "DemoSettings", "Sharding", "demo_settings"]

Sharding = Literal["simple_fsdp", "fsdp2"]
SHARDINGS: tuple[str, ...] = get_args(Sharding)
"""``simple_fsdp``: trace one step of the SimpleFSDP-sharded model and run the graph pass on it.
``fsdp2``: shard the model eagerly with ``overlapcfg.fully_shard`` (torch's FSDP2) and report its groups."""


class DemoModel(ConfigModel):
    """Sizes of the demo Llama (``overlapcfg.demo.LlamaConfig``)."""

    n_layers: int = Field(4, ge=1)
    """Transformer blocks; tracing costs about half a second per block."""
    dim: int = Field(64, ge=1)
    """Model width; divisible by ``n_heads``."""
    n_heads: int = Field(4, ge=1)
    """Attention heads; divisible by ``n_kv_heads``."""
    ffn_hidden: int = Field(128, ge=1)
    """Feed-forward width."""
    vocab_size: int = Field(256, ge=1)
    """Vocabulary size."""
    n_kv_heads: int | None = Field(None, ge=1)
    """Grouped-query attention: key/value heads (None = n_heads)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> DemoModel:
        if self.dim % self.n_heads:
            raise PydanticCustomError("heads", "dim={dim} is not divisible by n_heads={heads}",
                                      {"dim": self.dim, "heads": self.n_heads})
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise PydanticCustomError("kv_heads", "n_heads={heads} is not divisible by n_kv_heads={kv}",
                                      {"heads": self.n_heads, "kv": self.n_kv_heads})
        return self


DEFAULT_DP_SHARD = 2
"""``parallel.dp_shard`` when neither it nor ``world_size`` is given (the demo's long-standing 2 FSDP ranks)."""


class DemoParallel(ConfigModel):
    """The mesh the demo is traced on (``overlapcfg.demo.dims.ParallelDims``): HSDP and tensor parallel."""

    dp_replicate: int = Field(1, ge=1)
    """HSDP replicas: gradients are also all-reduced over this many copies of the shard group."""
    dp_shard: int | None = Field(None, ge=1)
    """FSDP ranks each parameter is sharded over; null: world_size / (dp_replicate x tp), or 2 without world_size."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel ranks (attention and feed-forward projections, torch's ``parallelize_module``)."""
    sequence_parallel: bool = False
    """With tp > 1: also shard the activations between the projections along the sequence."""
    hsdp_reduce: HsdpReduce = "all_reduce_first"
    """HSDP gradient order: all-reduce on the replicas first (torchtitan's SimpleFSDP) or reduce-scatter first."""

    @field_validator("sequence_parallel")
    @classmethod
    def _needs_tp(cls, value: bool, info: ValidationInfo) -> bool:
        tp = info.data.get("tp")
        if value and tp == 1:
            raise PydanticCustomError("sequence_parallel", "sequence parallel shards activations over the "
                                      "tensor-parallel group: it needs parallel.tp > 1 (tp is 1)")
        return value


class DemoSettings(ConfigModel):
    """What to trace: the demo model's sizes and the sharding."""

    model: DemoModel = DemoModel()
    sharding: Sharding = "simple_fsdp"
    """How the demo is sharded: ``simple_fsdp`` (traced, the graph pass) or ``fsdp2`` (eager, ``fully_shard``)."""
    parallel: DemoParallel = DemoParallel()
    """The mesh: ``dp_replicate`` x ``dp_shard`` x ``tp`` ranks (``dims`` has them resolved)."""
    world_size: int | None = Field(None, ge=1, validate_default=True)
    """All ranks the step is sharded for; one process traces (or shards) rank 0 under a fake process group. Null
    in the input: the product of ``parallel``; after validation always the resolved number."""
    reshard_after_forward: bool = True
    """Free unsharded parameters after forward and all-gather them again in backward (FSDP2's default)."""
    batch: int = Field(2, ge=1)
    seq_len: int = Field(16, ge=1)

    @field_validator("parallel")
    @classmethod
    def _fits(cls, value: DemoParallel, info: ValidationInfo) -> DemoParallel:
        if info.data.get("sharding") == "fsdp2" and (value.dp_replicate > 1 or value.tp > 1):
            raise PydanticCustomError("parallel", "sharding=fsdp2 shards over one dimension here; HSDP "
                                      "(dp_replicate > 1) and tensor parallel (tp > 1) need sharding=simple_fsdp")
        model = info.data.get("model")
        if model is not None:
            dims = ParallelDims(value.dp_replicate, value.dp_shard or 1, value.tp, value.sequence_parallel)
            faults = tensor_parallel_faults(dims, n_heads=model.n_heads, kv_heads=model.n_kv_heads or model.n_heads,
                                            ffn_hidden=model.ffn_hidden, vocab_size=model.vocab_size)
            if faults:
                raise PydanticCustomError("tensor_parallel", "the tensor-parallel plan cannot split the model: "
                                          "{why}", {"why": "; ".join(f"model.{why}" for _, why in faults)})
        return value

    @field_validator("world_size")
    @classmethod
    def _resolve_world_size(cls, value: int | None, info: ValidationInfo) -> int | None:
        mesh: DemoParallel | None = info.data.get("parallel")
        if mesh is None:  # parallel itself is invalid: its fault is reported
            return value
        others = mesh.dp_replicate * mesh.tp
        if value is None:
            return (mesh.dp_shard or DEFAULT_DP_SHARD) * others
        if mesh.dp_shard is None and value % others:
            raise PydanticCustomError("world_size", "world_size={ws} is not divisible by parallel.dp_replicate x "
                                      "parallel.tp = {others}: it must be their product with parallel.dp_shard",
                                      {"ws": value, "others": others})
        if mesh.dp_shard is not None and value != mesh.dp_shard * others:
            raise PydanticCustomError(
                "world_size", "world_size={ws} contradicts parallel: dp_replicate {r} x dp_shard {s} x tp {t} = "
                "{product} ranks; set world_size={product} or leave it out (null: the product)",
                {"ws": value, "r": mesh.dp_replicate, "s": mesh.dp_shard, "t": mesh.tp,
                 "product": mesh.dp_shard * others})
        return value

    @field_validator("seq_len")
    @classmethod
    def _sequence_splits(cls, value: int, info: ValidationInfo) -> int:
        mesh: DemoParallel | None = info.data.get("parallel")
        if mesh is not None and mesh.sequence_parallel and value % mesh.tp:
            raise PydanticCustomError("sequence_parallel", "seq_len={seq} is not divisible by parallel.tp={tp} "
                                      "(sequence parallel splits the sequence)", {"seq": value, "tp": mesh.tp})
        return value

    @property
    def dims(self) -> ParallelDims:
        """The resolved mesh (``parallel.dp_shard`` filled in from ``world_size``)."""
        p, ws = self.parallel, self.world_size or 0
        return ParallelDims(p.dp_replicate, p.dp_shard or ws // (p.dp_replicate * p.tp), p.tp,
                            p.sequence_parallel, p.hsdp_reduce)

    def llama_config(self) -> LlamaConfig:
        from overlapcfg.demo.llama import LlamaConfig  # torch: only once the settings are known to be valid

        return LlamaConfig(**self.model.model_dump(), max_seq_len=self.seq_len)


_FIELDS = ("model", "sharding", "parallel", "world_size", "reshard_after_forward", "batch", "seq_len")


def demo_settings(composed: dict[str, Any]) -> DemoSettings:
    """The demo settings out of the composed job config (other keys, such as ``overlap``, are not ours)."""
    return validate_config(DemoSettings, {k: composed[k] for k in _FIELDS if k in composed}, root="",
                           header="invalid demo settings")

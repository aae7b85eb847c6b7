"""The demo job's own settings (``model.*``, ``world_size``, ...), validated like every other config: one pydantic
model, faults at their command-line paths, closest field names for typos; no parsing of error texts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from overlapcfg.config.base import ConfigModel
from overlapcfg.config.load import validate_config

if TYPE_CHECKING:
    from overlapcfg.demo.llama import LlamaConfig

__all__ = ["SHARDINGS", "DemoModel", "DemoSettings", "Sharding", "demo_settings"]

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


class DemoSettings(ConfigModel):
    """What to trace: the demo model's sizes and the sharding."""

    model: DemoModel = DemoModel()
    sharding: Sharding = "simple_fsdp"
    """How the demo is sharded: ``simple_fsdp`` (traced, the graph pass) or ``fsdp2`` (eager, ``fully_shard``)."""
    world_size: int = Field(2, ge=1)
    """FSDP ranks the step is sharded for; one process traces (or shards) rank 0 under a fake process group."""
    reshard_after_forward: bool = True
    """Free unsharded parameters after forward and all-gather them again in backward (FSDP2's default)."""
    batch: int = Field(2, ge=1)
    seq_len: int = Field(16, ge=1)

    def llama_config(self) -> LlamaConfig:
        from overlapcfg.demo.llama import LlamaConfig  # torch: only once the settings are known to be valid

        return LlamaConfig(**self.model.model_dump(), max_seq_len=self.seq_len)


_FIELDS = ("model", "sharding", "world_size", "reshard_after_forward", "batch", "seq_len")


def demo_settings(composed: dict[str, Any]) -> DemoSettings:
    """The demo settings out of the composed job config (other keys, such as ``overlap``, are not ours)."""
    return validate_config(DemoSettings, {k: composed[k] for k in _FIELDS if k in composed}, root="",
                           header="invalid demo settings")

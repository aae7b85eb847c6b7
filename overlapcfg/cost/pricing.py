"""How a prediction prices the step besides the hardware: activation checkpointing, kernel fusion, the optimizer,
the attention backend, tokens per step. One frozen model, taken by ``simulate``, ``explain``, ``compare``,
``tune`` and ``measure`` alike (``pricing=``, or the command's ``predict`` group), so every number a report prints
says what it assumed.

- ``activation_checkpointing``: ``as_traced`` prices the recompute the graphs hold (a model traced with
  ``torch.utils.checkpoint``, torchtitan's selective or full AC, Hugging Face ``gradient_checkpointing_enable()``:
  the backward graph recomputes forward ops, and those nodes are priced like any other); ``selective`` and
  ``full`` price a mode for a step traced without checkpointing (``overlapcfg.cost.recompute``): ``full``
  recomputes each repeated block's whole forward before its backward; ``selective`` is torchtitan's per-op policy
  (every second matmul and every memory-bound op of a block recomputed, attention and the other matmuls saved).
  ``none`` asserts the trace recomputes nothing a checkpoint would (it prices as traced, and refuses a trace that
  checkpoints). A mode the model cannot price is an error naming this field.
- ``fusion``: ``inductor`` prices memory-bound ops as inductor fuses them on a compiled route (one kernel per
  connected group of them, reading what comes from outside the group and writing what leaves it); ``eager`` one
  kernel per op (what an eager graph module runs: ``overlapcfg.measure``'s graphs); ``auto`` is ``inductor`` on a
  GPU profile and ``eager`` on a CPU one.
- ``optimizer`` and ``grad_clip``: the optimizer step over this rank's shard after the backward (AdamW reads the
  fp32 parameter, gradient and two moments and writes three of them back: 28 bytes a parameter; SGD 12), and the
  gradient-norm clipping (a pass over the gradients, one all-reduce of the norm across the shard group, a scaling
  pass), for steps traced without them. A step whose graphs hold the optimizer is priced as traced: leave both off.
- ``attention_backend``: the fused attention kernel priced (a backend of the profile's ``achievable.attention``);
  null: the profile's default.
- ``tokens`` and ``model_params``: tokens one rank processes per step and the model's parameters, for tokens/s and
  MFU (``overlapcfg.cost.throughput``); null: read off the step's graphs.
- ``between_graphs_seconds``: the step's own work between two of its graphs that neither graph holds (a loss
  computed eagerly after a compiled forward, autograd's start of the backward). It is not on the predicted clock
  (a prediction is the graphs' time), but no collective brings the ranks together across it: they drift apart
  there, and the next graph's first blocking collective waits for the last of them (``Skew``). Measured on 2 gloo
  ranks here (2026-12-07, the demo's eager cross-entropy over 1,024 x 8,192 logits, forward and backward): 55-75 ms
  between the forward and the backward graphs on a quiet machine, against 107-253 ms inside them; 102-128 ms
  beside another 2-rank job. null: none (``overlapcfg.measure`` fills it in from the timed steps of its reference
  config, the same code in every config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import Field

from overlapcfg.config.base import ConfigModel, measured
from overlapcfg.config.load import validate_config

__all__ = ["ACMode", "Fusion", "Optimizer", "Pricing", "pricing_from"]

ACMode: TypeAlias = Literal["as_traced", "none", "selective", "full"]
Fusion: TypeAlias = Literal["auto", "inductor", "eager"]
Optimizer: TypeAlias = Literal["none", "sgd", "adamw"]
HEADER = "invalid prediction settings"


class Pricing(ConfigModel):
    """What a prediction assumes besides the hardware (see the module docstring)."""

    activation_checkpointing: ACMode = "as_traced"
    """``as_traced`` (recompute the graphs hold), ``none``, ``selective`` (torchtitan's per-op policy) or ``full``
    (each block's forward again before its backward); the last two for a step traced without checkpointing."""
    fusion: Fusion = "auto"
    """``inductor`` (memory-bound ops fused as a compiled route runs them), ``eager`` (one kernel per op) or
    ``auto`` (inductor on a GPU profile, eager on a CPU one)."""
    optimizer: Optimizer = "none"
    """The optimizer step priced after the backward, over this rank's shard (``none``: not priced)."""
    grad_clip: bool = False
    """Price gradient-norm clipping: a pass over the gradients, an all-reduce of the norm, a scaling pass."""
    attention_backend: str | None = None
    """The fused attention kernel priced; null: the profile's default backend."""
    tokens: int | None = Field(None, ge=1)
    """Tokens one rank processes per step (tokens/s and MFU); null: the step's integer inputs' size."""
    model_params: int | None = Field(None, ge=1)
    """The model's parameters as one rank computes with them (MFU's ``N``); null: read off the forward's FSDP
    all-gathers."""
    between_graphs_seconds: Annotated[float, measured("seconds", 0.0, 3600.0, example="up to an hour")] | None = None
    """Seconds of the step's own work between consecutive graphs, outside both (the ranks drift apart across it);
    null: none."""

    def fusion_for(self, device_kind: str) -> Literal["inductor", "eager"]:
        """The fusion priced on a device of ``device_kind`` (``auto`` resolved)."""
        if self.fusion != "auto":
            return self.fusion
        return "inductor" if device_kind == "gpu" else "eager"


DEFAULT = Pricing()


def pricing_from(value: Pricing | Mapping[str, Any] | None, *, path: str = "pricing") -> Pricing:
    """A ``Pricing`` from itself, a mapping (faults name ``path``: ``predict.activation_checkpointing``) or None
    (the defaults)."""
    if value is None:
        return DEFAULT
    if isinstance(value, Pricing):
        return value
    return validate_config(Pricing, dict(value), root=path, header=HEADER)

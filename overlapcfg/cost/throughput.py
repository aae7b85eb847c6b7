"""The numbers people compare: tokens per second per GPU and MFU, beside every predicted step.

MFU is model FLOPs over what the device could do in the step: ``6 x N x tokens / (step x dense peak)``, with ``N``
the model's parameters (as this rank computes with them: gathered, so the whole model under FSDP and a tensor-
parallel rank's share under TP) and ``tokens`` what this rank processes per step; the peak is the datasheet's dense
figure for the dtype the step is costed in (``HardwareProfile.dense_peak``). Beside it, the graph's own FLOPs
(torch's counter over every kernel of the step, attention and recompute included) over the same: the hardware
FLOPs utilization, which recompute and attention push above MFU.

``step_facts`` reads ``N`` and ``tokens`` off the graphs: ``N`` from the forward's parameter all-gathers (each
parameter gathered once, merged or not), ``tokens`` from the forward's integer inputs (token ids, targets,
positions: they must agree on their size, else there is no telling which is the batch); ``Pricing.tokens`` and
``Pricing.model_params`` say it where the graphs cannot (no FSDP all-gather, no integer input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from overlapcfg.cost.price import iter_tensors, node_kind
from overlapcfg.cost.pricing import Pricing
from overlapcfg.graph.collectives import find_collectives

__all__ = ["StepFacts", "Throughput", "step_facts", "throughput"]


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What throughput needs from the step: tokens a rank processes, the model's parameters, the costed dtype."""

    tokens: int | None = None
    params: int | None = None
    dtype: str = "float32"
    why: str = ""
    """Why ``tokens`` or ``params`` is unknown, for reports."""


def _forward(graphs: Sequence[fx.GraphModule], names: Sequence[str]) -> fx.GraphModule | None:
    if "forward" in names:
        return graphs[list(names).index("forward")]
    return graphs[0] if graphs else None


def step_facts(graphs: Sequence[fx.GraphModule], names: Sequence[str], pricing: Pricing,
               as_dtype: torch.dtype | None) -> StepFacts:
    """See the module docstring."""
    forward = _forward(graphs, names)
    why = []
    tokens = pricing.tokens
    params = pricing.model_params
    dtype = str(as_dtype).removeprefix("torch.") if as_dtype is not None else None
    if forward is not None:
        if tokens is None:
            sizes = {int(t.numel()) for n in forward.graph.nodes if n.op == "placeholder"
                     for t in iter_tensors(n.meta.get("val")) if not t.is_floating_point() and t.dim() >= 1
                     and t.dtype in (torch.int64, torch.int32)}
            if len(sizes) == 1:
                tokens = sizes.pop()
            else:
                why.append("tokens: " + ("no integer input" if not sizes else
                                         f"integer inputs of {len(sizes)} sizes") + " (set tokens)")
        if params is None:
            gathers = [c for c in find_collectives(forward.graph, lambda _node: None) if c.role == "fsdp_all_gather"]
            if gathers:
                params = sum(int(t.numel()) for c in gathers for t in iter_tensors(c.start.meta.get("val")))
            else:
                why.append("parameters: no FSDP all-gather in the forward (set model_params)")
        if dtype is None:
            dtype = next((str(t.dtype).removeprefix("torch.") for n in forward.graph.nodes
                          if n.op == "call_function" and node_kind(n) == "compute"
                          for t in iter_tensors(n.meta.get("val")) if t.is_floating_point()), "float32")
    return StepFacts(tokens=tokens, params=params, dtype=dtype or "float32", why="; ".join(why))


@dataclass(frozen=True, slots=True)
class Throughput:
    tokens_per_second: float | None
    """Per GPU (this rank's tokens per step over the step)."""
    mfu: float | None
    """``6 N tokens / (step x dense peak)``."""
    graph_mfu: float | None
    """The graph's own FLOPs over ``step x dense peak``."""


def throughput(facts: StepFacts, step_seconds: float, graph_flops: float, dense_peak: float) -> Throughput:
    """Tokens/s per GPU, MFU and the graph's FLOPs utilization of a step of ``step_seconds``."""
    if step_seconds <= 0 or dense_peak <= 0:
        return Throughput(None, None, None)
    tokens = facts.tokens / step_seconds if facts.tokens else None
    mfu = 6 * facts.params * facts.tokens / (step_seconds * dense_peak) if facts.tokens and facts.params else None
    return Throughput(tokens, mfu, graph_flops / (step_seconds * dense_peak) if graph_flops else None)

"""One step's pricing plan: everything a node's price depends on besides the node, worked out once per step and
shared by the simulator and the tuner's profile (``overlapcfg.cost.simulator.node_seconds`` reads it).

``step_plan(graphs, names, hw, pricing, ...)`` reads the step's graphs once for:

- attention: each SDPA region as one fused kernel (``overlapcfg.cost.attention``);
- fusion: on a compiled route, what each memory-bound node moves inside its fused group
  (``overlapcfg.cost.fusion``);
- recompute: what activation checkpointing recomputes, found in the trace or added by a chosen mode
  (``overlapcfg.cost.recompute``: the nodes here, their seconds by ``overlapcfg.cost.pricer.priced_plan``);
- the optimizer step and gradient clipping after the backward, over this rank's shard (``OptimizerStep``);
- the step's model facts for throughput: tokens a rank processes per step and the model's parameters
  (``overlapcfg.cost.throughput``).

None of it depends on the machine beyond its device kind (which picks the fusion), so a caller that prices the same
unchanged graphs on many machines (the tuner: its profile and the competitors, search after search) can keep the
plans: ``step_plans_kept(store)``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Hashable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from overlapcfg.cost.attention import EMPTY, AttentionPlan, AttentionRole, attention_plan
from overlapcfg.cost.fusion import chain_nodes, fusion_plan
from overlapcfg.cost.hardware import HardwareProfile
from overlapcfg.cost.price import collective_cost, memory_rate
from overlapcfg.cost.pricing import Pricing
from overlapcfg.cost.recompute import Recompute, RecomputeShape, recompute_shape
from overlapcfg.cost.throughput import StepFacts, step_facts

__all__ = ["OptimizerStep", "StepPlan", "optimizer_step", "step_plan", "step_plans_kept"]

OPTIMIZER_BYTES = {"sgd": 12, "adamw": 28}
"""Bytes an optimizer moves per fp32 parameter of the shard: SGD reads the parameter and its gradient and writes
the parameter (3 x 4); AdamW also reads and writes its two moments (7 x 4), one fused pass (foreach / fused
kernels)."""
CLIP_BYTES = 12
"""Gradient-norm clipping per fp32 gradient: one read for the norm, one read and one write to scale it."""


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """What runs after the backward: the optimizer over this rank's shard and gradient clipping."""

    seconds: float = 0.0
    """Compute-stream seconds (bandwidth-bound passes and their launches)."""
    norm_ranks: int = 1
    """Ranks the gradient norm is all-reduced over (the shard group); 1: no all-reduce."""
    norm_seconds: float = 0.0
    """The norm's all-reduce (one fp32 scalar: latency-bound), blocking: clipping needs the total."""
    describe: str = "none"


@dataclass(frozen=True, slots=True)
class StepPlan:
    """See the module docstring. Per graph by position in the sequence given to ``step_plan``."""

    pricing: Pricing
    fusion: str
    """``inductor`` or ``eager``, ``Pricing.fusion`` resolved for the profile's device."""
    attention: AttentionPlan = EMPTY
    fused: tuple[Mapping[fx.Node, tuple[int, int, bool]], ...] = ()
    chains: tuple[frozenset[fx.Node], ...] = ()
    """Per graph, the nodes of collective chains (``overlapcfg.cost.fusion.chain_nodes``): priced by bytes alone."""
    recompute: Recompute = field(default_factory=lambda: Recompute("as traced"))
    """The recompute priced (``overlapcfg.cost.pricer.priced_plan`` fills it in from ``recompute_nodes``)."""
    recompute_nodes: RecomputeShape = field(default_factory=lambda: RecomputeShape("as traced"))
    """What ``pricing.activation_checkpointing`` recomputes, before pricing."""
    facts: StepFacts = field(default_factory=StepFacts)

    def role(self, graph: int, node: fx.Node) -> AttentionRole | None:
        return self.attention.role(graph, node)

    def fused_bytes(self, graph: int, node: fx.Node) -> tuple[int, int, bool] | None:
        return self.fused[graph].get(node) if graph < len(self.fused) else None

    def fixed_costs(self, graph: int, node: fx.Node) -> bool:
        """Whether ``node`` pays per-kernel and per-view costs (not in a collective's chain)."""
        return graph >= len(self.chains) or node not in self.chains[graph]

    def extra(self, graph: int, node: fx.Node) -> float:
        """Seconds a chosen checkpointing mode adds at ``node`` (the recompute its block starts with)."""
        return self.recompute.at.get(node, 0.0)

    @property
    def eager(self) -> bool:
        return self.fusion == "eager"


_KEPT: contextvars.ContextVar[MutableMapping[Hashable, StepPlan] | None] = contextvars.ContextVar(
    "overlapcfg_kept_step_plans", default=None)


@contextlib.contextmanager
def step_plans_kept(store: MutableMapping[Hashable, StepPlan]) -> Iterator[None]:
    """Within the block, ``step_plan`` answers from ``store`` for graphs it planned before with the same settings,
    and keeps what it plans there. For a caller that prices the same graphs, unchanged, on many machines, and owns
    them as long as ``store`` (the keys hold the graph modules, so no other graph can be mistaken for one)."""
    token = _KEPT.set(store)
    try:
        yield
    finally:
        _KEPT.reset(token)


def step_plan(graphs: Sequence[fx.GraphModule], names: Sequence[str], hw: HardwareProfile, pricing: Pricing, *,
              as_dtype: torch.dtype | None = None, path: str = "pricing.activation_checkpointing") -> StepPlan:
    """The plan of a step (see the module docstring), the recompute's nodes found but not priced (a mode the model
    cannot price is an ``OverlapConfigError`` at ``path``); kept where a ``step_plans_kept`` block is open."""
    fusion = pricing.fusion_for(hw.device_kind)
    store = _KEPT.get()
    key = (tuple(graphs), tuple(names), pricing, fusion, as_dtype)
    if store is not None and key in store:
        return store[key]
    chains = tuple(frozenset(chain_nodes(g)) for g in graphs)
    fused = tuple(fusion_plan(g, as_dtype, set(c)) for g, c in zip(graphs, chains, strict=True)) \
        if fusion == "inductor" else ()
    plan = StepPlan(pricing=pricing, fusion=fusion, attention=attention_plan(graphs), fused=fused, chains=chains,
                    recompute_nodes=recompute_shape(graphs, names, pricing.activation_checkpointing, path=path,
                                                    chains=chains),
                    facts=step_facts(graphs, names, pricing, as_dtype))
    if store is not None:
        store[key] = plan
    return plan


def optimizer_step(plan: StepPlan, hw: HardwareProfile, shard_params: int, shard_ranks: int) -> OptimizerStep:
    """``Pricing.optimizer`` and ``grad_clip`` over ``shard_params`` fp32 parameters of this rank's shard, the
    norm all-reduced over ``shard_ranks`` (the collective priced by the caller, which owns the streams)."""
    pricing = plan.pricing
    passes, nbytes = 0, 0
    parts = []
    if pricing.optimizer != "none":
        passes += 1
        nbytes += OPTIMIZER_BYTES[pricing.optimizer] * shard_params
        parts.append(f"{pricing.optimizer} over {shard_params / 1e6:.4g}M shard parameters")
    if pricing.grad_clip:
        passes += 2
        nbytes += CLIP_BYTES * shard_params
        parts.append("gradient clipping")
    if not passes:
        return OptimizerStep()
    launch = hw.achievable.memory.launch_seconds if hw.achievable is not None else 0.0
    ranks = shard_ranks if pricing.grad_clip else 1
    norm = collective_cost("all_reduce", 4, hw, ranks).seconds if ranks > 1 else 0.0
    return OptimizerStep(seconds=nbytes / memory_rate(hw) + passes * launch, norm_ranks=ranks, norm_seconds=norm,
                         describe=", ".join(parts))

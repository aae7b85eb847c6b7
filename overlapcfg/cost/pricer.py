"""What one compute-stream node costs, and a step's pricing plan with its recompute priced: the one rule the
simulator (``overlapcfg.cost.simulator``) and the tuner's profile (``overlapcfg.tuning.profile``) both call, so
the quick score and the full simulation price every node alike.

A node is priced, first match wins:

1. measured: its duration in ``node_costs`` (same graph, same name, same kernel on the same tensors);
2. attention: the carrier of an SDPA region as the one fused kernel trainers run, the region's other nodes free
   (``overlapcfg.cost.attention``), a fused kernel already in the graph by its backend's rate;
3. the kernel model (``overlapcfg.cost.price.compute_seconds``): achievable rates by kind and shape, memory-bound
   nodes by what their fused group moves on a compiled route (``overlapcfg.cost.fusion``);

plus what a chosen checkpointing mode recomputes where the block's backward starts
(``overlapcfg.cost.recompute``). Where node costs are given, the unmeasured nodes stand on their footing
(``overlapcfg.cost.node_costs.Footing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import fx

from overlapcfg.cost.attention import FusedAttention, fused_seconds, kept_attention
from overlapcfg.cost.hardware import HardwareProfile
from overlapcfg.cost.node_costs import Footing, NodeCosts
from overlapcfg.cost.prediction import ComputePart
from overlapcfg.cost.price import compute_seconds, node_flops, node_kind
from overlapcfg.cost.pricing import Pricing
from overlapcfg.cost.pricing_plan import StepPlan, step_plan
from overlapcfg.cost.recompute import priced_recompute

__all__ = ["NodePrice", "measured_footing", "node_seconds", "priced_plan"]


class NodePrice(NamedTuple):
    seconds: float
    kind: str
    """``compute`` or ``memory`` (which bound it), ``free``."""
    source: str
    """``measured``, ``achievable`` (the profile's achievable rates) or ``roofline`` (its bare peaks)."""
    bytes: int
    part: ComputePart
    flops: float
    """FLOPs it runs by torch's counter (a fused attention kernel's whole call), for the graph's FLOPs."""


def node_seconds(node: fx.Node, graph: str, hw: HardwareProfile, node_costs: NodeCosts | None, *,
                 world_size: int | None, traced_world_size: int | None, as_dtype: torch.dtype | None,
                 plan: StepPlan | None = None, graph_index: int = 0,
                 footing: Footing | None = None) -> NodePrice:
    """A compute-stream node's price (see the module docstring); ``plan`` is the step's (``priced_plan``), the
    node's graph at ``graph_index`` of it (None: no attention regions, fusion or recompute)."""
    kind = node_kind(node)
    role = plan.role(graph_index, node) if plan is not None else None
    part: ComputePart = "attention" if role is not None else \
        "matmul" if kind == "compute" else "memory" if kind == "memory" else "other"
    extra = plan.extra(graph_index, node) if plan is not None else 0.0
    source = "achievable" if hw.achievable is not None else "roofline"
    measured = node_costs.seconds(graph, node) if node_costs is not None else None
    if measured is not None:
        return NodePrice(measured + extra, "memory" if kind == "free" else kind, "measured", 0, part,
                         _flops(node, role))
    if isinstance(role, FusedAttention):
        seconds, bound, nbytes = fused_seconds(role, hw, as_dtype, plan.pricing.attention_backend if plan else None)
        return NodePrice(seconds + extra, bound, source, nbytes, part, role.flops)
    if role == "folded":  # into its region's fused kernel
        return NodePrice(extra, "free", source, 0, part, 0)
    kept = kept_attention(node) if role == "kept" and hw.achievable is not None and \
        hw.achievable.attention is not None else None
    if kept is not None:
        seconds, bound, nbytes = fused_seconds(kept, hw, as_dtype, plan.pricing.attention_backend if plan else None)
        return NodePrice(seconds + extra, bound, source, nbytes, part, kept.flops)
    cost = compute_seconds(node, hw, world_size=world_size, traced_world_size=traced_world_size, as_dtype=as_dtype,
                           fused=plan.fused_bytes(graph_index, node) if plan is not None else None,
                           eager=plan.eager if plan is not None else False,
                           fixed=plan.fixed_costs(graph_index, node) if plan is not None else True)
    seconds = footing.price(kind, cost.seconds) if footing is not None else cost.seconds
    return NodePrice(seconds + extra, cost.bound, source, cost.bytes, part, cost.flops)


def _flops(node: fx.Node, role: object) -> float:
    if isinstance(role, FusedAttention):
        return role.flops
    if role == "folded":
        return 0
    return node_flops(node) if node_kind(node) == "compute" else 0


def measured_footing(graphs: Sequence[tuple[str, fx.GraphModule]], hw: HardwareProfile, node_costs: NodeCosts, *,
                     world_size: int | None, traced_world_size: int | None, as_dtype: torch.dtype | None,
                     plan: StepPlan | None = None) -> Footing:
    """``node_costs``' footing (``NodeCosts.footing``) against the kernel model ``node_seconds`` prices an
    unmeasured node by (under ``plan``: its fusion, eager views, chains)."""
    index = {name: i for i, (name, _) in enumerate(graphs)}
    owner = {node: index[name] for name, gm in graphs for node in gm.graph.nodes}

    def model(node: fx.Node) -> float:
        gi = owner[node]
        return compute_seconds(node, hw, world_size=world_size, traced_world_size=traced_world_size,
                               as_dtype=as_dtype, fused=plan.fused_bytes(gi, node) if plan is not None else None,
                               eager=plan.eager if plan is not None else False,
                               fixed=plan.fixed_costs(gi, node) if plan is not None else True).seconds

    return node_costs.footing(graphs, model)


def priced_plan(graphs: Sequence[fx.GraphModule], names: Sequence[str], hw: HardwareProfile, pricing: Pricing, *,
                world_size: int | None, traced_world_size: int | None, as_dtype: torch.dtype | None,
                node_costs: NodeCosts | None = None,
                path: str = "pricing.activation_checkpointing") -> tuple[StepPlan, Footing | None]:
    """The step's plan (``overlapcfg.cost.pricing_plan.step_plan``) with its recompute priced by ``node_seconds`` under
    that plan, and the footing of ``node_costs`` under it (None without); a checkpointing mode that cannot be priced
    is an ``OverlapConfigError`` at ``path``."""
    plan = step_plan(graphs, names, hw, pricing, as_dtype=as_dtype, path=path)
    footing = measured_footing(list(zip(names, graphs, strict=True)), hw, node_costs, world_size=world_size,
                               traced_world_size=traced_world_size, as_dtype=as_dtype, plan=plan) \
        if node_costs is not None else None

    def price(gi: int, node: fx.Node) -> float:
        return node_seconds(node, names[gi], hw, node_costs, world_size=world_size,
                            traced_world_size=traced_world_size, as_dtype=as_dtype, plan=plan, graph_index=gi,
                            footing=footing).seconds

    return replace(plan, recompute=priced_recompute(plan.recompute_nodes, price)), footing

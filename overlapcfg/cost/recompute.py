"""Activation checkpointing: the recompute a trace holds, and the recompute a chosen mode adds to one that has none.

**As traced.** A model that checkpoints (``torch.utils.checkpoint``, torchtitan's selective or full AC, Hugging
Face ``gradient_checkpointing_enable()``) is traced with its recompute in the backward graph: aot's partitioner
copies the forward ops it recomputes into the backward, keeping their names. A backward node with the name and op
of a forward node, running the same kernel on the same tensors, is such a copy (``traced_recompute``). They are
priced like every node; this module counts them for the report (the partitioner also recomputes cheap
memory-bound ops on its own, without any checkpointing; a trace *checkpoints* when it recomputes FLOP-counted ones
of a checkpointed region, whose nodes carry the region's policy in ``meta["recompute"]``).

**A chosen mode.** For a step traced without checkpointing (the demo, ``trace_train_step``), ``selective`` and
``full`` add what that mode would recompute, per repeated block: the modules whose path ends in an index
(``layers.3``, ``model.layers.3``), which is what torchtitan and Hugging Face checkpoint (the embedding, final norm,
head and loss are not):

- ``full``: every forward node of the block (its matmuls, its fused attention, its memory-bound ops), recomputed
  before the block's backward;
- ``selective``: torchtitan's per-op policy (``SelectiveAC``): of the block's matmuls (``mm``/``addmm``, in forward
  order) every second one is recomputed and the others saved; attention and other FLOP-heavy ops are saved; every
  memory-bound op is recomputed.

The seconds are the forward nodes' own prices (``price``), charged to the block's first backward matmul: the
backward starts that block by recomputing it, and a matmul is never part of a collective's chain, so the tuner's
quick model and the full simulation charge it at the same place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import fx

from overlapcfg.cost.node_costs import node_signature
from overlapcfg.cost.price import node_flops, node_kind
from overlapcfg.errors import OverlapConfigError
from overlapcfg.graph.attribution import module_fqn

__all__ = ["Recompute", "RecomputeShape", "block_of", "priced_recompute", "recompute_shape", "traced_recompute"]

_SELECTIVE_MATMULS = ("aten.mm.default", "aten.addmm.default")
"""The matmuls torchtitan's selective policy counts (``aten.mm``; a linear with a bias traces to ``addmm``)."""


def block_of(path: str | None) -> str | None:
    """The repeated block a module path belongs to: its shortest prefix ending in an integer segment
    (``layers.3.attention.wq`` -> ``layers.3``); None outside any (``tok_embeddings``, ``norm``)."""
    if not path:
        return None
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def traced_recompute(forward: fx.GraphModule, backward: fx.GraphModule) -> list[fx.Node]:
    """Backward nodes that recompute a forward one: the same name (aot's partitioner copies the joint graph's
    node) and the same kernel on the same tensors (``overlapcfg.cost.node_costs.node_signature``: graphs built
    apart may share a name by chance); kernels only, not views or collectives; graph order."""
    kernels = {n.name: node_signature(n) for n in forward.graph.nodes
               if n.op == "call_function" and node_kind(n) in ("compute", "memory")}
    return [n for n in backward.graph.nodes if n.op == "call_function" and n.name in kernels
            and node_kind(n) in ("compute", "memory") and kernels[n.name] == node_signature(n)]


@dataclass(frozen=True, slots=True)
class Recompute:
    """The recompute a prediction priced."""

    mode: str
    """``as traced``, ``none``, ``selective`` or ``full``."""
    nodes: int = 0
    """Forward nodes recomputed (found in the trace, or added by the mode)."""
    flops: int = 0
    """Their FLOPs (torch's counter)."""
    seconds: float = 0.0
    """Their seconds as priced."""
    forward_flops: int = 0
    """The forward graph's FLOPs, for the share."""
    at: Mapping[fx.Node, float] = field(default_factory=dict)
    """Added seconds per backward node (``selective``/``full``): charged where the block's backward starts."""

    def describe(self) -> str:
        """``selective: +41.2 GFLOP recomputed (12 % of the forward), 38.1 ms``, for reports."""
        if not self.nodes:
            return f"{self.mode}: no recompute"
        share = f" ({100 * self.flops / self.forward_flops:.0f} % of the forward)" if self.forward_flops else ""
        verb = "found in the trace" if self.mode == "as traced" else "added"
        return (f"{self.mode}: {self.nodes} nodes, {self.flops / 1e9:.4g} GFLOP recomputed{share}, "
                f"{1e3 * self.seconds:.4g} ms, {verb}")


@dataclass(frozen=True, slots=True)
class RecomputeShape:
    """What a mode recomputes in a step before anything is priced: graph facts only, so a step priced on several
    machines (the tuner's searches) works them out once (``overlapcfg.cost.pricing_plan.step_plans_kept``)."""

    mode: str
    """As ``Recompute.mode``."""
    groups: tuple[tuple[int, tuple[fx.Node, ...], fx.Node | None], ...] = ()
    """``(graph index, nodes, where)``: nodes priced in that graph, their seconds charged at ``where`` (a block's
    first backward matmul) or only counted (None: recompute found in the trace, priced where it stands)."""
    flops: int = 0
    forward_flops: int = 0

    @property
    def nodes(self) -> int:
        return sum(len(nodes) for _, nodes, _ in self.groups)


def priced_recompute(shape: RecomputeShape, price: Callable[[int, fx.Node], float]) -> Recompute:
    """``shape`` with its nodes' seconds: ``price(graph index, node)`` is a node's seconds as priced."""
    at: dict[fx.Node, float] = {}
    seconds = 0.0
    for gi, nodes, where in shape.groups:
        cost = sum(price(gi, n) for n in nodes)
        seconds += cost
        if where is not None:
            at[where] = at.get(where, 0.0) + cost
    return Recompute(shape.mode, nodes=shape.nodes, flops=shape.flops, seconds=seconds,
                     forward_flops=shape.forward_flops, at=at)


def recompute_shape(graphs: Sequence[fx.GraphModule], names: Sequence[str], mode: str, *,
                    path: str = "pricing.activation_checkpointing",
                    chains: Sequence[frozenset[fx.Node]] = ()) -> RecomputeShape:
    """What ``mode`` recomputes in the step ``graphs`` (forward then backward, named ``names``), before pricing.
    ``chains``: per graph, the nodes of collective chains (a bucket's copies, a shard's cast): not the model's
    compute, never recomputed by a mode, and what the bucketing pass changes (so the recompute is the same
    whatever the grouping). A mode the model cannot price here is an ``OverlapConfigError`` at ``path``."""
    if "forward" not in names or "backward" not in names:
        if mode in ("selective", "full"):
            raise OverlapConfigError.single(path, f"{mode!r} needs the step's forward and backward graphs (got "
                                                  f"{', '.join(names)}); price a whole step, or as_traced")
        return RecomputeShape(mode.replace("_", " "))
    fi, bi = list(names).index("forward"), list(names).index("backward")
    forward, backward = graphs[fi], graphs[bi]
    found = traced_recompute(forward, backward)
    forward_flops = sum(node_flops(n) for n in forward.graph.nodes if node_kind(n) == "compute")
    # Checkpointing, as opposed to the partitioner recomputing cheap ops on its own: FLOP-counted recompute from a
    # checkpointed region (its nodes carry the region's policy, ``meta["recompute"]``).
    checkpoints = [n for n in found if node_kind(n) == "compute" and n.meta.get("recompute") is not None]
    if mode in ("as_traced", "none"):
        if mode == "none" and checkpoints:
            raise OverlapConfigError.single(path, (
                f"'none', but the trace recomputes {len(checkpoints)} FLOP-counted forward nodes in its backward "
                f"({checkpoints[0].name}, ...): it was traced with activation checkpointing; predict with "
                "as_traced, or trace the model without checkpointing"))
        return RecomputeShape("as traced" if mode == "as_traced" else "none", groups=((bi, tuple(found), None),),
                              flops=sum(node_flops(n) for n in found), forward_flops=forward_flops)
    if mode not in ("selective", "full"):
        raise OverlapConfigError.single(path, f"cannot price activation checkpointing {mode!r}; the modes are "
                                              "as_traced, none, selective, full")
    if checkpoints:
        raise OverlapConfigError.single(path, (
            f"{mode!r} prices checkpointing for a step traced without it, but this trace already recomputes "
            f"{len(checkpoints)} FLOP-counted forward nodes ({checkpoints[0].name}, ...); predict with as_traced"))
    chosen: dict[str, list[fx.Node]] = {}
    counts: dict[str, int] = {}
    skip = chains[fi] if fi < len(chains) else frozenset()
    for node in forward.graph.nodes:
        kind = node_kind(node)
        if kind not in ("compute", "memory") or node in skip:
            continue
        block = block_of(module_fqn(node))
        if block is None:
            continue
        if mode == "full" or kind == "memory":
            chosen.setdefault(block, []).append(node)
        elif str(node.target) in _SELECTIVE_MATMULS:
            counts[block] = counts.get(block, 0) + 1
            if counts[block] % 2 == 0:
                chosen.setdefault(block, []).append(node)
    if not chosen:
        raise OverlapConfigError.single(path, (
            f"{mode!r}: no repeated blocks to checkpoint (no forward node belongs to a module whose path ends in an "
            "index, like layers.3); this model's checkpointing cannot be priced: trace it with checkpointing and "
            "predict as_traced"))
    starts = _block_starts(backward, set(chosen))
    groups = []
    for block, nodes in chosen.items():
        where = starts.get(block) or next((n for n in backward.graph.nodes if node_kind(n) == "compute"), None)
        groups.append((fi, tuple(nodes), where))
    return RecomputeShape(mode, groups=tuple(groups), flops=sum(node_flops(n) for ns in chosen.values() for n in ns),
                          forward_flops=forward_flops)


def _block_starts(backward: fx.GraphModule, blocks: set[str]) -> dict[str, fx.Node]:
    """Each block's first FLOP-counted backward node (graph order)."""
    out: dict[str, fx.Node] = {}
    for node in backward.graph.nodes:
        if node.op != "call_function" or node_kind(node) != "compute":
            continue
        block = block_of(module_fqn(node))
        if block in blocks and block not in out:
            out[block] = node
    return out

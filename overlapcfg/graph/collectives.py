"""Finding the collectives of a graph and saying which are FSDP's, which direction they run and who owns them.

Pure reading: nothing here changes a graph. Everything is returned in graph order so later stages can make
deterministic decisions without sorting by anything but positions.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.attribution import ModuleFqnFn
from overlapcfg.graph.meta import META_KEY

__all__ = [
    "Collective",
    "CollectiveKind",
    "Direction",
    "ModuleFqnFn",
    "find_collectives",
    "data_inputs",
    "group_name",
    "is_compute_node",
    "node_direction",
    "collective_kind",
    "is_collective_start",
    "is_parameter_gather",
    "is_parameter_placeholder",
    "parameter_sources",
    "placeholder_sources",
    "started_by",
    "positions",
    "wait_of",
]


CollectiveKind: TypeAlias = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "other"]
"""The one classification of ``_c10d_functional`` collectives (merged and coalesced forms included)."""
Direction: TypeAlias = Literal["forward", "backward"]


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective start and the wait that completes it."""

    start: fx.Node
    waits: tuple[fx.Node, ...]
    """Usually one; a coalesced collective has one per output."""
    kind: CollectiveKind
    fsdp: bool
    """An FSDP parameter all-gather (one parameter in, see ``is_fsdp_all_gather``) or gradient reduce-scatter
    (result flows to the graph outputs through unary ops only)."""
    direction: Direction
    group: str
    dtype: torch.dtype
    unsharded_bytes: int
    """All-gather output / reduce-scatter input: the full-size tensor the collective makes or consumes."""
    module_fqn: str | None
    params: tuple[str, ...] = ()
    """The parameters it carries: FQNs where the aot descriptors name them, else placeholder names (all-gathers),
    read before merging erases the original nodes. Several: an already merged bucket."""


def group_name(start: fx.Node) -> str:
    """The process-group name argument of a ``_c10d_functional`` collective (always its last positional)."""
    arg = start.args[-1]
    if isinstance(arg, fx.Node):  # compile-on-one-rank graphs pass the group as a graph input
        return f"<node {arg.name}>"
    return str(arg)


def wait_of(start: fx.Node) -> fx.Node | None:
    """The single ``wait_tensor`` reading ``start``; ``None`` if there is none or several."""
    waits = [u for u in start.users if compat.is_wait_tensor(u)]
    return waits[0] if len(waits) == 1 else None


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Index of every node in graph order: the only tie-breaker the passes use."""
    return {n: i for i, n in enumerate(graph.nodes)}


_WAIT = compat.WAIT_TENSOR


def data_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """The nodes ``node`` reads (a ``control_deps`` wrapper's ordering edges are not reads)."""
    return compat.unwrap_control_deps(node)[1]  # type: ignore[return-value]


def is_collective_start(node: fx.Node) -> bool:
    """A ``_c10d_functional`` op other than ``wait_tensor`` (what a wait completes)."""
    target = node.target
    return node.op == "call_function" and compat.is_functional_collective(target) and target is not _WAIT


def started_by(node: fx.Node) -> fx.Node | None:
    """If ``node`` is a wait (also one wrapped by ``insert_overlap_deps``), the collective start it waits on."""
    if node.op != "call_function":
        return None
    target, inputs, _ = compat.unwrap_control_deps(node)
    if target is not _WAIT or not inputs or not isinstance(inputs[0], fx.Node):
        return None
    start = inputs[0]
    if start.target is operator.getitem and isinstance(start.args[0], fx.Node):  # coalesced collectives
        start = start.args[0]
    return start if is_collective_start(start) else None


_KINDS: tuple[tuple[str, CollectiveKind], ...] = (
    ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"), ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
)


def collective_kind(node: fx.Node) -> CollectiveKind | None:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``all_to_all`` / ``other`` for a collective start
    (single, ``_coalesced`` and ``into_tensor`` forms alike), ``None`` for anything else."""
    if not is_collective_start(node):
        return None
    name = compat.op_name(node.target)
    return next((kind for key, kind in _KINDS if key in name), "other")


def is_compute_node(node: fx.Node) -> bool:
    """An op with a FLOP formula (matmuls, attention, convolutions): what collectives are meant to hide behind."""
    return compat.flop_formula(node.target) is not None


def _is_transparent(node: fx.Node) -> bool:
    """Ops that move a parameter's elements without computing on them: views, dtype casts, copies, and the
    copy-in of torch's merged buckets. The only ops allowed between a parameter and its FSDP all-gather."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or getattr(target, "is_view", False):
        return True
    return compat.op_name(target) in _TRANSPARENT_OPS


_TRANSPARENT_OPS = frozenset({
    "aten._to_copy", "prims.convert_element_type", "aten.clone", "aten.contiguous", "aten.copy", "aten.copy_",
    "aten.detach", "aten.alias", "aten.lift_fresh_copy", "aten.cat", "aten.reshape", "aten.flatten",
    "aten.split_with_sizes", "aten.split_with_sizes_copy", "aten.split", "aten.empty", "aten.new_empty",
    "aten.empty_strided", "aten.view", "aten.t", "aten.permute", "aten.expand",
    "bucketing._pre_bucket_all_gather", "fsdp.all_gather_copy_in", "aten.foreach_copy", "aten._foreach_copy",
})


def placeholder_sources(start: fx.Node) -> tuple[fx.Node, ...] | None:
    """The placeholders an all-gather reads through transparent ops alone (views, casts, copies, a merged bucket's
    copy-in), in discovery order; ``None`` if any other op lies between (an activation gather: sequence or tensor
    parallel, or a gather of an embedding's *output*).

    One placeholder: an FSDP gather; two or more: a bucket torch's merge helpers (any bucket mode) already merged.
    The walk stops at placeholders and at the first non-transparent op, so it is linear in the copy-in region.
    """
    seen: set[fx.Node] = set()
    stack = list(data_inputs(start))
    found: list[fx.Node] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.append(node)
        elif node.op == "get_attr" or _is_transparent(node):
            stack.extend(data_inputs(node))
        else:
            return None
    return tuple(found)


def parameter_sources(start: fx.Node) -> tuple[str, ...] | None:
    """Names of ``placeholder_sources(start)`` (see there)."""
    found = placeholder_sources(start)
    return None if found is None else tuple(n.name for n in found)


def is_parameter_placeholder(node: fx.Node) -> bool:
    """A graph input that can be a parameter (shard): a floating tensor that is one of the step's own inputs, not a
    saved activation or a tangent.

    aot marks the step's inputs with a ``PlainAOTInput`` descriptor (possibly wrapped for tensor subclasses such
    as DTensor), in forward and, for saved parameters, in backward; saved activations and tangents carry other
    descriptors or none. Graphs without descriptors (inductor's post-grad graph) keep aot's ``primals_N`` names.
    """
    if node.op != "placeholder":
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_floating_point():
        return False  # token ids, masks, sizes: never a parameter
    desc = node.meta.get("desc")
    if desc is not None:
        return compat.is_plain_input_descriptor(desc)
    return node.name.startswith("primals_")


def is_partial_gradient_scatter(start: fx.Node, waits: tuple[fx.Node, ...] | list[fx.Node]) -> bool:
    """A reduce-scatter of one use's gradient of a parameter used twice (tied embeddings): its wait is summed with
    other reduce-scattered partial gradients, and the sum flows to a graph output through unary ops only.

    torch's ``is_fsdp_reduce_scatter`` wants the wait to flow to the output alone, so it misses these; the
    backend's descriptors see them as the parameter's gradient. Both routes must classify them alike.
    """
    if len(waits) != 1 or len(waits[0].users) != 1:
        return False
    total = next(iter(waits[0].users))
    if compat.op_name(total.target) != "aten.add" or not all(started_by(i) is not None
                                                               for i in total.all_input_nodes):
        return False
    cur = total
    for _ in range(32):
        users = list(cur.users)
        if any(u.op == "output" for u in users):
            return True
        if len(users) != 1 or len(users[0].all_input_nodes) != 1:
            return False
        cur = users[0]
    return False


def is_parameter_gather(start: fx.Node) -> bool:
    """An all-gather of parameter inputs through transparent ops alone (one input: FSDP; several: a merged
    bucket)."""
    sources = placeholder_sources(start)
    return bool(sources) and all(is_parameter_placeholder(s) for s in sources)  # type: ignore[union-attr]


def node_direction(node: fx.Node) -> Direction:
    """Which side of autograd a node is on, from aot_autograd's ``autograd_backward`` tag."""
    return "backward" if node.meta.get("autograd_backward", False) else "forward"


def _params(start: fx.Node, kind: str) -> tuple[str, ...]:
    owner = start.meta.get(META_KEY, {}).get("owner")
    if owner is not None:
        return (owner.param_fqn,)
    if kind != "all_gather":
        return ()
    return parameter_sources(start) or ()


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of a node's value: one, or a coalesced collective's list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _nbytes(node: object) -> int:
    if isinstance(node, (list, tuple)):  # a coalesced reduce-scatter's input list
        return sum(_nbytes(n) for n in node)
    if not isinstance(node, fx.Node):
        return 0
    return sum(int(t.numel()) * t.element_size() for t in _tensors(node.meta.get("val")))


def find_collectives(
    graph: fx.Graph,
    module_fqn_fn: ModuleFqnFn,
    *,
    direction: Direction | None = None,
) -> list[Collective]:
    """Every waited ``_c10d_functional`` collective in graph order.

    ``direction`` forces one direction for all (a forward or a backward graph from aot_autograd); ``None`` reads
    it per node (joint graphs). Reduce-scatters are always backward.
    """
    waits_of: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        start = started_by(node)
        if start is not None:
            waits_of.setdefault(start, []).append(node)
    out: list[Collective] = []
    for start, waits in waits_of.items():
        kind = collective_kind(start) or "other"
        ours = start.meta.get(META_KEY, {})
        # Evidence, strongest first: our bucketer merged it, the aot descriptors tied it to a parameter, or (for
        # graphs nobody annotated) its structure: an all-gather fed by parameter inputs through transparent ops
        # only, a reduce-scatter whose result flows to the graph outputs through unary ops only.
        evidence = "bucket" in ours or "owner" in ours
        if kind == "all_gather":
            fsdp = evidence or is_parameter_gather(start)
            size_node = start
        elif kind == "reduce_scatter":
            fsdp = evidence or compat.is_fsdp_reduce_scatter(start) or is_partial_gradient_scatter(start, waits)
            size_node = start.args[0] if isinstance(start.args[0], (fx.Node, list, tuple)) else start
        else:
            fsdp, size_node = False, start
        vals = _tensors(start.meta.get("val"))
        if fsdp and not vals:
            # Sizes drive the byte cap and the report: guessing 0 bytes would silently disable the cap.
            raise RuntimeError(f"overlapcfg.apply: FSDP collective {start.name} has no meta['val'] fake tensor; "
                               "run the pass on a traced graph (aot_autograd or inductor post-grad) that has them")
        dtype = vals[0].dtype if vals else torch.float32
        if kind == "reduce_scatter":
            dirn: Direction = "backward"
        else:
            dirn = direction or node_direction(start)
        out.append(Collective(start, tuple(waits), kind, fsdp, dirn, group_name(start), dtype, _nbytes(size_node),
                              module_fqn_fn(start) if fsdp else None, _params(start, kind) if fsdp else ()))
    index = positions(graph)
    out.sort(key=lambda c: index[c.start])
    return _one_owner_per_shared_gradient(out)


def _one_owner_per_shared_gradient(collectives: list[Collective]) -> list[Collective]:
    """Partial gradients of one shared parameter (tied embeddings: one reduce-scatter per use, summed) belong to
    one module, the one that used the parameter first in forward: the partial whose reduce-scatter backward issues
    last. That is also the owner the aot descriptors name (dynamo names a parameter by its first access), so a
    graph with and without descriptors buckets the same way."""
    sums: dict[fx.Node, list[int]] = {}
    for i, c in enumerate(collectives):
        if c.kind == "reduce_scatter" and c.fsdp and len(c.waits) == 1 and len(c.waits[0].users) == 1:
            total = next(iter(c.waits[0].users))
            if compat.op_name(total.target) == "aten.add":
                sums.setdefault(total, []).append(i)
    for members in sums.values():
        owner = collectives[members[-1]].module_fqn  # graph order: the last issued
        if len(members) > 1 and owner is not None:
            for i in members:
                collectives[i] = dataclasses.replace(collectives[i], module_fqn=owner)
    return collectives

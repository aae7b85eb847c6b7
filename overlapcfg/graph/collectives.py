"""Finding the collectives of a graph and saying which are FSDP's, which direction they run and who owns them.

Pure reading: nothing here changes a graph. Everything is returned in graph order so later stages can make
deterministic decisions without sorting by anything but positions.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from overlapcfg import compat
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
    "parameter_sources",
    "started_by",
    "positions",
    "wait_of",
]


CollectiveKind: TypeAlias = Literal["all_gather", "reduce_scatter", "all_reduce", "other"]
Direction: TypeAlias = Literal["forward", "backward"]
ModuleFqnFn: TypeAlias = Callable[[fx.Node], "str | None"]
"""Maps a node to the FQN of the module it belongs to (``None``: unknown). See ``overlapcfg.demo.tracing.module_fqn``."""


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
    param: str | None = None
    """For an FSDP all-gather: the placeholder it gathers (read before merging erases the original nodes)."""


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


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def data_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """The nodes ``node`` reads (a ``control_deps`` wrapper's ordering edges are not reads)."""
    return compat.unwrap_control_deps(node)[1]  # type: ignore[return-value]


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
    target = start.target
    if start.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
            or target.namespace != "_c10d_functional":
        return None
    return start


def is_compute_node(node: fx.Node) -> bool:
    """An op with a FLOP formula (matmuls, attention, convolutions): what collectives are meant to hide behind."""
    target = node.target
    return getattr(target, "overloadpacket", None) in flop_registry or target in flop_registry


def parameter_sources(start: fx.Node) -> tuple[str, ...] | None:
    """Names of the placeholders an all-gather reads through copies and views alone (graph order of discovery),
    or None if compute lies among its inputs' ancestors (an activation gather: sequence or tensor parallel).

    One parameter: an FSDP gather; two or more: a bucket that torch's merge helpers (any bucket mode) or ours
    already merged. The walk stops at placeholders and at the first compute node, so it is linear in the
    copy-in region and never scans a graph's activations.
    """
    seen: set[fx.Node] = set()
    stack = list(data_inputs(start))
    found: list[str] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.append(node.name)
        elif is_compute_node(node):
            return None
        else:
            stack.extend(data_inputs(node))
    return tuple(found)


def _is_bucketed_all_gather(start: fx.Node) -> bool:
    sources = parameter_sources(start)
    return sources is not None and len(sources) >= 2


def node_direction(node: fx.Node) -> Direction:
    """Which side of autograd a node is on, from aot_autograd's ``autograd_backward`` tag."""
    return "backward" if node.meta.get("autograd_backward", False) else "forward"


def _gathered_placeholder(start: fx.Node) -> str | None:
    """Follow first inputs back (casts, views) to the parameter placeholder an FSDP all-gather reads."""
    cur = start
    while cur.op != "placeholder" and cur.all_input_nodes:
        cur = cur.all_input_nodes[0]
    return cur.name if cur.op == "placeholder" else None


def _kind(node: fx.Node) -> CollectiveKind:
    if compat.is_all_gather_into_tensor(node):
        return "all_gather"
    if compat.is_reduce_scatter_tensor(node):
        return "reduce_scatter"
    if compat.is_all_reduce_tensor(node):
        return "all_reduce"
    return "other"


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return int(val.numel()) * val.element_size()


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
        kind = _kind(start)
        tagged = "bucket" in start.meta.get(META_KEY, {})  # our bucketer merged it from FSDP collectives
        if kind == "all_gather":
            fsdp = tagged or compat.is_fsdp_all_gather(start) or _is_bucketed_all_gather(start)
            size_node = start
        elif kind == "reduce_scatter":
            fsdp = tagged or compat.is_fsdp_reduce_scatter(start)
            size_node = start.args[0] if isinstance(start.args[0], fx.Node) else start
        else:
            fsdp, size_node = False, start
        val = start.meta.get("val")
        if fsdp and not isinstance(val, torch.Tensor):
            # Sizes drive the byte cap and the report: guessing 0 bytes would silently disable the cap.
            raise RuntimeError(f"overlapcfg.apply: FSDP collective {start.name} has no meta['val'] fake tensor; "
                               "run the pass on a traced graph (aot_autograd or inductor post-grad) that has them")
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
        if kind == "reduce_scatter":
            dirn: Direction = "backward"
        else:
            dirn = direction or node_direction(start)
        param = _gathered_placeholder(start) if fsdp and kind == "all_gather" else None
        out.append(Collective(start, tuple(waits), kind, fsdp, dirn, group_name(start), dtype, _nbytes(size_node),
                              module_fqn_fn(start) if fsdp else None, param))
    index = positions(graph)
    out.sort(key=lambda c: index[c.start])
    return out

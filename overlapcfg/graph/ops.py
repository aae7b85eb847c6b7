"""The op vocabulary: what each op of a graph is to overlapcfg, said once and imported by every stage that asks.

- **Collectives**: which nodes start a ``_c10d_functional`` collective and of which kind (``collective_kind``:
  plain, ``_coalesced``, ``into_tensor`` and ``out=`` forms alike), which node waits on which start
  (``started_by``, ``wait_of``), through ``control_deps`` wrappers (``insert_overlap_deps``) everywhere;
- **byte-moving ops**, in families of exact overloads (``RESHAPES``, ``SAME_BYTES``, ``CASTS``, ``ALLOCATIONS``,
  ``CUTS``, ``COPIES``, the bucket copy-ins, the ``MODELLED_COLLECTIVES``): the verifier interprets exactly these
  (``INTERPRETED``); views and reshapes among them alias their input (``INTERPRETED_VIEWS``). Attribution's
  ``is_transparent`` (ops between a parameter and its all-gather) is those families plus the element-moving ops the
  verifier does not model (transposes, permutes, ``contiguous``); the cost model's ``is_free`` (no kernel) is the
  views among them;
- **in-place writes and aliases**, from each op's schema (``compat.op_effects``, the one reader): what a node
  writes (``written_inputs``) and whether its result shares its input's storage (``may_alias_input``).

A new op variant is added here, to its family, and every stage sees it. Lives in the graph layer rather than in
``overlapcfg.compat`` because these are overlapcfg's decisions (which ops count as transparent, which the verifier
models, what a collective kind is), made over fx nodes; the private torch pieces they rest on (op names, schemas,
``control_deps``) stay in compat.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.kinds import CollectiveKind, Direction

__all__ = [
    "ALLOCATIONS",
    "BUCKET_COPY_INS",
    "CASTS",
    "COPIES",
    "CUTS",
    "INTERPRETED",
    "INTERPRETED_VIEWS",
    "INTERPRETED_WRITES",
    "MODELLED_COLLECTIVES",
    "RESHAPES",
    "SAME_BYTES",
    "Effects",
    "argument",
    "collective_kind",
    "data_inputs",
    "effects",
    "group_name",
    "is_collective_start",
    "is_compute_node",
    "is_free",
    "is_transparent",
    "may_alias_input",
    "node_direction",
    "reached_users",
    "started_by",
    "wait_of",
    "written_inputs",
]

# --- collectives: starts, waits and kinds --------------------------------------------------------------------------

_WAIT = compat.WAIT_TENSOR
_CONTROL_DEPS = compat.control_deps
_KIND_NAMES: tuple[tuple[str, CollectiveKind], ...] = (
    ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"), ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
)


def _target_kind(target: object) -> CollectiveKind:
    name = compat.op_name(target)
    return next((kind for key, kind in _KIND_NAMES if key in name), "other")


def data_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """The nodes ``node`` reads (a ``control_deps`` wrapper's ordering edges are not reads)."""
    # compat returns the wrapper's inputs as objects; for a wrapped op they are its input nodes
    return compat.unwrap_control_deps(node)[1]  # type: ignore[return-value]


def is_collective_start(node: fx.Node) -> bool:
    """A ``_c10d_functional`` op other than ``wait_tensor`` (what a wait completes)."""
    if node.op != "call_function":
        return False
    target = compat.unwrap_control_deps(node)[0] if node.target is _CONTROL_DEPS else node.target
    return compat.is_functional_collective(target) and target is not _WAIT


def started_by(node: fx.Node) -> fx.Node | None:
    """If ``node`` is a wait (also one wrapped by ``insert_overlap_deps``), the collective start it waits on."""
    if node.op != "call_function":
        return None
    start: object
    if node.target is _WAIT:
        start = node.args[0] if node.args else None
    elif node.target is _CONTROL_DEPS:
        target, inputs, _ = compat.unwrap_control_deps(node)
        start = inputs[0] if target is _WAIT and inputs else None
    else:
        return None
    if not isinstance(start, fx.Node):
        return None
    if start.target is operator.getitem and isinstance(start.args[0], fx.Node):  # coalesced collectives
        start = start.args[0]
    return start if is_collective_start(start) else None


def wait_of(start: fx.Node) -> fx.Node | None:
    """The single wait reading ``start``; ``None`` if there is none or several."""
    waits = [u for u in start.users if started_by(u) is start]
    return waits[0] if len(waits) == 1 else None


def collective_kind(node: fx.Node) -> CollectiveKind | None:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``all_to_all`` / ``other`` for a collective start
    (single, ``_coalesced`` and ``into_tensor`` forms alike), ``None`` for anything else."""
    if not is_collective_start(node):
        return None
    return _target_kind(compat.unwrap_control_deps(node)[0])


def group_name(start: fx.Node) -> str:
    """The process-group name argument of a ``_c10d_functional`` collective (always its last positional; a
    ``control_deps`` wrapper's is that of the op it wraps)."""
    arg = compat.unwrapped_call(start)[1][-1]
    if isinstance(arg, fx.Node):  # compile-on-one-rank graphs pass the group as a graph input
        return f"<node {arg.name}>"
    return str(arg)


def node_direction(node: fx.Node) -> Direction:
    """Which side of autograd a node is on, from aot_autograd's ``autograd_backward`` tag."""
    return "backward" if node.meta.get("autograd_backward", False) else "forward"


def is_compute_node(node: fx.Node) -> bool:
    """An op with a FLOP formula (matmuls, attention, convolutions): what collectives are meant to hide behind."""
    return compat.flop_formula(node.target) is not None


def reached_users(starts: Iterable[fx.Node], follow: Callable[[fx.Node], bool]) -> Iterator[fx.Node]:
    """Every user reachable from ``starts``, depth first, walking on through the users ``follow`` accepts (each
    node once): the one walk the structural tests (``collectives``, ``gradients``) share."""
    stack, seen = list(starts), set()
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            yield user
            if follow(user):
                stack.append(user)


# --- byte-moving ops --------------------------------------------------------------------------------------------

_aten = torch.ops.aten
RESHAPES = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default})
"""A new shape over the same bytes in the same order."""
SAME_BYTES = frozenset({
    _aten.clone.default, _aten.alias.default, _aten.detach.default, _aten.flatten.using_ints, _aten.squeeze.dim,
    _aten.squeeze.dims, _aten.squeeze.default, _aten.unsqueeze.default, _aten.lift_fresh_copy.default,
})
"""The same bytes in the same order, the shape read from the node's ``meta["val"]``."""
CASTS = frozenset({torch.ops.prims.convert_element_type.default, _aten._to_copy.default})
ALLOCATIONS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default})
"""Fresh, unwritten buffers (a merged bucket's output)."""
CUTS = frozenset({_aten.slice.Tensor, _aten.narrow.default, _aten.split.Tensor, _aten.split_with_sizes.default})
"""Contiguous ranges along one dimension."""
COPIES = frozenset({_aten.copy_.default, _aten.copy.default, _aten._foreach_copy_.default})
BUCKET_COPY_INS = frozenset({compat.pre_bucket_all_gather, compat.pre_bucket_reduce_scatter})
"""torch's copy of a bucket's inputs into one buffer (``bucket_mode="custom_ops"`` and kin)."""
MODELLED_COLLECTIVES: dict[object, CollectiveKind] = {
    target: _target_kind(target) for target in (
        compat.ALL_GATHER_INTO_TENSOR, compat.ALL_GATHER_INTO_TENSOR_OUT, compat.ALL_GATHER_INTO_TENSOR_COALESCED,
        compat.REDUCE_SCATTER_TENSOR, compat.REDUCE_SCATTER_TENSOR_COALESCED, compat.ALL_REDUCE)
}
"""The collective overloads whose data the verifier follows and counts, by kind (what merged buckets use)."""
INTERPRETED = frozenset({
    *RESHAPES, *SAME_BYTES, *CASTS, *ALLOCATIONS, *CUTS, *COPIES, *BUCKET_COPY_INS, *MODELLED_COLLECTIVES,
    _aten.view.dtype, _aten.cat.default, _WAIT, operator.getitem,
})
"""Targets whose output the verifier computes from its inputs' bytes (``overlapcfg.graph.provenance``); every
other op is opaque to it."""

_TRANSPARENT_NAMES = frozenset(
    compat.op_name(t) for t in INTERPRETED - BUCKET_COPY_INS - MODELLED_COLLECTIVES.keys() - {_WAIT, operator.getitem}
) | {
    "bucketing._pre_bucket_all_gather", "aten.contiguous", "aten.split_with_sizes_copy", "aten.new_empty",
    "aten.t", "aten.permute", "aten.expand", "fsdp.all_gather_copy_in", "aten.foreach_copy", "aten._foreach_copy",
}
"""By op name (every overload): the byte-moving families above, the all-gather copy-in, and ops that move elements
without computing that the verifier does not model (transposes, permutes, broadcasts, FSDP2's copy-in)."""
_NO_KERNEL_NAMES = frozenset({"aten._unsafe_view", "aten.lift_fresh_copy"})
"""Not views by schema, yet no kernel of their own: a reshape, and the lift of a constant."""


def is_transparent(node: fx.Node) -> bool:
    """Ops that move a parameter's elements without computing on them: views, dtype casts, copies, and the
    copy-in of torch's merged buckets. The only ops allowed between a parameter and its FSDP all-gather."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or getattr(target, "is_view", False):
        return True
    return compat.op_name(target) in _TRANSPARENT_NAMES


def is_free(node: fx.Node) -> bool:
    """No kernel: a view (by schema), ``getitem``, or a reshape / constant lift that only relabels memory."""
    target = node.target
    return target is operator.getitem or getattr(target, "is_view", False) or \
        compat.op_name(target) in _NO_KERNEL_NAMES


# --- in-place writes and aliases (op schemas) --------------------------------------------------------------------

Effects: TypeAlias = tuple[tuple[compat.ArgumentRef, ...], "compat.ArgumentRef | None"]
"""``(written arguments, the argument the result aliases)`` of a call (``compat.op_effects``)."""
_ALIASES_FIRST = frozenset({_WAIT, _aten._unsafe_view.default})
"""Ops whose result is their first argument's memory though their schema does not say so."""
_IN_PLACE_METHOD: Effects = (((0, "self"),), (0, "self"))
_NO_EFFECTS: Effects = ((), None)
_EFFECTS: dict[int, tuple[object, Effects]] = {}
"""Target identity -> (target, effects). Keyed by ``id`` because an op overload hashes in Python, a cost paid per
node otherwise; the entry holds the target, so no other object can take its id while it is cached."""


def effects(target: object, op: str = "call_function") -> Effects:
    """What a call of ``target`` writes and what its result aliases: the schema's alias annotations for an op
    overload (``Tensor(a!)`` written, a result ``Tensor(a)`` aliasing ``a``), plus the ops whose schema is silent
    (``_ALIASES_FIRST``); ``Tensor.add_`` and kin (``call_method`` on pre-aot graphs) write and return ``self``."""
    if op != "call_function":
        in_place = op == "call_method" and isinstance(target, str) and target.endswith("_") \
            and not target.startswith("_")
        return _IN_PLACE_METHOD if in_place else _NO_EFFECTS
    cached = _EFFECTS.get(id(target))
    if cached is not None and cached[0] is target:
        return cached[1]
    found: Effects = ((), (0, "self")) if target in _ALIASES_FIRST else compat.op_effects(target)
    _EFFECTS[id(target)] = (target, found)
    return found


def argument(args: Sequence[object], kwargs: Mapping[str, object], ref: compat.ArgumentRef) -> object:
    """The value passed for schema argument ``ref``: by keyword if given so, else by position (None: not given)."""
    position, name = ref
    return kwargs[name] if name in kwargs else args[position] if position < len(args) else None


def written_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """The graph nodes ``node`` writes in place (seen through ``control_deps``), lists flattened: ``add_``'s
    ``self``, ``_foreach_mul_``'s list, an ``out=`` buffer. Empty for calls that write nothing (``getitem``)."""
    if node.op not in ("call_function", "call_method"):
        return ()
    args: Sequence[object]
    kwargs: Mapping[str, object]
    if node.target is not _CONTROL_DEPS:  # the common case, without unwrapping: most ops write nothing
        refs = effects(node.target, node.op)[0]
        if not refs:
            return ()
        args, kwargs = node.args, node.kwargs
    else:
        target, args, kwargs = compat.unwrapped_call(node)
        refs = effects(target, node.op)[0]
    written: list[fx.Node] = []
    for ref in refs:
        value = argument(args, kwargs, ref)
        written.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node))
    return tuple(written)


def may_alias_input(node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with one of its inputs: views, ``t``, ``split``, in-place ops
    returning their input (schema alias annotations). ``getitem`` of such a result aliases too."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and may_alias_input(source)
    if node.op not in ("call_function", "call_method"):
        return False
    return effects(compat.unwrapped_call(node)[0], node.op)[1] is not None


INTERPRETED_VIEWS = frozenset(t for t in INTERPRETED if effects(t) == ((), (0, "self")))
"""Interpreted ops whose result aliases their first argument and that write nothing: views, reshapes, waits.
``getitem`` (of an aliasing tuple) is the interpreter's own case."""
INTERPRETED_WRITES = frozenset(t for t in INTERPRETED if effects(t)[0])
"""Interpreted ops that write into an argument: ``copy_``, ``_foreach_copy_``, the ``out=`` all-gather."""

"""What a tensor holds at the moment it is read: storages, aliases and writes, for the verifier's interpretation
(``overlapcfg.graph.provenance`` says what each op makes of what it reads; this module, when it reads it).

Memory is modelled as storages, each holding one ``Value``: a fresh tensor owns one, a view or an
in-place op's result aliases its argument's (what the op schema's alias annotations say, ``compat.op_effects``,
plus ``wait_tensor`` and ``_unsafe_view``, whose schemas do not). A write (``copy_``, ``_foreach_copy_``, an
``out=`` all-gather, or any op whose schema marks an argument written, ``add_``, ``_foreach_mul_``, ``x.out``)
replaces the bytes of the written view in its storage: with what an interpreted op writes, or with the writer's
own key. A tensor is then read as its storage holds it *when it is read*: a reader moved past a write to what it
reads reads other bytes, and so does the reader of a buffer that the next bucket's all-gather overwrote. Where a
view's place in its storage is known (``address``: the same algebra run on byte offsets), exactly its bytes are
re-read; otherwise the read is ``("after", ...)`` of the whole storage. A collective writes its ``out`` buffer at
its start (reads between start and wait are the structure check's business).

Work is linear in the graph: every node is interpreted once (``provenance.step`` on its inputs as read); a view is
re-read only if its storage was written since it was last read, and addresses are derived only for views written
through or re-read.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx

from overlapcfg import compat
from overlapcfg.graph.byte_runs import (
    _RESHAPES,
    ADDRESS,
    INTERPRETED,
    Content,
    Input,
    Value,
    _all_gather,
    _aten,
    _atom,
    opaque,
    overwrite,
    substitute,
)
from overlapcfg.graph.collectives import group_name
from overlapcfg.graph.provenance import copy_content, step

__all__ = ["Interpretation", "Visitor", "interpret"]


_VIEWS = frozenset({*_RESHAPES, _aten.alias.default, _aten.detach.default, _aten.squeeze.dim, _aten.squeeze.dims,
                    _aten.squeeze.default, _aten.unsqueeze.default, _aten.flatten.using_ints, _aten.view.dtype,
                    _aten.slice.Tensor, _aten.narrow.default, _aten.split.Tensor, _aten.split_with_sizes.default,
                    compat.WAIT_TENSOR, operator.getitem})
"""Interpreted ops whose result aliases their first argument: their address is ``_step`` run on its address."""
_ALIASES_FIRST = frozenset({compat.WAIT_TENSOR, _aten._unsafe_view.default})
"""Ops whose result is their first argument's memory though their schema does not say so."""
_WRITERS = frozenset({_aten.copy_.default, _aten._foreach_copy_.default, compat.ALL_GATHER_INTO_TENSOR_OUT})
"""Writes whose bytes are interpreted; every other write (by schema) fills its place with the writer's key."""
_NO_EFFECTS: tuple[tuple[compat.ArgumentRef, ...], compat.ArgumentRef | None] = ((), None)


def _effects(node: fx.Node, target: object) -> tuple[tuple[compat.ArgumentRef, ...], compat.ArgumentRef | None]:
    if node.op == "call_method" and isinstance(target, str) and target.endswith("_") and not target.startswith("_"):
        return ((0, "self"),), (0, "self")  # Tensor.add_ and kin on pre-aot graphs
    if node.op != "call_function":
        return _NO_EFFECTS
    if target in _ALIASES_FIRST:
        return (), (0, "self")
    return compat.op_effects(target)


def _argument(args: Sequence[object], kwargs: dict[str, object], ref: compat.ArgumentRef) -> object:
    position, name = ref
    return kwargs[name] if name in kwargs else args[position] if position < len(args) else None


@dataclass(slots=True)
class _Storage:
    content: Value
    """The whole storage, shaped as the tensor that allocated it."""
    version: int = 0
    """How many writes it has had: a view read at an older version is read again."""


@dataclass(slots=True)
class _Slot:
    content: Content
    """As last read (at ``version``)."""
    root: fx.Node | None
    """The node that allocated the storage this aliases (itself for a fresh tensor); None: not one tensor."""
    version: int
    parent: fx.Node | None = None
    """For an alias, the node it aliases (its address is derived from the parent's)."""


Visitor = Callable[[fx.Node, object, tuple[object, ...], dict[str, object], bool], None]
"""``visit(node, target, args, kwargs, opaque)``, called once per node in graph order with the op it runs (seen
through ``control_deps``) and its arguments as contents **as read** (before its own writes); the output node gets
``target`` None and the graph outputs as read at the end."""


class Interpretation:
    """Every node's content as last read, which storage each tensor lives in, who wrote where, and the inputs'
    final contents (see the module docstring)."""

    def __init__(self) -> None:
        self.opaque: set[fx.Node] = set()
        """Nodes left opaque: compute, or an op we could not model."""
        self.writes: dict[fx.Node, list[fx.Node]] = {}
        """Writer -> the storages (their allocating nodes) it writes."""
        self.inputs: list[fx.Node] = []
        self._slots: dict[fx.Node, _Slot] = {}
        self._storages: dict[fx.Node, _Storage] = {}
        self._addresses: dict[fx.Node, Content] = {}

    def root(self, node: fx.Node) -> fx.Node | None:
        """The node whose storage ``node``'s tensor lives in (itself for a fresh tensor; None for non-tensors)."""
        slot = self._slots.get(node)
        return slot.root if slot is not None else None

    def read(self, node: fx.Node) -> Content:
        """``node``'s content as its storage holds it now."""
        slot = self._slots.get(node)
        if slot is None:  # read before it is computed (a broken order, which the verifier reports): opaque
            return opaque(node)
        if slot.root is None:
            return slot.content
        storage = self._storages[slot.root]
        if storage.version != slot.version:
            if node is slot.root:
                slot.content = storage.content
            else:
                address = self._address(node)
                content = _substitute(address, storage.content)
                slot.content = content if content is not None else \
                    _atom(("after", node.name, storage.content), node.meta.get("val"))
            slot.version = storage.version
        return slot.content

    def final_inputs(self) -> dict[int, tuple[str, Content]]:
        """Position -> (name, content at the end) of every graph input the graph writes into."""
        return {i: (p.name, self._storages[p].content) for i, p in enumerate(self.inputs)
                if p in self._storages and self._storages[p].version}

    # --- building -----------------------------------------------------------------------------------------------

    def _fresh(self, node: fx.Node, content: Content) -> None:
        if isinstance(content, Value):
            self._storages[node] = _Storage(content)
            self._slots[node] = _Slot(content, node, 0)
        else:
            self._slots[node] = _Slot(content, None, 0)

    def _alias(self, node: fx.Node, parent: object, content: Content) -> None:
        slot = self._slots.get(parent) if isinstance(parent, fx.Node) else None
        if slot is None or slot.root is None:
            self._fresh(node, content)
            return
        self._slots[node] = _Slot(content, slot.root, self._storages[slot.root].version, parent)

    def _address(self, node: fx.Node) -> Content:
        """Where ``node``'s bytes lie in its storage (a ``Value`` of ``ADDRESS`` runs), or None if unknown."""
        chain: list[fx.Node] = []
        cur: fx.Node | None = node
        while cur is not None and cur not in self._addresses:
            slot = self._slots[cur]
            if cur is slot.root:
                whole = self._storages[cur].content
                self._addresses[cur] = None if whole.shape is None else \
                    Value(whole.shape, whole.dtype, ((ADDRESS, 0, whole.nbytes),))
                break
            chain.append(cur)
            cur = slot.parent
        for view in reversed(chain):
            parent = self._slots[view].parent
            above = self._addresses.get(parent) if parent is not None else None
            self._addresses[view] = None if above is None else _view_address(view, parent, above)  # type: ignore[arg-type]
        return self._addresses.get(node)

    def _write(self, dst: object, content: Content, writer: fx.Node, label: str) -> None:
        """``content`` (None: not interpreted, the writer's own bytes) into ``dst``'s place in its storage."""
        if not isinstance(dst, fx.Node):
            return
        slot = self._slots.get(dst)
        if slot is None or slot.root is None:
            return
        storage = self._storages[slot.root]
        address = self._address(dst)
        updated = None
        if isinstance(address, Value):
            if isinstance(content, Value):
                updated = overwrite(storage.content, address, content)
            if updated is None:
                own = Value(address.shape, address.dtype, ((("node", label), 0, address.nbytes),))
                updated = overwrite(storage.content, address, own)
        if updated is None:  # a place we cannot name: the whole storage now holds the writer's bytes
            whole = storage.content
            updated = Value(whole.shape, whole.dtype, ((("node", label), 0, whole.nbytes),))
        storage.content = updated
        storage.version += 1
        self.writes.setdefault(writer, []).append(slot.root)

    def _interpreted_write(self, node: fx.Node, target: object, args: tuple[object, ...],
                           kwargs: dict[str, object], read_args: tuple[object, ...],
                           read_kwargs: dict[str, object]) -> bool:
        """``copy_``, ``_foreach_copy_`` and the ``out=`` all-gather; False if the bytes cannot be modelled."""
        if target is _aten._foreach_copy_.default:
            dsts, srcs = read_args[0], read_args[1]
            if not isinstance(dsts, (list, tuple)) or not isinstance(srcs, (list, tuple)) or len(dsts) != len(srcs):
                return False
            written = [copy_content(d, s) for d, s in zip(dsts, srcs, strict=True)]
            for i, (dst, content) in enumerate(zip(args[0], written, strict=True)):  # type: ignore[call-overload]
                self._write(dst, content, node, f"{node.name}[{i}]")
            return None not in written
        if target is _aten.copy_.default:
            dst, content = args[0], copy_content(read_args[0], read_args[1])
        else:  # all_gather_into_tensor_out: the gathered input fills ``out``
            dst, x, size = kwargs.get("out"), read_args[0], read_args[1]
            content = _all_gather(x, size, group_name(node)) \
                if isinstance(x, Value) and isinstance(size, int) else None
            out = read_kwargs.get("out")
            if content is not None and (not isinstance(out, Value) or out.shape != content.shape):
                content = None
        self._write(dst, content, node, node.name)
        return content is not None

    def _call(self, node: fx.Node, visit: Visitor | None) -> None:
        target, args, kwargs = compat.unwrapped_call(node)
        read_args = fx.map_arg(args, self.read)
        read_kwargs = fx.map_arg(kwargs, self.read)
        writes, alias = _effects(node, target)
        modelled = False
        if target in _WRITERS:
            modelled = self._interpreted_write(node, target, args, kwargs, read_args, read_kwargs)  # type: ignore[arg-type]
        elif writes:
            for ref in writes:
                dst = _argument(args, kwargs, ref)
                for i, d in enumerate(dst) if isinstance(dst, (list, tuple)) else [(None, dst)]:
                    self._write(d, None, node, node.name if i is None else f"{node.name}[{i}]")
        parent = args[0] if target is operator.getitem else _argument(args, kwargs, alias) if alias else None
        if writes or target in _WRITERS:
            content: Content = self.read(parent) if isinstance(parent, fx.Node) else ()
        else:
            content = step(node, target, read_args, read_kwargs) if target in INTERPRETED else None  # type: ignore[arg-type]
            modelled = content is not None
            if content is None:
                content = opaque(node)
        if not modelled:
            self.opaque.add(node)
        if target is operator.getitem:
            of = self._slots.get(parent) if isinstance(parent, fx.Node) else None
            if of is None or of.root is None or not isinstance(of.content, tuple):
                parent = None  # an element of a tuple of fresh tensors (coalesced collectives, multi-output compute)
        if parent is not None:
            self._alias(node, parent, content)
        else:
            self._fresh(node, content)
        if visit is not None:
            visit(node, target, read_args, read_kwargs, not modelled)  # type: ignore[arg-type]


def _view_address(view: fx.Node, parent: fx.Node, above: Content) -> Content:
    """A view's address from its parent's: the view's own transform run on byte offsets."""
    target, args, kwargs = compat.unwrapped_call(view)
    if target not in _VIEWS:
        writes, alias = _effects(view, target)
        return above if writes and alias is not None else None  # an in-place op's result is its argument
    args = fx.map_arg(args, lambda n: above if n is parent else None)
    return step(view, target, args, kwargs)  # type: ignore[arg-type]


def _substitute(address: Content, storage: Value) -> Content:
    if isinstance(address, Value):
        return substitute(address, storage)
    if isinstance(address, tuple):
        parts = tuple(_substitute(a, storage) for a in address)
        return None if None in parts else parts
    return None


def interpret(graph: fx.Graph, visit: Visitor | None = None) -> Interpretation:
    """Interpret ``graph`` in order (see the module docstring), calling ``visit`` on every node."""
    state = Interpretation()
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            state._call(node, visit)
        elif node.op == "placeholder":
            state._fresh(node, _atom(("input", Input(len(state.inputs), node.name)), node.meta.get("val")))
            state.inputs.append(node)
        elif node.op == "output":
            if visit is not None:
                visit(node, None, fx.map_arg(node.args, state.read), {}, False)  # type: ignore[arg-type]
        else:
            state._fresh(node, opaque(node))
    return state

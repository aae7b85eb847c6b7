"""What a tensor holds at the moment it is read: storages, aliases and writes, for the verifier's interpretation
(``overlapcfg.graph.provenance`` says what each op makes of what it reads; this module, when it reads it).

Memory is modelled as storages, each holding one ``Value``: a fresh tensor owns one, a view, a split's pieces or an
in-place op's result alias their argument's (``overlapcfg.graph.ops.effects``: the op schema's alias annotations,
plus ``wait_tensor`` and ``_unsafe_view``, whose schemas do not say so). A write (``copy_``, ``_foreach_copy_``, an
``out=`` all-gather, or any op whose schema marks an argument written, ``add_``, ``_foreach_mul_``, ``x.out``)
replaces the bytes of the written view in its storage: with what an interpreted op writes, or with the writer's own
key. A tensor is then read as its storage holds it *when it is read*: a reader moved past a write to what it reads
reads other bytes, and so does the reader of a buffer that the next bucket's all-gather overwrote. Where a view's
place in its storage is known (``address``: the same algebra run on byte offsets), exactly its bytes are re-read;
otherwise the read is ``("after", ...)`` of the whole storage. A collective writes its ``out`` buffer at its start
(reads between start and wait are the structure check's business).

Work is linear in the graph: every node is interpreted once (``provenance.step`` on its inputs as read); a view is
re-read only if its storage was written since it was last read, and addresses are derived only for views written
through or re-read.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TypeVar, cast

import torch
from torch import fx
from torch.fx.node import Argument

from overlapcfg import compat
from overlapcfg.graph.byte_runs import (
    ADDRESS,
    Content,
    Input,
    Value,
    _all_gather,
    _atom,
    opaque,
    overwrite,
    substitute,
)
from overlapcfg.graph.ops import INTERPRETED, INTERPRETED_VIEWS, INTERPRETED_WRITES, argument, effects, group_name
from overlapcfg.graph.provenance import copy_content, step

__all__ = ["Interpretation", "Visitor", "interpret"]

_aten = torch.ops.aten
_VIEWS = INTERPRETED_VIEWS | {operator.getitem}
"""Interpreted ops whose result aliases their first argument (``getitem``: an element of an aliasing tuple, such as
a split's): their address is ``step`` run on its address."""

_OPAQUE, _STEP, _WRITE = 0, 1, 2
_Plan = tuple[int, tuple[compat.ArgumentRef, ...], "compat.ArgumentRef | None"]
"""How a target is interpreted (opaque, ``step``, an interpreted write, ``INTERPRETED_WRITES``: every other write
fills its place with the writer's key), what it writes, what its result aliases (``overlapcfg.graph.ops.effects``)."""
_PLANS: dict[int, tuple[object, _Plan]] = {}
"""Target identity -> (target, plan). Keyed by ``id`` because an op overload hashes in Python, a cost paid per node
otherwise; the entry holds the target, so no other object can take its id while it is cached."""


def _plan(node: fx.Node, target: object) -> _Plan:
    """One lookup per node (op overloads hash slowly): the target's plan, computed once per target."""
    if node.op != "call_function":  # Tensor.add_ and kin on pre-aot graphs write ``self``
        return (_OPAQUE, *effects(target, node.op))
    cached = _PLANS.get(id(target))
    if cached is not None and cached[0] is target:
        return cached[1]
    mode = _WRITE if target in INTERPRETED_WRITES else _STEP if target in INTERPRETED else _OPAQUE
    writes, alias = effects(target)
    _PLANS[id(target)] = (target, (mode, writes, alias))
    return mode, writes, alias


Visitor = Callable[[fx.Node, object, tuple[object, ...], dict[str, object], bool], None]
"""``visit(node, target, args, kwargs, opaque)``, called once per node in graph order with the op it runs (seen
through ``control_deps``) and its arguments as contents **as read** (before its own writes); the output node gets
``target`` None and the graph outputs as read at the end."""

_Slot = tuple[Content, "fx.Node | None", int, "fx.Node | None"]
"""Per node: (content as last read, the node that allocated its storage (itself for a fresh tensor; None: not one
tensor), the storage's version when last read, the node it aliases (None for a fresh tensor))."""


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
        self._written: dict[fx.Node, tuple[Value, int]] = {}
        """Storage -> (its content, its version: how many writes it has had), for storages written at least once."""
        self._addresses: dict[fx.Node, Content] = {}

    def root(self, node: fx.Node) -> fx.Node | None:
        """The node whose storage ``node``'s tensor lives in (itself for a fresh tensor; None for non-tensors)."""
        slot = self._slots.get(node)
        return slot[1] if slot is not None else None

    def read(self, node: fx.Node) -> Content:
        """``node``'s content as its storage holds it now."""
        slot = self._slots.get(node)
        if slot is None:  # read before it is computed (a broken order, which the verifier reports): opaque
            return opaque(node)
        content, root, version, parent = slot
        if root is None:
            return content
        written = self._written.get(root)
        if written is None or written[1] == version:
            return content
        storage = written[0]
        if node is root:
            content = storage
        else:
            address = self._address(node)
            content = _substitute(address, storage)
            if content is None:
                content = _atom(("after", node.name, storage), node.meta.get("val"))
        self._slots[node] = (content, root, written[1], parent)
        return content

    def final_inputs(self) -> dict[int, tuple[str, Content]]:
        """Position -> (name, content at the end) of every graph input the graph writes into."""
        return {i: (p.name, self._written[p][0]) for i, p in enumerate(self.inputs) if p in self._written}

    # --- building -----------------------------------------------------------------------------------------------

    def _storage(self, root: fx.Node) -> tuple[Value, int]:
        written = self._written.get(root)
        if written is not None:
            return written
        whole = self._slots[root][0]
        if not isinstance(whole, Value):
            raise AssertionError(f"overlapcfg memory model: the root {root.name} holds no tensor content")
        return whole, 0

    def _fresh(self, node: fx.Node, content: Content) -> None:
        self._slots[node] = (content, node if isinstance(content, Value) else None, 0, None)

    def _alias(self, node: fx.Node, parent: object, content: Content) -> None:
        slot = self._slots.get(parent) if isinstance(parent, fx.Node) else None
        if slot is None or slot[1] is None or not isinstance(parent, fx.Node):
            self._fresh(node, content)
            return
        root = slot[1]
        written = self._written.get(root)
        # the slot of a view: its root is the parent's (an alias keeps the root)
        self._slots[node] = (content, root, written[1] if written is not None else 0, parent)

    def _address(self, node: fx.Node) -> Content:
        """Where ``node``'s bytes lie in its storage (a ``Value`` of ``ADDRESS`` runs), or None if unknown."""
        chain: list[fx.Node] = []
        cur: fx.Node | None = node
        while cur is not None and cur not in self._addresses:
            _, root, _, parent = self._slots[cur]
            if cur is root:
                whole = self._storage(cur)[0]
                self._addresses[cur] = None if whole.shape is None else \
                    Value(whole.shape, whole.dtype, ((ADDRESS, 0, whole.nbytes),))
                break
            chain.append(cur)
            cur = parent
        for view in reversed(chain):
            parent = self._slots[view][3]
            above = self._addresses.get(parent) if parent is not None else None
            self._addresses[view] = None if above is None or parent is None else _view_address(view, parent, above)
        return self._addresses.get(node)

    def _write(self, dst: object, content: Content, writer: fx.Node, label: str) -> None:
        """``content`` (None: not interpreted, the writer's own bytes) into ``dst``'s place in its storage."""
        if not isinstance(dst, fx.Node):
            return
        slot = self._slots.get(dst)
        if slot is None or slot[1] is None:
            return
        root = slot[1]
        storage, version = self._storage(root)
        address = self._address(dst)
        updated = None
        if isinstance(address, Value):
            if isinstance(content, Value):
                updated = overwrite(storage, address, content)
            if updated is None:
                own = Value(address.shape, address.dtype, ((("node", label), 0, address.nbytes),))
                updated = overwrite(storage, address, own)
        if updated is None:  # a place we cannot name: the whole storage now holds the writer's bytes
            updated = Value(storage.shape, storage.dtype, ((("node", label), 0, storage.nbytes),))
        self._written[root] = (updated, version + 1)
        self.writes.setdefault(writer, []).append(root)

    def _interpreted_write(self, node: fx.Node, target: object, args: tuple[object, ...],
                           kwargs: dict[str, object], read_args: tuple[object, ...],
                           read_kwargs: dict[str, object]) -> bool:
        """``copy_``, ``_foreach_copy_`` and the ``out=`` all-gather; False if the bytes cannot be modelled."""
        if target is _aten._foreach_copy_.default:
            dsts, srcs = read_args[0], read_args[1]
            if not isinstance(dsts, (list, tuple)) or not isinstance(srcs, (list, tuple)) or len(dsts) != len(srcs):
                return False
            targets = args[0]  # the destination nodes, as the op's schema has them: a list
            if not isinstance(targets, (list, tuple)):
                return False
            written = [copy_content(d, s) for d, s in zip(dsts, srcs, strict=True)]
            for i, (dst, content) in enumerate(zip(targets, written, strict=True)):
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
        read = self.read
        read_args = _map_nodes(args, read)
        read_kwargs = _map_nodes(kwargs, read) if kwargs else kwargs
        mode, writes, alias = _plan(node, target)
        modelled = False
        if mode == _WRITE:
            modelled = self._interpreted_write(node, target, args, kwargs, read_args, read_kwargs)
        elif writes:
            for ref in writes:
                dst = argument(args, kwargs, ref)
                for i, d in enumerate(dst) if isinstance(dst, (list, tuple)) else [(None, dst)]:
                    self._write(d, None, node, node.name if i is None else f"{node.name}[{i}]")
        parent = args[0] if target is operator.getitem else argument(args, kwargs, alias) if alias else None
        if writes or mode == _WRITE:
            content: Content = read(parent) if isinstance(parent, fx.Node) else ()
        else:
            content = step(node, target, read_args, read_kwargs) if mode == _STEP else None
            modelled = content is not None
            if content is None:
                content = opaque(node)
        if not modelled:
            self.opaque.add(node)
        if target is operator.getitem:
            of = self._slots.get(parent) if isinstance(parent, fx.Node) else None
            if of is None or of[1] is None or not isinstance(of[0], tuple):
                parent = None  # an element of a tuple of fresh tensors (coalesced collectives, multi-output compute)
        if parent is not None:
            self._alias(node, parent, content)
        else:
            self._fresh(node, content)
        if visit is not None:
            visit(node, target, read_args, read_kwargs, not modelled)


_Mapped = TypeVar("_Mapped", tuple[object, ...], dict[str, object])


def _map_nodes(value: _Mapped, fn: Callable[[fx.Node], object]) -> _Mapped:
    """``value`` with ``fn(node)`` in each node's place, at any depth (``fx.map_arg``, whose annotations allow only
    graph arguments in the nodes' places, where this puts contents; it keeps a tuple a tuple, a dict a dict)."""
    return cast(_Mapped, fx.map_arg(cast(Argument, value), cast(Callable[[fx.Node], Argument], fn)))


def _view_address(view: fx.Node, parent: fx.Node, above: Content) -> Content:
    """A view's address from its parent's: the view's own transform run on byte offsets."""
    target, args, kwargs = compat.unwrapped_call(view)
    if target not in _VIEWS:
        _, writes, alias = _plan(view, target)
        return above if writes and alias is not None else None  # an in-place op's result is its argument
    addresses = _map_nodes(args, lambda n: above if n is parent else None)
    return step(view, target, addresses, kwargs)


def _substitute(address: Content, storage: Value) -> Content:
    if isinstance(address, Value):
        return substitute(address, storage)
    if isinstance(address, tuple):
        parts = tuple(_substitute(a, storage) for a in address)
        return None if None in parts else parts
    return None


_CALLS = ("call_function", "call_method", "call_module")


def interpret(graph: fx.Graph, visit: Visitor | None = None) -> Interpretation:
    """Interpret ``graph`` in order (see the module docstring), calling ``visit`` on every node."""
    state = Interpretation()
    for node in graph.nodes:
        op = node.op
        if op in _CALLS:
            state._call(node, visit)
        elif op == "placeholder":
            state._fresh(node, _atom(("input", Input(len(state.inputs), node.name)), node.meta.get("val")))
            state.inputs.append(node)
        elif op == "output":
            if visit is not None:
                visit(node, None, _map_nodes(node.args, state.read), {}, False)
        else:
            state._fresh(node, opaque(node))
    return state

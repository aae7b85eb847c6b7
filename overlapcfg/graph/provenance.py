"""Element provenance: for every tensor a graph reads, which bytes of which source it holds, row-major, at the
moment it is read.

The verifier needs to know that after bucketing each consumer reads exactly the elements it read before: the same
parameter's all-gathered bytes, the same gradient's reduce-scattered bytes, cast to the same dtype, through the same
process group. Node names cannot tell that (merging erases the collectives and adds copy-ins, splits and views),
so each tensor is described by what it holds::

    primals_3 (64 x f32, this rank's shard)      -> (input 2 primals_3)[0:256)
    all_gather(primals_3, group '0', 2 ranks)    -> (ag '0'/2 rank 0 of (input 2 primals_3))[0:256)
                                                    ++ (ag '0'/2 rank 1 of (input 2 primals_3))[0:256)

A ``Value`` is a shape, a dtype and ``runs``: ``(key, start, nbytes)`` triples, the tensor's bytes in row-major
order, adjacent runs of one key merged (so equal contents compare equal however they were assembled). A key is a
nested tuple naming where bytes come from:

- ``("input", Input(position, name))``: a graph input, by **position** (callers pass inputs by position, so two
  same-shaped inputs swapped under their old names are told apart);
- ``("node", name)``: the output of a node we do not look into (compute), or the bytes an opaque in-place op
  wrote (``("node", "add_[i]")`` for element ``i`` of a ``_foreach_*_`` list);
- ``("uninit", name)``: bytes of an ``empty``/bucket buffer that nothing wrote;
- ``("after", name, storage)``: an uninterpreted view (a transpose) read after its storage was written: it holds
  some bytes of ``storage`` (that storage's whole content), which ones we do not model;
- ``("cast", src, dst, key)``: elements of ``key`` (read as ``src``) converted to ``dst``;
- ``("ag", group, size, member, key)``: ``key`` as held by group member ``member``, gathered;
- ``("rs", op, group, size, key_0, ((key_c, delta_c), ...))``: element j is the ``op``-reduction over the group
  of element j of the local rank's chunk; ``key_c``/``delta_c`` locate chunk c relative to chunk 0, which keeps
  the value independent of which rank we are;
- ``("ar", op, group, key)``: the all-reduce of ``key``.

Only ops that move bytes without reordering are interpreted (views and reshapes, dtype casts and bitcasts,
contiguous slices, splits, cats, copies, ``empty``, torch's ``_pre_bucket_*`` copy-ins, every argument of them,
and the ``_c10d_functional`` collectives); anything else (matmuls, ``mul``, transposes) is *opaque*: its output
is a fresh ``("node", name)`` key. That is deliberate: a parameter multiplied by 2 before its gather is a new key,
not the parameter.

**Writes.** Memory is modelled as storages, each holding one ``Value``: a fresh tensor owns one, a view or an
in-place op's result aliases its argument's (what the op schema's alias annotations say, ``compat.op_effects``,
plus ``wait_tensor`` and ``_unsafe_view``, whose schemas do not). A write (``copy_``, ``_foreach_copy_``, an
``out=`` all-gather, or any op whose schema marks an argument written, ``add_``, ``_foreach_mul_``, ``x.out``)
replaces the bytes of the written view in its storage: with what an interpreted op writes, or with the writer's
own key. A tensor is then read as its storage holds it *when it is read*: a reader moved past a write to what it
reads reads other bytes, and so does the reader of a buffer that the next bucket's all-gather overwrote. Where a
view's place in its storage is known (``address``: the same algebra run on byte offsets), exactly its bytes are
re-read; otherwise the read is ``("after", ...)`` of the whole storage. A collective writes its ``out`` buffer at
its start (reads between start and wait are the structure check's business).

Work is linear in the graph: every node is interpreted once from its inputs' values; a view is re-read only if its
storage was written since it was last read, and addresses are derived only for views written through or re-read.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.byte_runs import (
    _CASTS,
    _EMPTY,
    _RESHAPES,
    _SAME_BYTES,
    ADDRESS,
    INTERPRETED,
    Content,
    Input,
    Key,
    Run,
    Value,
    _all_gather,
    _aten,
    _atom,
    _cast,
    _cat,
    _infer,
    _make,
    _normalized,
    _pre_bucket_all_gather,
    _pre_bucket_reduce_scatter,
    _reduce_scatter,
    _slices,
    opaque,
    overwrite,
    substitute,
)
from overlapcfg.graph.collectives import group_name

__all__ = ["INTERPRETED", "Content", "Interpretation", "Key", "Run", "Value", "Visitor", "describe", "interpret",
           "leaf_name", "opaque", "render_key"]


def _arg(args: Sequence[object], kwargs: dict[str, object], i: int, name: str, default: object = None) -> object:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _bounds(length: int, start: object, end: object) -> tuple[int, int] | None:
    if not isinstance(start, (int, type(None))) or not isinstance(end, (int, type(None))):
        return None
    lo, hi, _ = slice(start, end).indices(length)
    return lo, max(lo, hi)


def _step(node: fx.Node, target: object, args: Sequence[object], kwargs: dict[str, object]) -> Content:
    """The content of one interpreted op that writes nothing, from its inputs' contents (already substituted into
    ``args``); None where the op does something we do not model (the caller then treats it as opaque). Views run
    through here twice: on contents, and on addresses (byte offsets into their storage)."""
    x = args[0] if args else None
    if target is operator.getitem:
        return x[args[1]] if isinstance(x, tuple) and isinstance(args[1], int) else None  # type: ignore[index]
    if target in _EMPTY:
        val = node.meta.get("val")
        size = x
        dtype = kwargs.get("dtype") or (val.dtype if isinstance(val, torch.Tensor) else None)
        if not isinstance(size, (list, tuple)) or not isinstance(dtype, torch.dtype) \
                or not all(isinstance(s, int) for s in size):
            return None
        return _make(size, dtype, ((("uninit", node.name), 0, math.prod(size) * dtype.itemsize),))
    if target is compat.pre_bucket_all_gather:
        if not _all_values(x) or len(args) < 5:
            return None
        return _pre_bucket_all_gather(node, x, args, _arg(args, kwargs, 5, "foreach_group_indices"))  # type: ignore[arg-type]
    if target is compat.pre_bucket_reduce_scatter:
        return _pre_bucket_reduce_scatter(x, args[1]) if _all_values(x) else None  # type: ignore[arg-type]
    if target is compat.REDUCE_SCATTER_TENSOR_COALESCED:
        if not _all_values(x):
            return None
        outs = tuple(_reduce_scatter(v, args[1], args[2], group_name(node)) for v in x)  # type: ignore[union-attr,arg-type]
        return None if None in outs else outs
    if target is compat.ALL_GATHER_INTO_TENSOR_COALESCED:
        if not _all_values(x):
            return None
        outs = tuple(_all_gather(v, args[1], group_name(node)) for v in x)  # type: ignore[union-attr,arg-type]
        return None if None in outs else outs
    if target is _aten.cat.default:
        dim = _arg(args, kwargs, 1, "dim", 0)
        return _cat(x, dim) if _all_values(x) and isinstance(dim, int) else None  # type: ignore[arg-type]
    if not isinstance(x, Value) or x.shape is None or x.dtype is None:
        return None
    if target is compat.WAIT_TENSOR:
        return x
    if target is compat.ALL_GATHER_INTO_TENSOR:
        return _all_gather(x, args[1], group_name(node)) if isinstance(args[1], int) else None
    if target is compat.REDUCE_SCATTER_TENSOR:
        return _reduce_scatter(x, args[1], args[2], group_name(node)) if isinstance(args[2], int) else None  # type: ignore[arg-type]
    if target is compat.ALL_REDUCE:
        return Value(x.shape, x.dtype, _normalized((("ar", args[1], group_name(node), k), s, n) for k, s, n in x.runs))
    if target in _RESHAPES:
        shape = _infer(args[1], math.prod(x.shape))  # type: ignore[arg-type]
        return None if shape is None else Value(shape, x.dtype, x.runs)
    if target in _SAME_BYTES:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or math.prod(val.shape) != math.prod(x.shape):
            return None
        return Value(tuple(int(s) for s in val.shape), x.dtype, x.runs)
    if target is _aten.view.dtype:
        dtype = args[1]
        if not isinstance(dtype, torch.dtype) or not x.shape or (x.shape[-1] * x.dtype.itemsize) % dtype.itemsize:
            return None
        return Value((*x.shape[:-1], x.shape[-1] * x.dtype.itemsize // dtype.itemsize), dtype, x.runs)
    if target in _CASTS:
        dtype = args[1] if target is not _aten._to_copy.default else kwargs.get("dtype") or x.dtype
        return _cast(x, dtype) if isinstance(dtype, torch.dtype) else None
    if target is _aten.copy.default:
        return _copy(x, args[1])
    return _cut(target, x, args, kwargs)


def _cut(target: object, x: Value, args: Sequence[object], kwargs: dict[str, object]) -> Content:
    """Slices, ``narrow`` and splits of ``x`` (contiguous ranges along one dimension, step 1)."""
    assert x.shape is not None
    split = target in (_aten.split.Tensor, _aten.split_with_sizes.default)
    dim = _arg(args, kwargs, 2 if split else 1, "dim", 0)
    if not isinstance(dim, int) or not x.shape:
        return None
    length = x.shape[dim % len(x.shape)]
    if target is _aten.slice.Tensor:
        if _arg(args, kwargs, 4, "step", 1) != 1:
            return None
        bounds = _bounds(length, _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "end"))
        cut = _slices(x, dim, [bounds]) if bounds is not None else None
        return cut[0] if cut else None
    if target is _aten.narrow.default:
        start, n = _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "length")
        if not isinstance(start, int) or not isinstance(n, int) or not 0 <= start <= start + n <= length:
            return None
        cut = _slices(x, dim, [(start, start + n)])
        return cut[0] if cut else None
    if split:
        sizes = args[1]
        if target is _aten.split.Tensor and isinstance(sizes, int) and sizes > 0:
            sizes = [min(sizes, length - i) for i in range(0, length, sizes)]
        if not isinstance(sizes, (list, tuple)) or sum(sizes) != length:
            return None
        edges = [0, *itertools.accumulate(sizes)]
        return _slices(x, dim, list(itertools.pairwise(edges)))
    return None


def _copy(dst: object, src: object) -> Value | None:
    """What ``copy_(dst, src)`` / ``copy(dst, src)`` leaves in ``dst``'s place: ``src`` in ``dst``'s dtype (a
    broadcasting copy is not modelled)."""
    if not isinstance(dst, Value) or not isinstance(src, Value) or src.shape != dst.shape or dst.dtype is None:
        return None
    return _cast(src, dst.dtype)


def _all_values(x: object) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, Value) and v.shape is not None for v in x)


# --- memory: storages, aliases and writes --------------------------------------------------------------------------

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
            written = [_copy(d, s) for d, s in zip(dsts, srcs, strict=True)]
            for i, (dst, content) in enumerate(zip(args[0], written, strict=True)):  # type: ignore[call-overload]
                self._write(dst, content, node, f"{node.name}[{i}]")
            return None not in written
        if target is _aten.copy_.default:
            dst, content = args[0], _copy(read_args[0], read_args[1])
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
            content = _step(node, target, read_args, read_kwargs) if target in INTERPRETED else None  # type: ignore[arg-type]
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
    return _step(view, target, args, kwargs)  # type: ignore[arg-type]


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


# --- words ----------------------------------------------------------------------------------------------------

def leaf_name(key: Key) -> str:
    """The node whose bytes a key ultimately names (the parameter, the gradient), through casts and collectives."""
    while key[0] in ("cast", "ag", "rs", "ar"):
        key = key[4] if key[0] in ("ag", "rs") else key[3]  # type: ignore[assignment]
    return key[1].name if key[0] == "input" else str(key[1])  # type: ignore[union-attr]


def render_key(key: Key) -> str:
    """A key as text: ``all_gather[group '0', 2 ranks](bfloat16(primals_3))``."""
    tag = key[0]
    if tag == "input":
        return key[1].name  # type: ignore[union-attr]
    if tag == "node":
        return str(key[1])
    if tag == "uninit":
        return f"uninitialized({key[1]})"
    if tag == "after":
        return f"{key[1]}(after a write into its storage, now {describe(key[2])})"  # type: ignore[arg-type]
    if tag == "cast":
        return f"{str(key[2]).removeprefix('torch.')}({render_key(key[3])})"  # type: ignore[arg-type]
    if tag == "ag":
        return f"all_gather[group {key[1]!r}, {key[2]} ranks]({render_key(key[4])})"  # type: ignore[arg-type]
    if tag == "rs":
        return f"reduce_scatter[{key[1]}, group {key[2]!r}, {key[3]} ranks]({render_key(key[4])})"  # type: ignore[arg-type]
    return f"all_reduce[{key[1]}, group {key[2]!r}]({render_key(key[3])})"  # type: ignore[arg-type]


def describe(content: Content, limit: int = 3) -> str:
    """``f32[256, 64] = all_gather[group '0', 2 ranks](primals_3)``: shape, dtype and sources, for messages."""
    if content is None:
        return "nothing"
    if isinstance(content, tuple):
        tail = ", ...)" if len(content) > limit else ")"
        return "(" + ", ".join(describe(c, limit) for c in content[:limit]) + tail
    parts: list[str] = []
    for key, _, _ in content.runs:
        text = render_key(key)
        if text not in parts:
            parts.append(text)
    more = f" + {len(parts) - limit} more" if len(parts) > limit else ""
    dtype = str(content.dtype).removeprefix("torch.") if content.dtype is not None else "?"
    shape = list(content.shape) if content.shape is not None else "?"
    return f"{dtype}{shape} = {' + '.join(parts[:limit])}{more}"

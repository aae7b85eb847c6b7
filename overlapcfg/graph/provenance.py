"""Element provenance: for every tensor in a graph, which bytes of which source it holds, row-major.

The verifier needs to know that after bucketing each consumer reads exactly the elements it read before: the same
parameter's all-gathered bytes, the same gradient's reduce-scattered bytes, cast to the same dtype, through the same
process group. Node names cannot tell that (merging erases the collectives and adds copy-ins, splits and views),
so each tensor is described by what it holds::

    primals_3 (64 x f32, this rank's shard)      -> (node primals_3)[0:256)
    all_gather(primals_3, group '0', 2 ranks)    -> (ag '0'/2 rank 0 of (node primals_3))[0:256)
                                                    ++ (ag '0'/2 rank 1 of (node primals_3))[0:256)

A ``Value`` is a shape, a dtype and ``runs``: ``(key, start, nbytes)`` triples, the tensor's bytes in row-major
order, adjacent runs of one key merged (so equal contents compare equal however they were assembled). A key is a
nested tuple naming where bytes come from:

- ``("node", name)``: the output of a node we do not look into (compute, placeholders), by name;
- ``("uninit", name)``: bytes of an ``empty``/bucket buffer that nothing wrote;
- ``("cast", src, dst, key)``: elements of ``key`` (read as ``src``) converted to ``dst``;
- ``("ag", group, size, member, key)``: ``key`` as held by group member ``member``, gathered;
- ``("rs", op, group, size, key_0, ((key_c, delta_c), ...))``: element j is the ``op``-reduction over the group
  of element j of the local rank's chunk; ``key_c``/``delta_c`` locate chunk c relative to chunk 0, which keeps
  the value independent of which rank we are;
- ``("ar", op, group, key)``: the all-reduce of ``key``.

Only ops that move bytes without reordering are interpreted (views and reshapes, dtype casts and bitcasts,
contiguous slices, splits, cats, ``copy_``, ``empty``, torch's ``_pre_bucket_*`` copy-ins and the
``_c10d_functional`` collectives); anything else (matmuls, ``mul``, transposes) is *opaque*: its output is a
fresh ``("node", name)`` key. That is deliberate: a parameter multiplied by 2 before its gather is a new key, not
the parameter. Work is linear in the graph: every node is interpreted once, from its inputs' values.

In-place semantics are modelled only as far as the bucket modes use them: ``copy_(dst, src)`` returns ``src``'s
bytes in ``dst``'s dtype, and an all-gather writes its whole ``out`` buffer.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.collectives import group_name

__all__ = ["INTERPRETED", "Content", "Key", "Run", "Value", "call_of", "describe", "interpret", "leaf_name", "opaque",
           "render_key"]

Key: TypeAlias = tuple[object, ...]
Run: TypeAlias = tuple[Key, int, int]

_MAX_RUNS = 4096
"""A slice or cat that would produce more runs than this (slicing an activation's last dim) stays opaque."""


@dataclass(frozen=True, slots=True)
class Value:
    """One tensor: its shape, dtype and where each of its bytes comes from (see the module docstring)."""

    shape: tuple[int, ...] | None
    """None: unknown (no ``meta["val"]``); such a value is only ever compared, never interpreted further."""
    dtype: torch.dtype | None
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.runs)


Content: TypeAlias = "Value | tuple[Content, ...] | None"
"""A node's content: a tensor, a tuple of them (split, coalesced collectives), or None for non-tensors."""

_aten = torch.ops.aten
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_SAME_BYTES = {_aten.clone.default, _aten.alias.default, _aten.detach.default, _aten.flatten.using_ints,
               _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default, _aten.unsqueeze.default,
               _aten.lift_fresh_copy.default}
_CASTS = {torch.ops.prims.convert_element_type.default, _aten._to_copy.default}
_EMPTY = {_aten.empty.memory_format, _aten.empty_strided.default}
_ALL_GATHERS = {compat.ALL_GATHER_INTO_TENSOR, compat.ALL_GATHER_INTO_TENSOR_OUT}
INTERPRETED = frozenset({
    *_RESHAPES, *_SAME_BYTES, *_CASTS, *_EMPTY, *_ALL_GATHERS, _aten.view.dtype, _aten.slice.Tensor,
    _aten.narrow.default, _aten.split.Tensor, _aten.split_with_sizes.default, _aten.cat.default,
    _aten.copy_.default, _aten.copy.default, compat.pre_bucket_all_gather, compat.pre_bucket_reduce_scatter,
    compat.REDUCE_SCATTER_TENSOR, compat.REDUCE_SCATTER_TENSOR_COALESCED, compat.ALL_GATHER_INTO_TENSOR_COALESCED,
    compat.ALL_REDUCE, compat.WAIT_TENSOR,
    operator.getitem,
})
"""Targets whose output is computed from their inputs' provenance; every other op is opaque."""


def _normalized(runs: Iterable[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for key, start, n in runs:
        if n <= 0:
            continue
        if out and out[-1][0] == key and out[-1][1] + out[-1][2] == start:
            out[-1] = (key, out[-1][1], out[-1][2] + n)
        else:
            out.append((key, start, n))
    return tuple(out)


def _atom(key: Key, val: object) -> Value:
    if isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape):
        shape = tuple(int(s) for s in val.shape)
        return Value(shape, val.dtype, ((key, 0, math.prod(shape) * val.dtype.itemsize),))
    return Value(None, None, ((key, 0, 0),))


def opaque(node: fx.Node) -> Value:
    """The value of a node we do not look into: its own bytes, under its name."""
    return _atom(("node", node.name), node.meta.get("val"))


class _Cut:
    """Byte-range extraction from one value's runs in O(log runs) per range."""

    def __init__(self, value: Value) -> None:
        self.runs = value.runs
        self.starts = [0]
        for _, _, n in self.runs:
            self.starts.append(self.starts[-1] + n)

    def take(self, lo: int, hi: int, out: list[Run]) -> None:
        i = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            key, start, n = self.runs[i]
            off = lo - self.starts[i]
            size = min(n - off, hi - lo)
            out.append((key, start + off, size))
            lo += size
            i += 1


def _make(shape: Sequence[int], dtype: torch.dtype, runs: Iterable[Run]) -> Value | None:
    value = Value(tuple(shape), dtype, _normalized(runs))
    return value if value.nbytes == math.prod(value.shape) * dtype.itemsize else None  # type: ignore[arg-type]


def _cast(value: Value, dtype: torch.dtype) -> Value | None:
    src = value.dtype
    if src is None or value.shape is None:
        return None
    if src == dtype:
        return value
    a, b = src.itemsize, dtype.itemsize
    if any(s % a or n % a for _, s, n in value.runs):
        return None
    return _make(value.shape, dtype, ((("cast", src, dtype, k), s // a * b, n // a * b) for k, s, n in value.runs))


def _infer(size: Sequence[object], numel: int) -> tuple[int, ...] | None:
    if not all(isinstance(s, int) for s in size):
        return None
    dims = [int(s) for s in size]  # type: ignore[call-overload]
    if dims.count(-1) == 1:
        rest = math.prod(d for d in dims if d != -1)
        if rest == 0 or numel % rest:
            return None
        dims[dims.index(-1)] = numel // rest
    return tuple(dims) if math.prod(dims) == numel else None


def _slices(value: Value, dim: int, bounds: Sequence[tuple[int, int]]) -> tuple[Value, ...] | None:
    """``value`` cut along ``dim`` into the half-open index ranges ``bounds`` (all contiguous, step 1)."""
    shape, dtype = value.shape, value.dtype
    if shape is None or dtype is None or not shape:
        return None
    dim %= len(shape)
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1:]) * dtype.itemsize
    row = shape[dim] * inner
    if outer * len(bounds) > _MAX_RUNS:
        return None
    cut, out = _Cut(value), []
    for lo, hi in bounds:
        runs: list[Run] = []
        for o in range(outer):
            cut.take(o * row + lo * inner, o * row + hi * inner, runs)
        made = _make((*shape[:dim], hi - lo, *shape[dim + 1:]), dtype, runs)
        if made is None:
            return None
        out.append(made)
    return tuple(out)


def _cat(values: Sequence[Value], dim: int) -> Value | None:
    values = [v for v in values if v.shape != (0,)]  # legacy empty tensors are skipped by cat
    if not values or any(v.shape is None or v.dtype != values[0].dtype for v in values):
        return None
    first = values[0].shape
    assert first is not None and values[0].dtype is not None
    dim %= len(first)
    if any(len(v.shape) != len(first) or v.shape[:dim] != first[:dim] or v.shape[dim + 1:] != first[dim + 1:]
           for v in values):  # type: ignore[arg-type]
        return None
    outer = math.prod(first[:dim])
    if outer * len(values) > _MAX_RUNS:
        return None
    cuts = [(_Cut(v), v.nbytes // outer if outer else 0) for v in values]
    runs: list[Run] = []
    for o in range(outer):
        for cut, row in cuts:
            cut.take(o * row, (o + 1) * row, runs)
    shape = (*first[:dim], sum(v.shape[dim] for v in values), *first[dim + 1:])  # type: ignore[index]
    return _make(shape, values[0].dtype, runs)


def _all_gather(value: Value, size: int, group: str) -> Value | None:
    if value.shape is None or value.dtype is None:
        return None
    shape = (size * value.shape[0], *value.shape[1:]) if value.shape else (size,)
    runs = [(("ag", group, size, q, k), s, n) for q in range(size) for k, s, n in value.runs]
    return _make(shape, value.dtype, runs)


def _reduce_scatter(value: Value, op: str, size: int, group: str) -> Value | None:
    shape, dtype = value.shape, value.dtype
    if shape is None or dtype is None or not shape or size <= 0 or shape[0] % size:
        return None
    chunk = value.nbytes // size
    cut = _Cut(value)
    chunks: list[list[Run]] = []
    for c in range(size):
        runs: list[Run] = []
        cut.take(c * chunk, (c + 1) * chunk, runs)
        chunks.append(runs)
    # Walk the chunks in step, cutting at every run boundary of any of them.
    out: list[Run] = []
    pos = [0] * size  # index of the current run per chunk
    used = [0] * size  # bytes of it already consumed
    done = 0
    while done < chunk:
        here = [(chunks[c][pos[c]][0], chunks[c][pos[c]][1] + used[c]) for c in range(size)]
        step = min(chunks[c][pos[c]][2] - used[c] for c in range(size))
        key0, start0 = here[0]
        out.append((("rs", op, group, size, key0, tuple((k, s - start0) for k, s in here[1:])), start0, step))
        for c in range(size):
            used[c] += step
            if used[c] == chunks[c][pos[c]][2]:
                pos[c], used[c] = pos[c] + 1, 0
        done += step
    return _make((shape[0] // size, *shape[1:]), dtype, out)


def _pre_bucket_all_gather(node: fx.Node, ins: Sequence[Value], args: Sequence[object]) -> Value | None:
    size, dtype, dtype_ints, rank = args[1], args[2], args[3], args[4]
    if not isinstance(size, int) or not isinstance(rank, int) or not isinstance(dtype, torch.dtype) \
            or not isinstance(dtype_ints, (list, tuple)) or len(dtype_ints) != len(ins):
        return None
    slot: list[Run] = []
    for value, index in zip(ins, dtype_ints, strict=True):
        cast = _cast(value, compat.bucket_dtype_table[index])  # type: ignore[index]
        if cast is None:
            return None
        slot.extend(cast.runs)
    slot_bytes = sum(n for _, _, n in slot)
    if slot_bytes % dtype.itemsize:
        return None
    runs: list[Run] = []
    for q in range(size):
        runs.extend(slot if q == rank else [(("uninit", node.name), q * slot_bytes, slot_bytes)])
    return _make((size * slot_bytes // dtype.itemsize,), dtype, runs)


def _pre_bucket_reduce_scatter(ins: Sequence[Value], size: object) -> Value | None:
    if not isinstance(size, int) or not ins:
        return None
    rows = []
    for value in ins:
        if value.shape is None or value.dtype is None:
            return None
        rows.append(Value((size, value.nbytes // size // value.dtype.itemsize), value.dtype, value.runs))
    cat = _cat(rows, 1)
    return None if cat is None or cat.shape is None else _make((math.prod(cat.shape),), cat.dtype, cat.runs)


def _arg(args: Sequence[object], kwargs: dict[str, object], i: int, name: str, default: object = None) -> object:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _bounds(length: int, start: object, end: object) -> tuple[int, int] | None:
    if not isinstance(start, (int, type(None))) or not isinstance(end, (int, type(None))):
        return None
    lo, hi, _ = slice(start, end).indices(length)
    return lo, max(lo, hi)


def _step(node: fx.Node, target: object, args: Sequence[object], kwargs: dict[str, object]) -> Content:
    """The content of one interpreted op from its inputs' contents (already substituted into ``args``);
    None where the op does something we do not model (the caller then treats it as opaque)."""
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
        return _pre_bucket_all_gather(node, x, args) if _all_values(x) else None  # type: ignore[arg-type]
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
    if target in _ALL_GATHERS:
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
    if target in (_aten.copy_.default, _aten.copy.default):
        src = args[1]
        if not isinstance(src, Value) or src.shape != x.shape:
            return None
        return _cast(src, x.dtype)
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


def _all_values(x: object) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, Value) and v.shape is not None for v in x)


def call_of(node: fx.Node) -> tuple[object, tuple[object, ...], dict[str, object]]:
    """``(target, args, kwargs)`` of a call, seeing through a ``control_deps`` wrapper (its deps only order)."""
    target, inputs, _ = compat.unwrap_control_deps(node)
    if target is node.target or node.op != "call_function":
        return node.target, node.args, dict(node.kwargs)
    subgraph = getattr(node.graph.owning_module, node.args[1].target)  # type: ignore[union-attr]
    inner = next(n for n in subgraph.graph.nodes if n.op == "call_function")
    placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
    outer = dict(zip(placeholders, inputs, strict=True))
    args = fx.map_arg(inner.args, lambda n: outer.get(n, n))  # type: ignore[arg-type,return-value]
    kwargs = fx.map_arg(inner.kwargs, lambda n: outer.get(n, n))  # type: ignore[arg-type,return-value]
    return inner.target, tuple(args), dict(kwargs)


def interpret(graph: fx.Graph) -> tuple[dict[fx.Node, Content], set[fx.Node]]:
    """Every node's content, and the set of nodes left opaque (compute, or an op we could not model)."""
    contents: dict[fx.Node, Content] = {}
    opaque_nodes: set[fx.Node] = set()

    def lookup(n: fx.Node) -> Content:
        # A node read before it is computed (a broken order, reported by the verifier) reads as opaque.
        return contents[n] if n in contents else opaque(n)

    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            target, args, kwargs = call_of(node)
            if target in INTERPRETED:
                args = fx.map_arg(args, lookup)
                kwargs = fx.map_arg(kwargs, lookup)
                content = _step(node, target, args, kwargs)
                if content is not None:
                    contents[node] = content
                    continue
            opaque_nodes.add(node)
            contents[node] = opaque(node)
        elif node.op == "output":
            continue
        else:
            contents[node] = opaque(node)
    return contents, opaque_nodes


def leaf_name(key: Key) -> str:
    """The node whose bytes a key ultimately names (the parameter, the gradient), through casts and collectives."""
    while key[0] != "node" and key[0] != "uninit":
        key = key[4] if key[0] in ("ag", "rs") else key[3]  # type: ignore[assignment]
    return str(key[1])


def render_key(key: Key) -> str:
    """A key as text: ``all_gather[group '0', 2 ranks](bfloat16(primals_3))``."""
    tag = key[0]
    if tag == "node":
        return str(key[1])
    if tag == "uninit":
        return f"uninitialized({key[1]})"
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

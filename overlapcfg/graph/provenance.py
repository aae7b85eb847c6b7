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
and the ``_c10d_functional`` collectives: ``overlapcfg.graph.ops.INTERPRETED``); anything else (matmuls, ``mul``,
transposes) is *opaque*: its output is a fresh ``("node", name)`` key. That is deliberate: a parameter multiplied
by 2 before its gather is a new key, not the parameter.

How contents change when memory is written (in-place ops, ``out=`` buffers), and so what a tensor holds when it
is read, is ``overlapcfg.graph.memory``'s job; this module says what each op makes of what it reads. Work is
linear in the graph: every node is interpreted once, from its inputs' values.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import TypeGuard, cast

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.byte_runs import (
    Content,
    Key,
    Run,
    Value,
    _all_gather,
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
)
from overlapcfg.graph.ops import ALLOCATIONS, CASTS, RESHAPES, SAME_BYTES, group_name

__all__ = ["Content", "Key", "Run", "Value", "describe", "leaf_name", "opaque", "render_key", "step"]

_aten = torch.ops.aten


def _arg(args: Sequence[object], kwargs: dict[str, object], i: int, name: str, default: object = None) -> object:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _bounds(length: int, start: object, end: object) -> tuple[int, int] | None:
    if not isinstance(start, (int, type(None))) or not isinstance(end, (int, type(None))):
        return None
    lo, hi, _ = slice(start, end).indices(length)
    return lo, max(lo, hi)


def step(node: fx.Node, target: object, args: Sequence[object], kwargs: dict[str, object]) -> Content:
    """The content of one interpreted op that writes nothing, from its inputs' contents (already substituted into
    ``args``); None where the op does something we do not model (the caller then treats it as opaque). Views run
    through here twice: on contents, and on addresses (byte offsets into their storage)."""
    x = args[0] if args else None
    if target is operator.getitem:
        return x[args[1]] if isinstance(x, tuple) and isinstance(args[1], int) else None
    if target in ALLOCATIONS:
        val = node.meta.get("val")
        size = x
        dtype = kwargs.get("dtype") or (val.dtype if isinstance(val, torch.Tensor) else None)
        if not isinstance(size, (list, tuple)) or not isinstance(dtype, torch.dtype) \
                or not all(isinstance(s, int) for s in size):
            return None
        return _make(size, dtype, ((("uninit", node.name), 0, math.prod(size) * dtype.itemsize),))
    if target is compat.pre_bucket_all_gather:
        bound = compat.pre_bucket_all_gather_arguments(args, kwargs)  # by name: positions differ between releases
        if not _all_values(x) or any(k not in bound for k in ("group_size", "dtype", "out_dtype_ints", "rank")):
            return None
        return _pre_bucket_all_gather(node, x, bound["group_size"], bound["dtype"], bound["out_dtype_ints"],
                                      bound["rank"], bound.get("foreach_group_indices"))
    if target is compat.pre_bucket_reduce_scatter:
        return _pre_bucket_reduce_scatter(x, args[1]) if _all_values(x) else None
    if target is compat.REDUCE_SCATTER_TENSOR_COALESCED:
        if not _all_values(x):
            return None
        op, size = cast(str, args[1]), cast(int, args[2])  # the op's own arguments: reduce op, group size
        outs = tuple(_reduce_scatter(v, op, size, group_name(node)) for v in x)
        return None if None in outs else outs
    if target is compat.ALL_GATHER_INTO_TENSOR_COALESCED:
        if not _all_values(x):
            return None
        outs = tuple(_all_gather(v, cast(int, args[1]), group_name(node)) for v in x)  # args[1]: the group size
        return None if None in outs else outs
    if target is _aten.cat.default:
        dim = _arg(args, kwargs, 1, "dim", 0)
        return _cat(x, dim) if _all_values(x) and isinstance(dim, int) else None
    if not isinstance(x, Value) or x.shape is None or x.dtype is None:
        return None
    if target is compat.WAIT_TENSOR:
        return x
    if target is compat.ALL_GATHER_INTO_TENSOR:
        return _all_gather(x, args[1], group_name(node)) if isinstance(args[1], int) else None
    if target is compat.REDUCE_SCATTER_TENSOR:
        reduce_op, ranks = args[1], args[2]
        if not (isinstance(reduce_op, str) and isinstance(ranks, int)):
            return None
        return _reduce_scatter(x, reduce_op, ranks, group_name(node))
    if target is compat.ALL_REDUCE:
        return Value(x.shape, x.dtype, _normalized((("ar", args[1], group_name(node), k), s, n) for k, s, n in x.runs))
    if target in RESHAPES:
        sizes = args[1]  # the view's size list
        shape = _infer(sizes, math.prod(x.shape)) if isinstance(sizes, (list, tuple)) else None
        return None if shape is None else Value(shape, x.dtype, x.runs)
    if target in SAME_BYTES:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or math.prod(val.shape) != math.prod(x.shape):
            return None
        return Value(tuple(int(s) for s in val.shape), x.dtype, x.runs)
    if target is _aten.view.dtype:
        dtype = args[1]
        if not isinstance(dtype, torch.dtype) or not x.shape or (x.shape[-1] * x.dtype.itemsize) % dtype.itemsize:
            return None
        return Value((*x.shape[:-1], x.shape[-1] * x.dtype.itemsize // dtype.itemsize), dtype, x.runs)
    if target in CASTS:
        dtype = args[1] if target is not _aten._to_copy.default else kwargs.get("dtype") or x.dtype
        return _cast(x, dtype) if isinstance(dtype, torch.dtype) else None
    if target is _aten.copy.default:
        return copy_content(x, args[1])
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


def copy_content(dst: object, src: object) -> Value | None:
    """What ``copy_(dst, src)`` / ``copy(dst, src)`` leaves in ``dst``'s place: ``src`` in ``dst``'s dtype (a
    broadcasting copy is not modelled)."""
    if not isinstance(dst, Value) or not isinstance(src, Value) or src.shape != dst.shape or dst.dtype is None:
        return None
    return _cast(src, dst.dtype)


def _all_values(x: object) -> TypeGuard[Sequence[Value]]:
    return isinstance(x, (list, tuple)) and all(isinstance(v, Value) and v.shape is not None for v in x)


# --- words ----------------------------------------------------------------------------------------------------

def leaf_name(key: Key) -> str:
    """The node whose bytes a key ultimately names (the parameter, the gradient), through casts and collectives."""
    while key[0] in ("cast", "ag", "rs", "ar"):
        key = cast(Key, key[4] if key[0] in ("ag", "rs") else key[3])
    return cast(fx.Node, key[1]).name if key[0] == "input" else str(key[1])


def render_key(key: Key) -> str:
    """A key as text: ``all_gather[group '0', 2 ranks](bfloat16(primals_3))``."""
    tag = key[0]
    if tag == "input":
        return cast(fx.Node, key[1]).name
    if tag == "node":
        return str(key[1])
    if tag == "uninit":
        return f"uninitialized({key[1]})"
    # a key's parts are typed object (Key is a tuple of anything); by tag they are keys or contents
    if tag == "after":
        return f"{key[1]}(after a write into its storage, now {describe(cast(Content, key[2]))})"
    if tag == "cast":
        return f"{str(key[2]).removeprefix('torch.')}({render_key(cast(Key, key[3]))})"
    if tag == "ag":
        return f"all_gather[group {key[1]!r}, {key[2]} ranks]({render_key(cast(Key, key[4]))})"
    if tag == "rs":
        return f"reduce_scatter[{key[1]}, group {key[2]!r}, {key[3]} ranks]({render_key(cast(Key, key[4]))})"
    return f"all_reduce[{key[1]}, group {key[2]!r}]({render_key(cast(Key, key[3]))})"


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

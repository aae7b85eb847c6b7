"""Byte runs: the value algebra of element provenance (``overlapcfg.graph.provenance``).

A ``Value`` is a shape, a dtype and the tensor's bytes in row-major order as ``(key, start, nbytes)`` runs; this
module builds and transforms them (casts, slices, splits, cats, the collectives and torch's bucket copy-ins),
merging adjacent runs so equal contents compare equal however they were assembled. Which graph ops map to which
transform is ``provenance``'s job (the ops themselves, in families, are ``overlapcfg.graph.ops``').
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import torch
from torch import fx

from overlapcfg import compat

__all__ = ["ADDRESS", "Content", "Input", "Key", "Run", "Value", "overwrite", "substitute"]

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


@dataclass(frozen=True, slots=True)
class Input:
    """A graph input in a key: ``("input", Input(2, "primals_3"))``. Inputs are passed by position, so two graphs'
    inputs are the same input when their positions are; the name is kept only to word messages."""

    position: int
    name: str = field(compare=False)


ADDRESS: Key = ("address",)
"""The key of an *address*: a ``Value`` whose runs ``(ADDRESS, offset, nbytes)`` say which bytes of its storage a
view is made of, in the view's row-major order. The views' transforms build addresses as they build contents."""

Content: TypeAlias = "Value | tuple[Content, ...] | None"
"""A node's content: a tensor, a tuple of them (split, coalesced collectives), or None for non-tensors."""



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
    if isinstance(val, torch.Tensor):  # each attribute of a fake tensor costs a call: read shape and dtype once
        shape, dtype = tuple(val.shape), val.dtype
        numel = math.prod(shape)
        if type(numel) is int:  # static shape (a symbolic one gives a SymInt)
            return Value(shape, dtype, ((key, 0, numel * dtype.itemsize),))
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
    # Value's shape is Optional in general, set here from the given shape
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
    # every s is an int (checked just above); mypy does not narrow through all()
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
    shapes = [v.shape for v in values if v.shape is not None and v.dtype == values[0].dtype]
    if not values or len(shapes) != len(values):
        return None
    first, dtype = shapes[0], values[0].dtype
    if dtype is None:
        raise AssertionError("byte_runs: a value with a shape has a dtype")  # a bug check: Value is made so
    dim %= len(first)
    if any(len(s) != len(first) or s[:dim] != first[:dim] or s[dim + 1:] != first[dim + 1:] for s in shapes):
        return None
    outer = math.prod(first[:dim])
    if outer * len(values) > _MAX_RUNS:
        return None
    cuts = [(_Cut(v), v.nbytes // outer if outer else 0) for v in values]
    runs: list[Run] = []
    for o in range(outer):
        for cut, row in cuts:
            cut.take(o * row, (o + 1) * row, runs)
    shape = (*first[:dim], sum(s[dim] for s in shapes), *first[dim + 1:])
    return _make(shape, dtype, runs)


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


def _copied(groups: object, n: int) -> set[int] | None:
    """The inputs ``_pre_bucket_all_gather`` copies into its slot: all ``n`` without ``foreach_group_indices``, else
    those its ``-1``-delimited groups list (an index left out leaves its bytes of the slot unwritten)."""
    if groups is None:
        return set(range(n))
    if not isinstance(groups, (list, tuple)) or not all(isinstance(i, int) and -1 <= i < n for i in groups):
        return None
    return {i for i in groups if i >= 0}


def _pre_bucket_all_gather(node: fx.Node, ins: Sequence[Value], size: object, dtype: object, dtype_ints: object,
                           rank: object, groups: object = None) -> Value | None:
    """``_pre_bucket_all_gather(ag_ins, group_size, dtype, out_dtype_ints, rank, foreach_group_indices)`` (its
    arguments by name: ``compat.pre_bucket_all_gather_arguments``): a buffer of ``group_size`` slots, this rank's
    holding each copied input cast to its ``out_dtype_ints`` dtype, back to back."""
    if not isinstance(size, int) or not isinstance(rank, int) or not isinstance(dtype, torch.dtype) \
            or not isinstance(dtype_ints, (list, tuple)) or len(dtype_ints) != len(ins) or not 0 <= rank < size \
            or not all(isinstance(i, int) and 0 <= i < len(compat.bucket_dtype_table) for i in dtype_ints):
        return None
    copied = _copied(groups, len(ins))
    if copied is None:
        return None
    slot: list[Run] = []
    slot_bytes = 0
    for i, (value, index) in enumerate(zip(ins, dtype_ints, strict=True)):
        cast = _cast(value, compat.bucket_dtype_table[index])
        if cast is None:
            return None
        slot.extend(cast.runs if i in copied else [(("uninit", node.name, "slot"), slot_bytes, cast.nbytes)])
        slot_bytes += cast.nbytes
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
    if cat is None or cat.shape is None or cat.dtype is None:
        return None
    return _make((math.prod(cat.shape),), cat.dtype, cat.runs)


# --- storage: reading a view of a storage, writing into one -------------------------------------------------------

def _placed(address: Value, content: Value) -> list[tuple[int, list[Run]]] | None:
    """``content``'s bytes cut to the storage offsets ``address`` names, as ``(offset, runs)`` pieces."""
    if address.nbytes != content.nbytes:
        return None
    cut, out, done = _Cut(content), [], 0
    for _, offset, n in address.runs:
        runs: list[Run] = []
        cut.take(done, done + n, runs)
        out.append((offset, runs))
        done += n
    return out


def substitute(address: Value, storage: Value) -> Value | None:
    """What a view holds: the bytes of ``storage`` (a storage's whole content) that ``address`` names."""
    if storage.shape is None or address.shape is None or address.dtype is None:
        return None
    if any(offset + n > storage.nbytes for _, offset, n in address.runs):
        return None
    cut, runs = _Cut(storage), list[Run]()
    for _, offset, n in address.runs:
        cut.take(offset, offset + n, runs)
    return Value(address.shape, address.dtype, _normalized(runs))


def overwrite(storage: Value, address: Value, content: Value) -> Value | None:
    """``storage`` after ``content`` is written into the view ``address`` names (None: not expressible, e.g. the
    sizes disagree). Linear in the runs of the three."""
    pieces = _placed(address, content)
    if pieces is None or storage.shape is None:
        return None
    pieces.sort(key=operator.itemgetter(0))
    cut, runs, pos = _Cut(storage), list[Run](), 0
    for offset, piece in pieces:
        if offset < pos or offset > storage.nbytes:
            return None  # overlapping or out-of-bounds pieces: a view we cannot place
        cut.take(pos, offset, runs)
        runs.extend(piece)
        pos = offset + sum(n for _, _, n in piece)
    if pos > storage.nbytes:
        return None
    cut.take(pos, storage.nbytes, runs)
    return Value(storage.shape, storage.dtype, _normalized(runs))

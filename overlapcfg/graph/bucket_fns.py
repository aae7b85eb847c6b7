"""What one merged bucket computes, for each bucket mode: the functions ``overlapcfg.graph.stamp`` traces and stamps
in place of a bucket's collectives (pack the inputs into one flat buffer, run one collective, wait, unpack).

Written by overlapcfg from the op sequences torch 2.13's inductor bucketing emits, as recorded in
``tests/graph/golden/merged_graphs.json`` and compared node for node with upstream's pass in
``tests/graph/test_merge_speed_invariants.py`` and ``tests/graph/test_mixed_precision.py``; no upstream code. The
graph is the contract, so every tensor call below is chosen for the node ``make_fx`` records for it (the comments
say which), and the order of the calls is the order of the nodes.

The packing, for ``G`` ranks and inputs ``x_0 .. x_n``:

- **all-gather**: the gathered buffer is ``G`` rows, row ``r`` being rank ``r``'s shards laid end to end; this rank
  writes its row, the collective fills the others, and each gathered parameter is the ``i``-th column block of the
  rows, reshaped to ``(G * rows_i, ...)``. ``custom_ops*`` modes write the row with inductor's
  ``bucketing::_pre_bucket_all_gather`` (which also casts, and may mix dtypes: the buffer then holds each shard's
  bytes in units of the narrowest dtype, and each block is viewed back as its own dtype); ``default`` and
  ``coalesced`` with ``empty`` + ``copy_`` of a ``cat``.
- **reduce-scatter**: each gradient, seen as ``G`` rows, contributes its ``r``-th row to the ``r``-th part of the
  flat input, so rank ``r`` gets back its shards end to end; ``custom_ops*`` builds the input with
  ``bucketing::_pre_bucket_reduce_scatter``, ``default`` with ``cat(dim=1)``, and ``coalesced`` hands the
  flattened gradients to ``reduce_scatter_tensor_coalesced`` as a list instead.
- **all-reduce** (HSDP's replicate half): the flattened gradients end to end, reduced, split back; one form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.config.policy import BucketMode
from overlapcfg.errors import UnsupportedGraphError

if TYPE_CHECKING:
    from overlapcfg.kinds import CollectiveKind

__all__ = ["MergeFn", "bucket_dtype", "foreach_groups", "group_key", "group_name_of", "merge_fn"]

MergeFn: TypeAlias = Callable[..., list[torch.Tensor]]
"""A merge function: the bucket's inputs (a list of tensors) first, then the group argument, then constants
(``overlapcfg.graph.merge`` builds the argument lists). Returns one tensor per replaced collective, in input order."""

def group_name_of(arg: object) -> str:
    """A collective's process-group argument as a name: a string, or (compile-on-one-rank graphs) a node whose
    fake value is the process group."""
    if isinstance(arg, str):
        return arg
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
    name = getattr(value, "group_name", None)
    if isinstance(name, str):
        return name
    raise UnsupportedGraphError(f"overlapcfg merge: cannot tell which process group {arg!r} names (neither a group "
                                "name nor a node whose value is a process group)")


def group_key(node: fx.Node, kind: CollectiveKind, mode: BucketMode) -> tuple[object, ...]:
    """Collectives of one bucket with equal keys merge into one: all-gathers by group (and dtype, except in
    ``custom_ops_multidtype``), reduce-scatters and all-reduces by group, reduce op and dtype."""
    group = group_name_of(node.args[-1])
    dtype = node.meta["val"].dtype
    if kind == "all_gather":
        return (group,) if mode == "custom_ops_multidtype" else (group, dtype)
    return (group, node.args[1], dtype)  # (input, reduce_op, ...): the reduce op is the second argument


def bucket_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The flat buffer's dtype: the narrowest of the bucket's (a mixed bucket is sent as bytes of that width)."""
    return min(dtypes, key=lambda d: d.itemsize)  # the first of equal widths


def foreach_groups(ins: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype]) -> list[int] | None:
    """Indices of copy-in inputs with equal (source dtype, destination dtype, shape), flat with ``-1`` between
    groups (``[0, 2, -1, 1]`` is ``[[0, 2], [1]]``), or None where there is one group: ``_foreach_copy_`` falls
    back to its slow path on mixed groups."""
    by_kind: dict[tuple[object, ...], list[int]] = {}  # first appearance decides a group's place
    for index, (x, out_dtype) in enumerate(zip(ins, out_dtypes, strict=True)):
        shape = tuple(compat.size_hint(size) for size in x.shape)  # a symbolic size groups by its hint
        by_kind.setdefault((x.dtype, out_dtype, shape), []).append(index)
    if len(by_kind) == 1:
        return None
    flat: list[int] = []
    for members in by_kind.values():
        if flat:
            flat.append(-1)
        flat += members
    return flat


# --- shared pieces ------------------------------------------------------------------------------------------------
# Sizes are counted in elements of the flat buffer's dtype: a shard of ``n`` elements of dtype ``d`` occupies
# ``n * d.itemsize / buffer.itemsize`` of them (the narrowest dtype divides every wider one).


def _slot_sizes(shards: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype], dtype: torch.dtype) -> list[int]:
    return [x.numel() * out.itemsize // dtype.itemsize for x, out in zip(shards, out_dtypes, strict=True)]


def _gathered_shape(shard: torch.Tensor, group_size: int) -> list[int]:
    return [shard.shape[0] * group_size, *shard.shape[1:]]


def _scattered_shape(grad: torch.Tensor, group_size: int) -> list[int]:
    return [grad.shape[0] // group_size, *grad.shape[1:]]


def _unpack_gathered(gathered: torch.Tensor, shards: Sequence[torch.Tensor], group_size: int,
                     out_dtypes: Sequence[torch.dtype], dtype: torch.dtype, *, as_dtypes: bool) -> list[torch.Tensor]:
    """Wait for the gathered buffer and cut it into the parameters: ``G`` rows (``view``), one column block per
    shard (``split_with_sizes`` along dim 1, then its ``getitem`` nodes), each block reshaped to the gathered
    parameter (``view`` where its layout allows, else ``clone`` + ``_unsafe_view``); with ``as_dtypes`` each block
    is first viewed as its own dtype (``view.dtype``, recorded even where the dtype is the buffer's)."""
    rows = compat.WAIT_TENSOR(gathered).view(group_size, -1)
    blocks = rows.split(_slot_sizes(shards, out_dtypes, dtype), 1)
    params = []
    for block, shard, out_dtype in zip(blocks, shards, out_dtypes, strict=True):
        typed = block.view(out_dtype) if as_dtypes else block
        params.append(typed.reshape(_gathered_shape(shard, group_size)))
    return params


def _unpack_reduced(flat: torch.Tensor, shapes: Sequence[list[int]]) -> list[torch.Tensor]:
    """Wait for a reduced flat buffer and cut it into pieces of ``shapes`` (``split_with_sizes``, ``getitem`` per
    piece, then a ``view`` each)."""
    numels = [_numel(shape) for shape in shapes]
    pieces = compat.WAIT_TENSOR(flat).split(numels)
    return [piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _reduce_scatter_flat(flat: torch.Tensor, grads: Sequence[torch.Tensor], group: object, group_size: int,
                         reduce_op: str) -> list[torch.Tensor]:
    """One reduce-scatter of the packed gradients, and this rank's shards cut from its result."""
    scattered = compat.REDUCE_SCATTER_TENSOR(flat, reduce_op, group_size, group)
    return _unpack_reduced(scattered, [_scattered_shape(g, group_size) for g in grads])


# --- the merge functions, one per (kind, form) --------------------------------------------------------------------


def _gather_by_copy(shards: list[torch.Tensor], group: object, group_size: int, dtype: torch.dtype,
                    out_dtypes: list[torch.dtype], rank: int) -> list[torch.Tensor]:
    """All-gather, ``default``: ``empty`` buffer, this rank's row (``slice``), ``copy_`` of the ``cat`` of the
    flattened shards into it (the copy casts where the shards were cast before gathering), the collective into the
    buffer."""
    row = sum(_slot_sizes(shards, out_dtypes, dtype))
    buffer = torch.empty(row * group_size, dtype=dtype, device=shards[0].device)
    mine = buffer[rank * row:(rank + 1) * row]
    filled = mine.copy_(torch.cat([x.reshape(-1) for x in shards]))
    gathered = compat.ALL_GATHER_INTO_TENSOR_OUT(filled, group_size, group, out=buffer)
    return _unpack_gathered(gathered, shards, group_size, out_dtypes, dtype, as_dtypes=False)


def _gather_by_copy_op(shards: list[torch.Tensor], group: object, group_size: int, dtype: torch.dtype,
                       out_dtypes: list[torch.dtype], rank: int) -> list[torch.Tensor]:
    """All-gather, ``custom_ops`` and ``custom_ops_multidtype``: inductor's copy-in op allocates the buffer and
    writes (and casts) this rank's row; the collective reads that row (``slice``) into the buffer."""
    row = sum(_slot_sizes(shards, out_dtypes, dtype))
    buffer = compat.call_pre_bucket_all_gather(
        ag_ins=shards, group_size=group_size, group_name=group, dtype=dtype,
        out_dtype_ints=[compat.bucket_dtype_table.index(d) for d in out_dtypes], rank=rank,
        foreach_group_indices=foreach_groups(shards, out_dtypes))
    gathered = compat.ALL_GATHER_INTO_TENSOR_OUT(buffer[rank * row:(rank + 1) * row], group_size, group, out=buffer)
    return _unpack_gathered(gathered, shards, group_size, out_dtypes, dtype, as_dtypes=True)


def _scatter_by_cat(grads: list[torch.Tensor], group: object, group_size: int, reduce_op: str) -> list[torch.Tensor]:
    """Reduce-scatter, ``default``: each gradient as ``G`` rows (``reshape``: a ``view``, or ``clone`` +
    ``_unsafe_view``), the rows side by side (``cat`` along dim 1), flattened (``view``)."""
    rows = torch.cat([g.reshape(group_size, -1) for g in grads], 1)
    return _reduce_scatter_flat(rows.flatten(), grads, group, group_size, reduce_op)


def _scatter_by_copy_op(grads: list[torch.Tensor], group: object, group_size: int,
                        reduce_op: str) -> list[torch.Tensor]:
    """Reduce-scatter, ``custom_ops*``: inductor's copy-in op lays the gradients out as ``_scatter_by_cat`` does."""
    flat = compat.pre_bucket_reduce_scatter(grads, group_size)
    return _reduce_scatter_flat(flat, grads, group, group_size, reduce_op)


def _scatter_coalesced(grads: list[torch.Tensor], group: object, group_size: int,
                       reduce_op: str) -> list[torch.Tensor]:
    """Reduce-scatter, ``coalesced``: no copy-in; the flattened gradients go to one coalesced collective, whose
    outputs (a ``getitem`` each) are waited, then each viewed as its shard."""
    outputs = compat.REDUCE_SCATTER_TENSOR_COALESCED([g.reshape(-1) for g in grads], reduce_op, group_size, group)
    waited = [compat.WAIT_TENSOR(out) for out in outputs]
    return [w.view(_scattered_shape(g, group_size)) for w, g in zip(waited, grads, strict=True)]


def _all_reduce_by_cat(grads: list[torch.Tensor], group: object, reduce_op: str) -> list[torch.Tensor]:
    """All-reduce: the flattened gradients end to end (``cat``), reduced, cut back into the gradients' shapes."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduced = compat.ALL_REDUCE(flat, reduce_op, group)
    return _unpack_reduced(reduced, [list(g.shape) for g in grads])


_MERGE_FNS: dict[tuple[CollectiveKind, BucketMode], Callable[..., list[torch.Tensor]]] = {
    ("all_gather", "default"): _gather_by_copy,
    ("all_gather", "coalesced"): _gather_by_copy,
    ("all_gather", "custom_ops"): _gather_by_copy_op,
    ("all_gather", "custom_ops_multidtype"): _gather_by_copy_op,
    ("reduce_scatter", "default"): _scatter_by_cat,
    ("reduce_scatter", "coalesced"): _scatter_coalesced,
    ("reduce_scatter", "custom_ops"): _scatter_by_copy_op,
    ("reduce_scatter", "custom_ops_multidtype"): _scatter_by_copy_op,
}


def merge_fn(kind: CollectiveKind, mode: BucketMode) -> MergeFn:
    """The function a bucket of ``kind`` collectives is merged with in ``mode`` (all-gathers have no coalesced form:
    ``coalesced`` gathers as ``default``, as upstream does; all-reduces have one form)."""
    if kind == "all_reduce":
        return _all_reduce_by_cat
    found = _MERGE_FNS.get((kind, mode))
    if found is None:
        raise AssertionError(f"overlapcfg merge: no merge function for {kind} collectives in bucket mode {mode!r}")
    return found

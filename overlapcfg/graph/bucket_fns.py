"""What one merged bucket computes: copy-in, one collective, its wait and copy-out, for each bucket mode.

These functions are traced (``overlapcfg.graph.stamp``) and the trace is stamped into the graph in place of a
bucket's collectives. They are overlapcfg's own, written after torch 2.13's
``torch/_inductor/fx_passes/bucketing.py`` (``all_gather_merge_fn_to_trace``, ``..._custom_ops``,
``reduce_scatter_merge_fn_to_trace``, ``..._custom_ops``, ``..._coalesced``, ``all_reduce_merge_fn_to_trace``;
BSD-3-Clause, as overlapcfg), op for op: on torch 2.13 a merged bucket is node for node what upstream's
``manual_overlap_bucketing`` emits, and on every release it is made of the ops inductor's own bucketing emits, which
inductor lowers (``bucketing._pre_bucket_*`` copy-ins, ``_c10d_functional`` collectives, views and splits).

Why not call upstream's merge: its helpers are private and change between releases (torch 2.11 has no
``_sort_bucket_region``, copies in with ``_foreach_copy_`` and has no ``coalesced`` mode; 2.13 added a metadata
repair), so a pass built on them works on one release. Owning these few functions and the splice around them
(``stamp``) gives one behaviour on 2.11 to 2.14.

``group_key`` says which collectives of a bucket may share one merged collective (same process group, and reduce
op and dtype where those matter), as upstream's ``bucket_key`` does.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.config.policy import BucketMode

if TYPE_CHECKING:
    from overlapcfg.kinds import CollectiveKind

__all__ = ["MergeFn", "bucket_dtype", "foreach_groups", "group_key", "group_name_of", "merge_fn"]

MergeFn: TypeAlias = Callable[..., list[torch.Tensor]]

_legacy = torch.ops.c10d_functional  # upstream waits through the legacy namespace; it traces to the same op


def group_name_of(arg: object) -> str:
    """A collective's process-group argument as a name: a string, or (compile-on-one-rank graphs) a node whose
    fake value is the process group."""
    if isinstance(arg, str):
        return arg
    if isinstance(arg, fx.Node):
        return str(arg.meta["val"].group_name)
    raise AssertionError(f"overlapcfg merge: a collective's group is {arg!r}, neither a name nor a node")


def group_key(node: fx.Node, kind: CollectiveKind, mode: BucketMode) -> tuple[object, ...]:
    """Collectives of one bucket with equal keys merge into one: all-gathers by group (and dtype, except in
    ``custom_ops_multidtype``), reduce-scatters and all-reduces by group, reduce op and dtype."""
    dtype = node.meta["val"].dtype
    if kind == "all_gather":
        _, _, group = node.args
        return (group_name_of(group),) if "multidtype" in mode else (group_name_of(group), dtype)
    if kind == "reduce_scatter":
        _, reduce_op, _, group = node.args
        return (group_name_of(group), reduce_op, dtype)
    if kind == "all_reduce":
        _, reduce_op, group = node.args
        return (group_name_of(group), reduce_op, dtype)
    raise AssertionError(f"overlapcfg merge: {kind} collectives are not merged ({node.name})")


def bucket_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The flat buffer's dtype: the narrowest of the bucket's (a mixed bucket is sent as bytes of that width)."""
    if not dtypes:
        raise AssertionError("overlapcfg merge: a bucket with no collectives")
    return min(dtypes, key=operator.attrgetter("itemsize"))


def foreach_groups(ins: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype]) -> list[int] | None:
    """Indices of copy-in inputs with equal (source dtype, destination dtype, shape), flat with ``-1`` between
    groups (``[0, 2, -1, 1]`` is ``[[0, 2], [1]]``), or None where there is one group: ``_foreach_copy_`` falls
    back to its slow path on mixed groups."""
    groups: defaultdict[tuple[object, ...], list[int]] = defaultdict(list)
    for i, (t, out_dtype) in enumerate(zip(ins, out_dtypes, strict=True)):
        groups[(t.dtype, out_dtype, tuple(compat.size_hint(s) for s in t.shape))].append(i)
    if len(groups) <= 1:
        return None
    flat: list[int] = []
    for i, indices in enumerate(groups.values()):
        if i:
            flat.append(-1)
        flat.extend(indices)
    return flat


# --- the traced functions (argument lists as upstream's, so the traces are its traces) --------------------------


def _all_gather_default(ag_ins: list[torch.Tensor], group_name: Any, group_size: int, dtype: torch.dtype,
                        out_dtypes: list[torch.dtype], rank: int) -> list[torch.Tensor]:
    ins_sizes = [ag_in.shape for ag_in in ag_ins]
    ins_split_sizes = [ag_in.numel() for ag_in in ag_ins]
    ag_input_numel = sum(ins_split_sizes)
    device = ag_ins[0].device
    new_ag_out = torch.empty(ag_input_numel * group_size, dtype=dtype, device=device)
    new_ag_in = new_ag_out.narrow(0, ag_input_numel * rank, ag_input_numel)
    ag_ins_flattened = [ag_in.reshape(-1) for ag_in in ag_ins]
    # One copy of a cat: inductor fuses it into one kernel (a _foreach_copy_ launches one per input).
    new_ag_in.copy_(torch.cat(ag_ins_flattened))
    wait_tensor = _legacy.wait_tensor(
        compat.ALL_GATHER_INTO_TENSOR_OUT(new_ag_in, group_size, group_name, out=new_ag_out))
    new_ag_out_reshaped = wait_tensor.reshape(group_size, -1)
    outs = torch.split_with_sizes(new_ag_out_reshaped, ins_split_sizes, dim=1)
    return [o.reshape((shape[0] * group_size, *shape[1:])) for o, shape in zip(outs, ins_sizes, strict=True)]


def _all_gather_custom_ops(ag_ins: list[torch.Tensor], group_name: Any, group_size: int, dtype: torch.dtype,
                           out_dtypes: list[torch.dtype], rank: int) -> list[torch.Tensor]:
    # No convert_element_type ops: the copy-in views each destination slice as its output dtype and copies into it.
    ins_sizes = [ag_in.shape for ag_in in ag_ins]
    ins_split_sizes_bytes = [ag_in.numel() * out_dtype.itemsize
                             for ag_in, out_dtype in zip(ag_ins, out_dtypes, strict=False)]
    ins_split_sizes = [nbytes // dtype.itemsize for nbytes in ins_split_sizes_bytes]
    ag_input_numel = sum(ins_split_sizes)
    table = compat.bucket_dtype_table
    out_dtype_ints = [table.index(dt) for dt in out_dtypes]
    new_ag_out = compat.call_pre_bucket_all_gather(
        ag_ins=ag_ins, group_size=group_size, group_name=group_name, dtype=dtype, out_dtype_ints=out_dtype_ints,
        rank=rank, foreach_group_indices=foreach_groups(ag_ins, out_dtypes))
    new_ag_in = new_ag_out.narrow(0, ag_input_numel * rank, ag_input_numel)
    wait_tensor = _legacy.wait_tensor(
        compat.ALL_GATHER_INTO_TENSOR_OUT(new_ag_in, group_size, group_name, out=new_ag_out))
    new_ag_out_reshaped = wait_tensor.reshape(group_size, -1)
    outs_bucket_dtype = torch.split_with_sizes(new_ag_out_reshaped, ins_split_sizes, dim=1)
    return [o.view(out_dtype).reshape((shape[0] * group_size, *shape[1:]))
            for o, shape, out_dtype in zip(outs_bucket_dtype, ins_sizes, out_dtypes, strict=False)]


def _reduce_scatter_default(rs_ins: list[torch.Tensor], group_name: Any, group_size: int, reduce_op: str,
                            reduce_dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    rs_ins_flattened = [x.reshape(group_size, -1) for x in rs_ins]
    new_rs_in = torch.cat(rs_ins_flattened, dim=1).flatten()
    return _scatter_and_split(new_rs_in, rs_ins, group_name, group_size, reduce_op)


def _reduce_scatter_custom_ops(rs_ins: list[torch.Tensor], group_name: Any, group_size: int, reduce_op: str,
                               reduce_dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    new_rs_in = compat.pre_bucket_reduce_scatter(rs_ins, group_size)
    return _scatter_and_split(new_rs_in, rs_ins, group_name, group_size, reduce_op)


def _scatter_and_split(new_rs_in: torch.Tensor, rs_ins: list[torch.Tensor], group_name: Any, group_size: int,
                       reduce_op: str) -> list[torch.Tensor]:
    """One reduce-scatter of the bucket buffer, waited, split back into each input's shard (both copy-in modes end
    so; the sizes are Python ints, so the traced ops are torch 2.13's in its order)."""
    new_out_sizes = [(x.shape[0] // group_size, *x.shape[1:]) for x in rs_ins]
    new_out_numels = [x.numel() // group_size for x in rs_ins]
    new_rs_out = _legacy.wait_tensor(
        compat.REDUCE_SCATTER_TENSOR(new_rs_in, reduce_op, group_size, group_name))
    new_out_flat = new_rs_out.split(new_out_numels, 0)
    return [x.reshape(s) for x, s in zip(new_out_flat, new_out_sizes, strict=False)]


def _reduce_scatter_coalesced(rs_ins: list[torch.Tensor], group_name: Any, group_size: int, reduce_op: str,
                              reduce_dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    # NCCL's coalesced API (one group start/end): no copy into one buffer.
    rs_ins_flat = [x.reshape(-1) for x in rs_ins]
    new_out_sizes = [(x.shape[0] // group_size, *x.shape[1:]) for x in rs_ins]
    rs_outs = compat.REDUCE_SCATTER_TENSOR_COALESCED(rs_ins_flat, reduce_op, group_size, group_name)
    rs_outs = [_legacy.wait_tensor(o) for o in rs_outs]
    return [o.reshape(s) for o, s in zip(rs_outs, new_out_sizes, strict=False)]


def _all_reduce(ar_ins: list[torch.Tensor], group_name: Any, reduce_op: str, reduce_dtype: torch.dtype,
                device: torch.device) -> list[torch.Tensor]:
    ar_ins_flattened = [x.reshape(-1) for x in ar_ins]
    new_ar_in = torch.cat(ar_ins_flattened)
    new_ar_out = _legacy.wait_tensor(compat.ALL_REDUCE(new_ar_in, reduce_op, group_name))
    split_sizes = [x.numel() for x in ar_ins]
    new_outs_flat = new_ar_out.split(split_sizes)
    return [x.reshape(ar_in.shape) for x, ar_in in zip(new_outs_flat, ar_ins, strict=False)]


def merge_fn(kind: CollectiveKind, mode: BucketMode) -> MergeFn:
    """The function a bucket of ``kind`` collectives is merged with in ``mode`` (all-gathers have no coalesced form:
    ``coalesced`` gathers as ``default``, as upstream does; all-reduces have one form)."""
    custom = "custom_ops" in mode
    if kind == "all_gather":
        return _all_gather_custom_ops if custom else _all_gather_default
    if kind == "reduce_scatter":
        if mode == "coalesced":
            return _reduce_scatter_coalesced
        return _reduce_scatter_custom_ops if custom else _reduce_scatter_default
    if kind == "all_reduce":
        return _all_reduce
    raise AssertionError(f"overlapcfg merge: no merge function for {kind} collectives")

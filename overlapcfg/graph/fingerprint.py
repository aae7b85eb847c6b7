"""A graph's schedule fingerprint: the collectives one rank will issue, in graph order, described so that the ranks
of a process group can compare them (``overlapcfg.graph.same_schedule``).

Each collective is described by what must be equal on every rank of its group for it to complete with the right
data (``overlapcfg.graph.record.ScheduledCollective``): its kind and op, its group and the group's size, the dtypes
and shapes it reads and writes, its reduce op, and for a collective the bucketer merged, the bucket it serves and
what each part of its buffer carries, in packing order (two ranks packing the same parameters in another order
would exchange each other's shards under the wrong names: no hang, silently wrong values). Node names are kept for
messages and never compared: two ranks may trace the same collectives under different names.

Only what the graph and the pass say is used, walked in graph order: the same graph gives the same lines on every
rank, whatever ``PYTHONHASHSEED`` (no ids, no iteration over sets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.collectives import Collective
from overlapcfg.graph.meta import merged_mark
from overlapcfg.graph.record import ScheduledCollective, ScheduleFingerprint

__all__ = ["graph_schedule", "tensor_text"]


def tensor_text(value: object) -> str:
    """``float32[64, 128]`` for a tensor, ``[a, b]`` for a list of them, the value itself for a scalar."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(tensor_text(v) for v in value) + "]"
    return repr(value)


def _argument_text(arg: object) -> str:
    if isinstance(arg, fx.Node):
        return tensor_text(arg.meta.get("val"))
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_argument_text(a) for a in arg) + "]"
    return repr(arg)


def _call_text(start: fx.Node) -> tuple[str, str, str | None]:
    """``(op, "inputs -> outputs", reduce op)``: the op the start runs (through a ``control_deps`` wrapper), its
    arguments but the trailing group name and the reduce op (tensors by dtype and shape, other scalars as written),
    its result, and its reduce op (a string argument: ``sum``, ``avg``)."""
    target, args, kwargs = compat.unwrapped_call(start)
    body = list(args[:-1]) if args else []  # the group name is the last positional (``ops.group_name``)
    strings = [a for a in body[1:] if isinstance(a, str)]
    body = [a for a in body if not isinstance(a, str)]
    inputs = ", ".join([*(_argument_text(a) for a in body),
                        *(f"{k}={_argument_text(v)}" for k, v in sorted(kwargs.items()))])
    return compat.op_name(target), f"({inputs}) -> {tensor_text(start.meta.get('val'))}", \
        strings[0] if strings else None


def _part(source: Collective | None, name: str) -> str:
    """One part of a merged buffer: the parameter(s) it carries (else the module owning it, else the source
    collective's node name: whatever the graph says) and its full-size bytes."""
    if source is None:
        return name
    return f"{'+'.join(source.params) or source.module_fqn or name} {source.unsharded_bytes}B"


def graph_schedule(graph: str, collectives: Sequence[Collective], *, buckets: Sequence[str] = (),
                   sources: Mapping[str, Collective] | None = None) -> ScheduleFingerprint:
    """The fingerprint of a graph whose collectives (``find_collectives`` of the final graph, graph order) are
    ``collectives``. ``buckets``: the plan's bucket names, by index (what merged collectives' marks point to);
    ``sources``: the collectives the pass merged away, by their start's name, so each part of a merged buffer is
    named by its parameter."""
    found = sources or {}
    out = []
    for c in collectives:
        op, tensors, reduce_op = _call_text(c.start)
        mark = merged_mark(c.start)
        bucket: str | None = None
        payload: tuple[str, ...] = ()
        if mark is not None:
            bucket = buckets[mark.bucket] if 0 <= mark.bucket < len(buckets) else f"#{mark.bucket}"
            payload = tuple(_part(found.get(name), name) for name in mark.sources)
        elif c.fsdp:
            payload = (_part(c, c.start.name),)
        out.append(ScheduledCollective(kind=c.kind, op=op, group=c.group, group_size=c.group_size, tensors=tensors,
                                       reduce_op=reduce_op, bucket=bucket, payload=payload, node=c.start.name))
    return ScheduleFingerprint(graph=graph, collectives=tuple(out))

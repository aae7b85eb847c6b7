"""Per-node costs: FLOPs and bytes from a node's fake tensors, a roofline for compute, alpha-beta for collectives.

Everything reads ``node.meta["val"]`` (the FakeTensors aot_autograd leaves on every node), so it works on graphs
traced on the meta device. Views, ``getitem`` and waits cost nothing; a collective's cost depends on the world
size it is *predicted* at, not the one it was traced at: the all-gather output / reduce-scatter input is the
unsharded size whatever the trace's world size, and each rank's shard is that over ``world_size``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.cost.calibration import Contention
from overlapcfg.cost.hardware import HardwareProfile
from overlapcfg.graph.ops import collective_kind, is_collective_start, is_compute_node, is_free, started_by

__all__ = ["CollectiveCost", "NodeKind", "collective_bytes", "collective_cost", "compute_seconds", "iter_tensors",
           "node_bytes", "node_flops", "node_kind", "tensor_bytes"]

NodeKind: TypeAlias = Literal["free", "compute", "memory", "collective", "wait", "io"]


def iter_tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_tensors(v)


def _val(arg: object) -> object:
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_val(a) for a in arg)
    return arg


def tensor_bytes(t: torch.Tensor, as_dtype: torch.dtype | None = None) -> int:
    """Bytes of ``t``; floating tensors re-costed as ``as_dtype`` when given (mixed precision from an fp32 trace)."""
    size = as_dtype.itemsize if as_dtype is not None and t.is_floating_point() else t.element_size()
    return int(t.numel()) * size


def node_kind(node: fx.Node) -> NodeKind:
    """How the cost model treats ``node``: ``collective`` starts, ``wait``s, ``compute`` (has a FLOP formula),
    ``memory`` (other kernels: bandwidth-bound), ``free`` (no kernel: ``overlapcfg.graph.ops.is_free``) and ``io``
    (placeholders, output)."""
    if node.op != "call_function":
        return "io"
    if started_by(node) is not None:  # a wait, also one insert_overlap_deps wrapped in control_deps
        return "wait"
    if is_collective_start(node):
        return "collective"
    if is_free(node):
        return "free"
    if is_compute_node(node):
        return "compute"
    return "memory"


def node_flops(node: fx.Node) -> int:
    """FLOPs by torch's ``flop_counter`` formulas on the node's fake tensors; 0 for ops without a formula."""
    formula = compat.flop_formula(node.target)
    if formula is None:
        return 0
    args = tuple(_val(a) for a in node.args)
    kwargs = {k: _val(v) for k, v in node.kwargs.items()}
    try:
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except (TypeError, ValueError, AttributeError, AssertionError, IndexError):
        return 0


def node_bytes(node: fx.Node, as_dtype: torch.dtype | None = None) -> int:
    """Bytes a kernel reads and writes: its tensor inputs plus its outputs (views and getitem move nothing)."""
    read = sum(tensor_bytes(t, as_dtype) for a in (*node.args, *node.kwargs.values()) for t in iter_tensors(_val(a)))
    written = sum(tensor_bytes(t, as_dtype) for t in iter_tensors(node.meta.get("val")))
    return read + written


def dtype_name(node: fx.Node) -> str:
    for t in iter_tensors(_val(node.args)):
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


@dataclass(frozen=True, slots=True)
class ComputeCost:
    flops: int
    bytes: int
    seconds: float
    bound: Literal["compute", "memory", "free"]


def compute_seconds(node: fx.Node, hw: HardwareProfile, *, world_size: int | None = None,
                    traced_world_size: int | None = None, as_dtype: torch.dtype | None = None) -> ComputeCost:
    """Roofline time of one kernel: max(FLOPs / peak(dtype), bytes / memory bandwidth).

    No per-kernel constant: merging buckets must only add bytes (the tuner's quick model sums its units' copies),
    and a calibrated profile's rates already fold the overhead in at the model's sizes; measured node durations
    (``overlapcfg.cost.node_costs``) are the way to price small kernels exactly.

    A bucket's copy-in (``_pre_bucket_all_gather``) reads shards; its bytes are rescaled from the traced world
    size to ``world_size``. Other shard-sized kernels are costed as traced (they are small either way).
    """
    kind = node_kind(node)
    if kind in ("free", "io", "wait", "collective"):
        return ComputeCost(0, 0, 0.0, "free")
    flops = node_flops(node) if kind == "compute" else 0
    nbytes = node_bytes(node, as_dtype)
    if "_pre_bucket_all_gather" in str(node.target) and world_size and traced_world_size:
        nbytes = nbytes * traced_world_size // world_size
    dtype = str(as_dtype).removeprefix("torch.") if as_dtype is not None else dtype_name(node)
    t_flops = flops / hw.flops_for(dtype)
    t_mem = nbytes / (hw.mem_bandwidth * hw.compute_efficiency)
    return ComputeCost(flops, nbytes, max(t_flops, t_mem), "compute" if t_flops >= t_mem else "memory")


def collective_bytes(node: fx.Node, as_dtype: torch.dtype | None = None) -> int:
    """The full-size tensor: an all-gather's output, a reduce-scatter's input, an all-reduce's buffer."""
    kind = collective_kind(node)
    if kind == "reduce_scatter":
        inp = _val(compat.unwrapped_call(node)[1][0])  # a control_deps wrapper's first argument is its deps
        return sum(tensor_bytes(t, as_dtype) for t in iter_tensors(inp))
    return sum(tensor_bytes(t, as_dtype) for t in iter_tensors(node.meta.get("val")))


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """What one collective costs: its time on its own stream, the compute stream's time issuing it, and which
    numbers priced it."""

    seconds: float
    issue_seconds: float
    source: Literal["fitted", "datasheet"]
    slowdown: tuple[float, float] = (0.0, 0.0)
    """``(compute_slowdown, comm_slowdown)`` while it overlaps compute: the profile's measured contention on its
    link (``HardwareProfile.contention``), scaled by the share of its time spent moving bytes; none without."""


def collective_cost(kind: str, nbytes: int, hw: HardwareProfile, world_size: int, *,
                    inter_node: bool | None = None) -> CollectiveCost:
    """A collective of ``kind`` moving the full-size ``nbytes`` over ``world_size`` ranks (the group's), with the
    profile's fit for the kind and link looked up once.

    Ring alpha-beta model. all-gather / reduce-scatter: ``(p-1)/p * bytes / bw + (p-1) * latency``; all-reduce
    (reduce-scatter then all-gather) twice that. ``bw`` is per direction: ``inter_node`` says whether the ring
    crosses nodes (an HSDP replicate group of 8 ranks strided over 8 nodes does; a shard group of the same size
    inside one node does not); None decides by size alone (intra-node while ``p <= gpus_per_node``).
    A calibrated profile's measured fit for the kind and link (``HardwareProfile.collectives``) replaces the
    datasheet latency and bandwidth in the same formula (``source`` "fitted"), and gives the issue time the
    compute stream pays before the collective starts on its own: ``issue_latency + bytes / issue_bandwidth``
    (gloo does part of a reduce-scatter on the caller); without a fit issuing is free. The link's measured
    contention, if any, gives ``slowdown`` (``_slowdown``).
    """
    p = world_size
    crosses = p > hw.gpus_per_node if inter_node is None else inter_node
    fit = hw.collective_fit(kind, crosses)
    source: Literal["fitted", "datasheet"] = "fitted" if fit is not None else "datasheet"
    if p <= 1 or nbytes <= 0:
        return CollectiveCost(0.0, 0.0, source)
    if fit is not None:
        bw, latency = fit.bandwidth, fit.latency
        issue = fit.issue_latency + (nbytes / fit.issue_bandwidth if fit.issue_bandwidth else 0.0)
    else:
        bw = (hw.inter_node_bandwidth if crosses else hw.intra_node_bandwidth) * hw.comm_efficiency
        latency, issue = hw.latency, 0.0
    one = (p - 1) / p * nbytes / bw + (p - 1) * latency
    seconds = 2 * one if kind in ("all_reduce", "other") else one
    return CollectiveCost(seconds, issue, source, _slowdown(hw.contention_for(crosses), seconds,
                                                            _ring_steps(kind, p) * latency))


def _ring_steps(kind: str, p: int) -> int:
    """Latency terms of the ring: ``p - 1`` steps, twice that for an all-reduce."""
    return 2 * (p - 1) if kind in ("all_reduce", "other") else p - 1


def _slowdown(contention: Contention | None, seconds: float, latency: float) -> tuple[float, float]:
    """``(compute_slowdown, comm_slowdown)`` of a collective taking ``seconds``, ``latency`` of them its ring
    steps' latency: the link's measured contention, else none. Both slowdowns are the measured ones times the share
    of the collective's time spent moving bytes: calibration measures them with a collective that is nearly all
    transfer, and what contends is the data moving (gloo copying through sockets, NCCL's copy kernels) against
    compute's cores or SMs, not a ring step's latency, in which the collective mostly waits on its peers."""
    if contention is None:
        return (0.0, 0.0)
    share = max(0.0, seconds - latency) / seconds if seconds > 0 else 0.0
    return (contention.compute_slowdown * share, contention.comm_slowdown * share)

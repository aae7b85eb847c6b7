"""Per-node costs: FLOPs and bytes from a node's fake tensors, a roofline for compute, alpha-beta for collectives.

Everything reads ``node.meta["val"]`` (the FakeTensors aot_autograd leaves on every node), so it works on graphs
traced on the meta device. Views, ``getitem`` and waits cost nothing; a collective's cost depends on the world
size it is *predicted* at, not the one it was traced at: the all-gather output / reduce-scatter input is the
unsharded size whatever the trace's world size, and each rank's shard is that over ``world_size``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.cost.hardware import HardwareProfile
from overlapcfg.cost.measured_fits import Contention
from overlapcfg.graph.ops import collective_kind, is_collective_start, is_compute_node, is_free, started_by

__all__ = ["MATMUL_FACTORS", "REDUCTIONS", "CollectiveCost", "NodeKind", "collective_bytes", "collective_cost",
           "compute_seconds", "is_reduction", "iter_tensors", "matmul_layout", "matmul_rate", "matmul_shape",
           "memory_rate",
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


_KIND_OF_TARGET: dict[int, tuple[object, int, NodeKind]] = {}
"""Op identity -> (op, FLOP-registry size when classified, kind), for the ops whose nodes' kind is the op's alone
(see ``node_kind``). Keyed by ``id`` because an op overload hashes in Python, a cost paid per node otherwise (the
cost model asks about every node of a step many times over); the entry holds the op, so no other object can take
its id while it is cached."""


def node_kind(node: fx.Node) -> NodeKind:
    """How the cost model treats ``node``: ``collective`` starts, ``wait``s, ``compute`` (has a FLOP formula),
    ``memory`` (other kernels: bandwidth-bound), ``free`` (no kernel: ``overlapcfg.graph.ops.is_free``) and ``io``
    (placeholders, output).

    For an op overload other than ``wait_tensor`` the answer depends on the op alone (only a wait, or a
    ``control_deps`` wrapper, which is no op overload, answers by its arguments), so it is looked up once per op.
    A FLOP formula (``is_compute_node``) registered after a lookup is seen: the registry's size is part of the key.
    """
    if node.op != "call_function":
        return "io"
    target = node.target
    size = compat.flop_registry_size()
    known = _KIND_OF_TARGET.get(id(target))
    if known is not None and known[0] is target and known[1] == size:
        return known[2]
    kind = _kind_by_arguments(node)
    if compat.is_op_overload(target) and target is not compat.WAIT_TENSOR:
        _KIND_OF_TARGET[id(target)] = (target, size, kind)
    return kind


def _kind_by_arguments(node: fx.Node) -> NodeKind:
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


MATMUL_FACTORS = {"aten.mm": (0, 1), "aten.addmm": (1, 2), "aten.bmm": (0, 1), "aten.baddbmm": (1, 2)}
"""Matmul ops and the argument positions of their two factors (their shapes give the GEMM's ``m x k x n``)."""


def matmul_shape(node: fx.Node) -> tuple[int, int, int, int] | None:
    """``(batch, m, k, n)`` of a matmul node (``mm``, ``addmm``, ``bmm``, ``baddbmm``), from its factors' fake
    tensors; None for anything else."""
    if node.op != "call_function":
        return None
    positions = MATMUL_FACTORS.get(compat.op_name(node.target))
    if positions is None or len(node.args) <= max(positions):
        return None
    a, b = (_val(node.args[i]) for i in positions)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2 or b.dim() < 2:
        return None
    batch = int(a.shape[0]) if a.dim() == 3 else 1
    return batch, int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])


def matmul_layout(node: fx.Node) -> str:
    """``nn``, ``nt``, ``tn`` or ``tt``: whether each factor of a matmul node is read transposed (its last two
    strides column-major), from the factors' fake tensors; ``nn`` where unknown."""
    positions = MATMUL_FACTORS.get(compat.op_name(node.target)) if node.op == "call_function" else None
    if positions is None or len(node.args) <= max(positions):
        return "nn"
    out = ""
    for i in positions:
        val = _val(node.args[i])
        transposed = isinstance(val, torch.Tensor) and val.dim() >= 2 and val.stride(-2) == 1 and \
            val.stride(-1) != 1 and val.shape[-2] > 1
        out += "t" if transposed else "n"
    return out


def matmul_rate(hw: HardwareProfile, dtype: str, shape: tuple[int, int, int, int] | None) -> float:
    """FLOP/s a matmul of ``shape`` (``(batch, m, k, n)``; None: any other FLOP-counted kernel, at the best-shape
    rate) reaches in ``dtype`` on ``hw``: the peak times its achievable share (``overlapcfg.cost.achievable``), the
    bare peak on a profile without achievable rates."""
    peak = hw.flops_for(dtype)
    if hw.achievable is None:
        return peak
    rate = hw.achievable.matmul.for_dtype(dtype)
    share = rate.share(*shape) if shape is not None else rate.efficiency * rate.sustained
    return peak * share


REDUCTIONS = frozenset({
    "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.var", "aten.var_mean",
    "aten.std", "aten.norm", "aten.linalg_vector_norm", "aten.logsumexp", "aten.prod", "aten.cumsum",
    "aten._softmax", "aten._log_softmax", "aten._safe_softmax", "aten._softmax_backward_data",
    "aten._log_softmax_backward_data", "aten.native_layer_norm", "aten.native_layer_norm_backward",
    "aten._fused_rms_norm", "aten._fused_rms_norm_backward", "aten.native_batch_norm",
    "aten.native_batch_norm_backward", "aten.nll_loss_forward", "aten.nll_loss_backward",
    "aten.embedding_dense_backward"})
"""Ops that reduce over a dimension (``MemoryRate.reduction_efficiency`` prices their kernels)."""


def is_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and compat.op_name(node.target) in REDUCTIONS


def memory_rate(hw: HardwareProfile, reduction: bool = False) -> float:
    """Bytes/s a bandwidth-bound kernel moves on ``hw``: the achievable share of the memory bandwidth (a reducing
    kernel's where the profile has one)."""
    rates = hw.achievable.memory if hw.achievable is not None else None
    share = 1.0 if rates is None else \
        (rates.reduction_efficiency or rates.efficiency) if reduction else rates.efficiency
    return hw.mem_bandwidth * hw.compute_efficiency * share


def compute_seconds(node: fx.Node, hw: HardwareProfile, *, world_size: int | None = None,
                    traced_world_size: int | None = None, as_dtype: torch.dtype | None = None,
                    fused: tuple[int, int, bool] | None = None, eager: bool = False,
                    fixed: bool = True) -> ComputeCost:
    """One kernel's time: ``launch + max(FLOPs / achievable rate, bytes / achievable bandwidth)``.

    The rates are the profile's achievable ones (``overlapcfg.cost.achievable``: a matmul's by its shape and
    dtype; a memory-bound kernel's share of the bandwidth), the bare peaks without them (the pure roofline).
    ``fused``: ``(bytes, kernels, reduces)`` a fusion plan gives this memory-bound node (``overlapcfg.cost.fusion``:
    what it reads from outside its fused group and writes out of it, whether it ends a kernel, whether the group
    reduces), instead of its own inputs and outputs as one kernel. ``eager``: views are dispatched one by one on the
    host (``MemoryRate.view_seconds`` each), as an eager graph module runs them.

    ``fixed``: charge the per-kernel and per-view costs. Nodes of a collective's chain (the copies into and out of a
    bucket buffer and their views, ``overlapcfg.cost.fusion.chain_nodes``) are priced by their bytes alone: merging
    buckets must only add bytes, the rule the tuner's quick model sums its units' chains by, and a bucketing changes
    how many such nodes there are.

    A bucket's copy-in (``_pre_bucket_all_gather``) reads shards; its bytes are rescaled from the traced world
    size to ``world_size``. Other shard-sized kernels are costed as traced (they are small either way).
    """
    kind = node_kind(node)
    rates = hw.achievable
    if kind == "free":
        if fixed and eager and rates is not None and rates.memory.view_seconds and node.target is not operator.getitem:
            return ComputeCost(0, 0, rates.memory.view_seconds, "memory")
        return ComputeCost(0, 0, 0.0, "free")
    if kind in ("io", "wait", "collective"):
        return ComputeCost(0, 0, 0.0, "free")
    flops = node_flops(node) if kind == "compute" else 0
    kernels = 1
    if fused is not None and kind == "memory":
        nbytes, kernels, reduces = fused
    else:
        nbytes, reduces = node_bytes(node, as_dtype), is_reduction(node)
    if "_pre_bucket_all_gather" in str(node.target) and world_size and traced_world_size:
        nbytes = nbytes * traced_world_size // world_size
    dtype = str(as_dtype).removeprefix("torch.") if as_dtype is not None else dtype_name(node)
    shape = matmul_shape(node) if kind == "compute" else None
    if shape is not None and rates is not None:
        timed = rates.matmul.for_dtype(dtype).timed_seconds(shape, matmul_layout(node))
        if timed is not None:  # calibration timed this very kernel
            return ComputeCost(flops, nbytes, timed, "compute")
    t_flops = flops / matmul_rate(hw, dtype, shape) if flops else 0.0
    t_mem = nbytes / memory_rate(hw, reduces)
    launch = 0.0
    if rates is not None and kernels and fixed:
        launch = kernels * (rates.matmul.for_dtype(dtype).launch_seconds if kind == "compute"
                            else rates.memory.launch_seconds)
    return ComputeCost(flops, nbytes, launch + max(t_flops, t_mem), "compute" if t_flops >= t_mem else "memory")


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
    slowdown: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """``(compute_slowdown, comm_slowdown, start_delay)`` while it overlaps compute: the profile's measured
    contention on its link (``HardwareProfile.contention``), the two slowdowns scaled by the share of its time spent
    moving bytes; none without."""


def collective_cost(kind: str, nbytes: int, hw: HardwareProfile, world_size: int, *,
                    inter_node: bool | None = None, ranks_per_node: int | None = None) -> CollectiveCost:
    """A collective of ``kind`` moving the full-size ``nbytes`` over ``world_size`` ranks (the group's), with the
    profile's rates for the kind and link looked up once.

    Ring alpha-beta model, in nccl-tests' bus-bandwidth terms. all-gather / reduce-scatter:
    ``(p-1) * latency + (p-1)/p * bytes / bus_bandwidth``; all-reduce (reduce-scatter then all-gather) twice that,
    or, where the profile's all-reduce rate says NCCL has them, a tree (``2 ceil(log2 p)`` latencies for the same
    bytes) or NVLink SHARP inside a node (``latency + bytes / nvls_bandwidth``), whichever is fastest.
    ``inter_node`` says whether the ring crosses nodes (an HSDP replicate group of 8 ranks strided over 8 nodes does;
    a shard group of the same size inside one node does not); None decides by size alone (intra-node while
    ``p <= gpus_per_node``). A ring across nodes runs one channel per NIC in parallel: its bus bandwidth is the
    inter-node rate (per NIC) times the NICs its node's ranks drive (``ranks_per_node``, at most
    ``nics_per_node``; default: whole nodes for a group larger than a node, one rank per node for a smaller one
    placed across nodes), and never more than the intra-node rate its data also crosses.

    The rates: the profile's ``collectives`` for the kind and link (calibrated, or published achievable ones:
    ``source`` "fitted"), else its datasheet links times ``comm_efficiency`` and ``latency`` (``source``
    "datasheet"). A fit gives the issue time the compute stream pays before the collective starts on its own:
    ``issue_latency + bytes / issue_bandwidth`` (gloo does part of a reduce-scatter on the caller); without a fit
    issuing is free. The link's measured contention, if any, gives ``slowdown`` (``_slowdown``).
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
    if crosses:
        per_node = ranks_per_node if ranks_per_node is not None else \
            (hw.gpus_per_node if p > hw.gpus_per_node else 1)
        inside = hw.collective_fit(kind, False)
        ceiling = inside.bandwidth if inside is not None else hw.intra_node_bandwidth * hw.comm_efficiency
        bw = min(bw * max(1, min(per_node, hw.nics_per_node)), max(ceiling, bw))
    steps, volume = _ring_steps(kind, p), (p - 1) / p * nbytes * (2 if kind in ("all_reduce", "other") else 1)
    seconds = steps * latency + volume / bw
    moving = volume / bw
    if kind == "all_reduce" and fit is not None:
        if fit.tree:
            tree = 2 * math.ceil(math.log2(p)) * latency + volume / bw
            if tree < seconds:
                seconds, steps = tree, 2 * math.ceil(math.log2(p))
        if fit.nvls_bandwidth is not None and not crosses and latency + nbytes / fit.nvls_bandwidth < seconds:
            seconds, steps, moving = latency + nbytes / fit.nvls_bandwidth, 1, nbytes / fit.nvls_bandwidth
    return CollectiveCost(seconds, issue, source, _slowdown(hw.contention_for(crosses), seconds, seconds - moving))


def _ring_steps(kind: str, p: int) -> int:
    """Latency terms of the ring: ``p - 1`` steps, twice that for an all-reduce."""
    return 2 * (p - 1) if kind in ("all_reduce", "other") else p - 1


def _slowdown(contention: Contention | None, seconds: float, latency: float) -> tuple[float, float, float]:
    """``(compute_slowdown, comm_slowdown, start_delay)`` of a collective taking ``seconds``, ``latency`` of them
    its ring steps' latency: the link's measured contention, else none. Both slowdowns are the measured ones times
    the share of the collective's time spent moving bytes: calibration measures them with a collective that is
    nearly all transfer, and what contends is the data moving (gloo copying through sockets, NCCL's copy kernels)
    against compute's cores or SMs, not a ring step's latency, in which the collective mostly waits on its peers.
    The start delay is the link's whole: it was measured on a small collective, and it is the wait for a core, not
    a rate, so it does not grow or shrink with the bytes."""
    if contention is None:
        return (0.0, 0.0, 0.0)
    share = max(0.0, seconds - latency) / seconds if seconds > 0 else 0.0
    return (contention.compute_slowdown * share, contention.comm_slowdown * share, contention.start_delay)

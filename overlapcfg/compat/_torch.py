"""The one place that imports private torch pieces (``torch._dynamo``, ``torch._functorch``, ``torch._inductor``,
``torch.testing._internal``).

Everything else in overlapcfg imports them from here, so a torch upgrade that moves one of them breaks exactly one
module, and each probe for a changed API runs once at import instead of ``hasattr`` checks at call sites.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator

import torch.distributed as dist

# --- dynamo ------------------------------------------------------------------------------------------------------
from torch._dynamo import reset as dynamo_reset

# --- aot_autograd and the partitioner ------------------------------------------------------------------------
# The min-cut partitioner is required: the default partitioner saves the all-gathered (full) weights for backward,
# so a reshard-after-forward backward would lose its all-gathers.
from torch._dynamo.backends.common import aot_autograd

# Descriptors on aot graph placeholders / outputs (``node.meta["desc"]``): which flat input a primal is, and which
# input a backward output is the gradient of. They make attribution independent of node names.
from torch._functorch._aot_autograd.descriptors import GradAOTOutput, PlainAOTInput
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import Source

# --- fake process group (testing._internal) -------------------------------------------------------------------
# Importing fake_pg registers the "fake" backend with torch.distributed as a side effect.
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "FakeStore",
    "GradAOTOutput",
    "PlainAOTInput",
    "aot_autograd",
    "dynamo_input_source",
    "dynamo_reset",
    "fake_process_group",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
]

# ``Source.name`` became a cached property in torch 2.13 (a method before): probe once here.
_SOURCE_NAME_IS_PROPERTY = isinstance(
    inspect.getattr_static(Source, "name"), (property, functools.cached_property)
)


def dynamo_input_source(placeholder: object) -> str | None:
    """The dynamo source of a dynamo-graph placeholder, e.g. ``L['self']._modules['norm']._parameters['weight']``.

    ``None`` when dynamo recorded no source (a symbolic size, say).
    """
    grapharg = getattr(placeholder, "meta", {}).get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    return source.name if _SOURCE_NAME_IS_PROPERTY else source.name()


@contextlib.contextmanager
def fake_process_group(world_size: int = 2, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Init the default process group with the communication-free "fake" backend; destroy it on exit.

    One CPU process can then trace (and even run) graphs with real ``_c10d_functional`` collectives as rank
    ``rank`` of ``world_size``: the fake backend returns without communicating, so values are garbage but shapes,
    dtypes and group names are those of a real run. Safe to enter repeatedly in one process (the group name stays
    "0"). Refuses to replace a default group someone else initialized.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a default process group is already initialized; destroy it first")
    # init_process_group installs a ``[rankN]:``-prefixing sys.excepthook that destroy_process_group keeps:
    # every later uncaught exception in the caller's process would carry it. Restore what was there.
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        if group is None:
            raise AssertionError("fake_process_group: init_process_group left no default group")
        yield group
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


# --- inductor: collective recognition, bucketing and the upstream schedulers ------------------------------------
# Everything the graph pass borrows from ``torch/_inductor/fx_passes``. The merge helpers are used as they are
# (so merged collectives are exactly upstream's ops for a bucket mode); ``cached_merge_traces`` only memoizes the
# ``make_fx`` trace of the merge function, which dominates their cost and is identical for identical signatures.
import torch as _torch  # noqa: E402
from torch._guards import detect_fake_mode  # noqa: E402
from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402
from torch._inductor.fx_passes import bucketing as _bucketing  # noqa: E402
from torch._inductor.fx_passes.bucketing import (  # noqa: E402
    _get_collective_node_from_wait as collective_of_wait,
)
from torch._inductor.fx_passes.bucketing import (  # noqa: E402
    bucket_key,
    is_all_gather_into_tensor,
    is_all_reduce_tensor,
    is_fsdp_reduce_scatter,
    is_reduce_scatter_tensor,
    is_wait_tensor,
    merge_all_gather_bucket,
    merge_reduce_scatter_bucket,
)
from torch._inductor.fx_passes.control_dependencies import control_deps as _control_deps  # noqa: E402
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering  # noqa: E402
from torch._inductor.fx_passes.fsdp import is_fsdp_all_gather  # noqa: E402
from torch.fx.passes.fake_tensor_prop import FakeTensorProp  # noqa: E402
from torch.fx.traceback import NodeSource, NodeSourceAction  # noqa: E402
from torch.utils._ordered_set import OrderedSet  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

__all__ += [
    "CustomGraphPass",
    "bucket_key",
    "cached_merge_traces",
    "collective_of_wait",
    "is_all_gather_into_tensor",
    "is_all_reduce_tensor",
    "is_fsdp_all_gather",
    "is_fsdp_reduce_scatter",
    "is_reduce_scatter_tensor",
    "is_wait_tensor",
    "manual_overlap_bucketing",
    "unwrap_control_deps",
    "merge_all_gather_bucket",
    "merge_reduce_scatter_bucket",
    "no_triton_runtime_estimates",
    "preserve_node_ordering",
    "schedule_overlap_bucketing",
]


def unwrap_control_deps(node: object) -> tuple[object, tuple[object, ...], tuple[object, ...]]:
    """``(target, data inputs, ordering-only inputs)`` of a node, seeing through a ``control_deps`` wrapper.

    ``insert_overlap_deps`` (``preserve_node_ordering``) replaces a node by ``control_deps(deps, subgraph,
    *inputs)`` whose subgraph runs the original op: for verification and counting it is still that op, and
    ``deps`` are ordering edges, not reads.
    """
    target = getattr(node, "target", None)
    if target is not _control_deps:
        return target, tuple(getattr(node, "all_input_nodes", ())), ()
    deps, subgraph_attr, *inputs = node.args  # type: ignore[attr-defined]
    module = node.graph.owning_module  # type: ignore[attr-defined]
    subgraph = getattr(module, subgraph_attr.target) if module is not None else None
    inner = [n for n in subgraph.graph.nodes if n.op == "call_function"] if subgraph is not None else []
    inner_target = inner[0].target if len(inner) == 1 else target
    return inner_target, tuple(inputs), tuple(deps)


def manual_overlap_bucketing(*args: object, **kwargs: object) -> object:
    """Upstream ``manual_overlap_bucketing`` (imported on first use: its module pulls in the whole scheduler)."""
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing as upstream

    return upstream(*args, **kwargs)


def schedule_overlap_bucketing(*args: object, **kwargs: object) -> object:
    """Upstream automatic ``schedule_overlap_bucketing`` (imported on first use)."""
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing as upstream

    return upstream(*args, **kwargs)


def _trace_key(fn: object, inps: tuple[object, ...]) -> tuple[object, ...]:
    def key(x: object) -> object:
        if isinstance(x, _torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device), x.storage_offset())
        if isinstance(x, (list, tuple)):
            return tuple(key(y) for y in x)
        return x

    return (fn, key(inps))


@contextlib.contextmanager
def cached_merge_traces(*, fresh_fake_values: bool = False) -> Iterator[dict[tuple[object, ...], object]]:
    """Within the block, upstream's merge helpers do the same work faster (same ops, same order, same metadata).

    ``bucketing._trace(fn, inps)`` runs ``make_fx`` on the merge function for every bucket; buckets of identical
    layers have identical signatures (shapes, strides, dtypes, group, rank), so the traced ``GraphModule`` is the
    same and is stamped into the graph by ``node_copy`` as before. Stamped nodes of identical buckets then share
    their ``meta["val"]`` fake tensors (same shapes, strides and dtypes, one storage): harmless when the graph runs
    as it is, but inductor tells buffers apart by storage, so ``fresh_fake_values=True`` (what the inductor routes
    use) re-runs the traced ops on each bucket's own inputs, at about 10 ms per bucket. Two more helpers are
    swapped for equivalent linear-time versions (``_populate_node_meta_once``, ``sort_region``). Restored on exit,
    even on error.
    """
    original_trace, original_meta = _bucketing._trace, _bucketing._populate_node_meta
    original_sort = _bucketing._sort_bucket_region
    cache: dict[tuple[object, ...], object] = {}

    def traced(fn: object, inps: tuple[object, ...]) -> object:
        k = _trace_key(fn, inps)
        if k not in cache:
            cache[k] = original_trace(fn, inps)
            return cache[k]
        gm = cache[k]
        if fresh_fake_values:
            # Re-run the traced ops on this bucket's own fake inputs, so its nodes get their own fake values
            # (storages) as a fresh trace would give them: inductor tells buffers apart by them.
            FakeTensorProp(gm, mode=detect_fake_mode(inps)).propagate_dont_convert_inputs(*tree_leaves(inps))
        return gm

    def sort_region(g: object, new_nodes: list[object], inputs: list[object]) -> None:
        # Placeholders head the graph, so they never need moving; but upstream's region walk searches for them
        # too, back to the top of the graph, for every bucket of parameters: quadratic in graph size. Leaving
        # them out of the search gives the same order in linear time.
        original_sort(g, new_nodes, [n for n in inputs if getattr(n, "op", None) != "placeholder"])

    _bucketing._trace = traced
    _bucketing._populate_node_meta = _populate_node_meta_once
    _bucketing._sort_bucket_region = sort_region
    try:
        yield cache
    finally:
        _bucketing._trace = original_trace
        _bucketing._populate_node_meta = original_meta
        _bucketing._sort_bucket_region = original_sort


def _populate_node_meta_once(bucket_nodes: list[object], new_nodes: list[object]) -> None:
    """Upstream's ``_populate_node_meta`` with the same result, built once per bucket instead of once per node.

    Upstream makes a ``NodeSource`` (which deep-copies the source's whole ``from_node`` history) for every
    (new node, source node) pair: about 40k deep copies on a 64-layer backward graph, most of the merge's time.
    Here each source's ``NodeSource`` is made once and the per-key source lists once; every new node gets its own
    list objects holding those shared, never-mutated records.
    """
    if not bucket_nodes:
        return
    first = bucket_nodes[0].meta
    keys = (("nn_module_stack", ""), ("fwd_nn_module_stack", ""), ("stack_trace", ""), ("custom", {}))
    sources: dict[str, object] = {}
    for key, default in keys:
        values = [n.meta.get(key, default) for n in bucket_nodes if n.meta.get(key, default)]
        sources[key] = OrderedSet(values) if key == "stack_trace" else values
    actions = [NodeSourceAction.CREATE, NodeSourceAction.REPLACE]
    from_node = [NodeSource(n, "bucketing_pass", actions) for n in bucket_nodes]
    for n in new_nodes:
        for key, default in keys:
            n.meta[key] = first.get(key, default)
            src = sources[key]
            n.meta[f"bucketing_{key}_sources"] = OrderedSet(src) if key == "stack_trace" else list(src)
        n.meta["from_node"] = list(from_node)


@contextlib.contextmanager
def no_triton_runtime_estimates() -> Iterator[None]:
    """Let upstream schedulers run on a CPU-only torch, for the duration of the block.

    ``OverlapScheduler.__init__`` asks ``torch._inductor.utils.get_gpu_dram_gbps`` (triton) for roofline
    estimates even when every estimate is overridden; without triton that raises ``ModuleNotFoundError``. Where
    triton is importable nothing is changed.
    """
    try:
        import triton  # noqa: F401

        yield
        return
    except ImportError:
        pass
    import torch._inductor.utils as inductor_utils
    import torch.utils._runtime_estimation as runtime_estimation

    # Nominal figures (an H100's order of magnitude) only feed upstream's estimates; the manual scheduler
    # overrides every estimate with 0, and ``auto`` on a CPU is a planning aid, not a measurement.
    fakes = {"get_gpu_dram_gbps": lambda *a, **k: 3000, "get_device_tflops": lambda *a, **k: 500.0}
    saved = [(mod, name, getattr(mod, name)) for mod in (inductor_utils, runtime_estimation) for name in fakes
             if hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, fakes[name])
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)

__all__ += ["OrderedSet"]

# --- inductor: compiling aot graphs (overlapcfg.passes.compile) -----------------------------------------------
# ``compile_fx_inner`` is what inductor's own aot_autograd fw/bw compilers call: it runs the post-grad passes and
# lowers one graph (boxed calling convention, as aot_autograd expects). ``inductor_config_patch`` scopes the
# settings a manual schedule needs to one compile. compile_fx and the decompositions are imported on first use
# (they pull in all of inductor's lowering).
from torch._inductor import config as _inductor_config  # noqa: E402

inductor_config_patch = _inductor_config.patch


def compile_fx_inner(*args: object, **kwargs: object) -> object:
    """Upstream ``torch._inductor.compile_fx.compile_fx_inner`` (imported on first use)."""
    from torch._inductor.compile_fx import compile_fx_inner as upstream

    return upstream(*args, **kwargs)


def inductor_decompositions() -> dict[object, object]:
    """The decomposition table inductor's own ``compile_fx`` hands to aot_autograd (depends on inductor config)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


__all__ += ["compile_fx_inner", "inductor_config_patch", "inductor_decompositions"]

# --- op identity and FLOP formulas (graph classification, cost model) ----------------------------------------
# ``torch._ops.OpOverload`` is private; the graph layer asks these questions instead of isinstance checks.
from torch._functorch._aot_autograd.descriptors import AOTInput as _AOTInput  # noqa: E402
from torch._ops import OpOverload as _OpOverload  # noqa: E402
from torch._ops import OpOverloadPacket as _OpOverloadPacket  # noqa: E402
from torch.utils import flop_counter as _flop_counter  # noqa: E402

_aten = _torch.ops.aten
# CPU SDPA kernels (what a CPU trace records) have no formula in torch's registry; they do the work of flash
# attention and take the same arguments first, so they borrow its formula.
_EXTRA_FLOPS: dict[object, object] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _flop_counter.flop_registry[
        _aten._scaled_dot_product_flash_attention],
}


def _sdpa_cpu_backward_flops(grad_out: object, query: object, key: object, value: object, *args: object,
                             **kwargs: object) -> int:
    return _flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)  # type: ignore[attr-defined]


_EXTRA_FLOPS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flops


def op_name(target: object) -> str:
    """``namespace.name`` of an op overload (``aten.mm``, ``_c10d_functional.all_gather_into_tensor``); the
    target's string form for anything else."""
    if isinstance(target, _OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, _OpOverloadPacket):
        return str(target)
    return getattr(target, "__name__", str(target))


def is_functional_collective(target: object) -> bool:
    """An op of the ``_c10d_functional`` namespace (collectives and ``wait_tensor``)."""
    return isinstance(target, _OpOverload) and target.namespace == "_c10d_functional"


def is_op_overload(target: object) -> bool:
    return isinstance(target, _OpOverload)


def flop_formula(target: object) -> object | None:
    """torch's FLOP formula for an op (``torch.utils.flop_counter``), CPU attention kernels included; else None."""
    packet = getattr(target, "overloadpacket", None)
    if packet in _EXTRA_FLOPS:
        return _EXTRA_FLOPS[packet]
    return _flop_counter.flop_registry.get(packet) or _flop_counter.flop_registry.get(target)


def is_plain_input_descriptor(desc: object) -> bool:
    """An aot input descriptor rooted in a ``PlainAOTInput`` (one of the traced function's own inputs, possibly a
    tensor-subclass attribute of one), as opposed to a tangent or a saved activation."""
    for _ in range(8):
        if isinstance(desc, PlainAOTInput):
            return True
        if not isinstance(desc, _AOTInput):
            return False
        desc = getattr(desc, "base", None)
    return False


__all__ += ["flop_formula", "is_functional_collective", "is_op_overload", "is_plain_input_descriptor", "op_name"]

# torch's own file hash for ``CustomGraphPass.uuid()`` (``overlapcfg.passes.compile.source_hash``).
from torch._inductor.custom_graph_pass import get_hash_for_files as hash_files  # noqa: E402

__all__ += ["hash_files"]


def process_group_initialized() -> bool:
    """Whether a default process group exists (``apply`` needs one to merge: the rank is written into graphs)."""
    return dist.is_initialized()


__all__ += ["process_group_initialized"]

# --- verify: element provenance (overlapcfg.graph.provenance) ------------------------------------------------------
# The copy-in ops that torch's bucket modes emit, which the verifier interprets, and the dtype table that
# ``_pre_bucket_all_gather`` encodes each input's dtype with (``out_dtype_ints`` are indices into it).
pre_bucket_all_gather = _torch.ops.bucketing._pre_bucket_all_gather.default
pre_bucket_reduce_scatter = _torch.ops.bucketing._pre_bucket_reduce_scatter.default
bucket_dtype_table: tuple[_torch.dtype, ...] = tuple(_bucketing._ALL_DTYPES)

__all__ += ["bucket_dtype_table", "pre_bucket_all_gather", "pre_bucket_reduce_scatter"]

# --- functional collectives (the ops our graphs hold, and the demo's SimpleFSDP sharding) ------------------------
import torch.distributed._functional_collectives as functional_collectives  # noqa: E402

_c10d_functional = _torch.ops._c10d_functional
WAIT_TENSOR = _c10d_functional.wait_tensor.default
ALL_GATHER_INTO_TENSOR = _c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER_TENSOR = _c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = _c10d_functional.all_reduce.default

__all__ += ["ALL_GATHER_INTO_TENSOR", "ALL_REDUCE", "REDUCE_SCATTER_TENSOR", "WAIT_TENSOR", "functional_collectives"]

# --- verify: the other collective overloads the verifier interprets (overlapcfg.graph.provenance) ---------------
# ``_c10d_functional`` ops that merged buckets use besides the plain ones above: the ``out=`` all-gather of torch's
# bucket modes and the coalesced forms of ``bucket_mode="coalesced"``.
ALL_GATHER_INTO_TENSOR_OUT = _torch.ops._c10d_functional.all_gather_into_tensor_out.default
ALL_GATHER_INTO_TENSOR_COALESCED = _torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default
REDUCE_SCATTER_TENSOR_COALESCED = _torch.ops._c10d_functional.reduce_scatter_tensor_coalesced.default

__all__ += ["ALL_GATHER_INTO_TENSOR_COALESCED", "ALL_GATHER_INTO_TENSOR_OUT", "REDUCE_SCATTER_TENSOR_COALESCED"]

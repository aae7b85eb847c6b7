"""Private inductor pieces: collective recognition and bucketing helpers, the upstream schedulers (with their
CPU-only workaround), compiling aot graphs, the custom-pass hash, and the bucket copy-in ops the verifier reads.

Like ``overlapcfg.compat._torch``, reached as ``overlapcfg.compat.<name>``; nothing else imports them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch as _torch
from torch import fx as _fx

__all__: list[str] = []

# --- inductor: the bucket copy-in ops, ordering wrappers and the upstream schedulers -----------------------------
# What the graph pass borrows from ``torch/_inductor/fx_passes``: the ops a merged bucket is made of (importing
# ``bucketing`` registers the ``bucketing::_pre_bucket_*`` copy-ins, which inductor lowers), ``control_deps``, and
# upstream's two passes for the ``torch_manual`` and ``auto`` strategies. The merge itself is overlapcfg's
# (``overlapcfg.graph.bucket_fns`` and ``stamp``): upstream's merge helpers differ between releases.
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes import bucketing as _bucketing
from torch._inductor.fx_passes import fsdp as _fsdp
from torch._inductor.fx_passes.control_dependencies import control_deps as _control_deps
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch._ops import OpOverload as _OpOverload
from torch.utils._ordered_set import OrderedSet
from torch.utils._pytree import tree_leaves

# ``torch/_inductor/fx_passes/fsdp.py`` sets its own logger to INFO at import (``logger.setLevel(logging.INFO)``),
# so the automatic scheduler's one-line summary per graph ("pre_bucket_fsdp_collectives: ...") reaches torch's
# console handler whatever the user configured; the overlapcfg command printed two of them in the middle of its
# report. Put that logger back under the hierarchy (the ``torch`` logger's level, ``TORCH_LOGS``), unless someone
# chose another level for it since.
if logging.getLogger(_fsdp.__name__).level == logging.INFO:
    logging.getLogger(_fsdp.__name__).setLevel(logging.NOTSET)

__all__ += [
    "CustomGraphPass",
    "control_deps",
    "is_fsdp_reduce_scatter",
    "manual_overlap_bucketing",
    "unwrap_control_deps",
    "unwrapped_call",
    "no_triton_runtime_estimates",
    "preserve_node_ordering",
    "roofline_estimates_work",
    "schedule_overlap_bucketing",
    "UnsupportedByThisTorch",
    "auto_scheduler_parameters",
]


control_deps = _control_deps
"""The wrapper ``insert_overlap_deps`` puts around an op to order it (what ``unwrap_control_deps`` sees through)."""


def _run_subgraph(additional_deps: object, subgraph: Callable[..., object], *args: object, **kwargs: object) -> object:
    return subgraph(*args, **kwargs)


def _backport_control_deps_kernels() -> None:
    """Give torch 2.11's ``control_deps`` the eager and autograd kernels torch 2.13 registers for it (both run the
    wrapped op): 2.11 has only a fake one, so a graph holding it cannot run eagerly (the backend's eager compiler)
    and inductor's ``compile_fx_inner``, which runs the graph under fake tensors with autograd's dispatch key still
    active, fails with "could not find kernel for HigherOrderOperator control_deps at DispatchKey.AutogradCPU".
    Where the release has them, nothing is registered. Also marked side-effecting, as 2.13 does (dead-code
    elimination must keep an ordering wrapper whose result nobody reads)."""
    from torch._C import DispatchKey
    from torch.fx.node import _side_effectful_functions, has_side_effect

    for key in (DispatchKey.CompositeExplicitAutograd, DispatchKey.Autograd):
        if key not in _control_deps.py_kernels:
            _control_deps.py_impl(key)(_run_subgraph)
    if _control_deps not in _side_effectful_functions:
        has_side_effect(_control_deps)


_backport_control_deps_kernels()


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

def unwrapped_call(node: object) -> tuple[object, tuple[object, ...], dict[str, object]]:
    """``(target, args, kwargs)`` of a call as the op it runs, seeing through a ``control_deps`` wrapper.

    The wrapper passes only the op's node inputs (``control_deps(deps, subgraph, *inputs)``); its constants (a
    collective's group name and size) live in the subgraph's one call, whose placeholders stand for ``inputs``.
    Everything that reads an op's arguments by position reads them here, so a wrapped op is still that op.
    """
    target = getattr(node, "target", None)
    if target is not _control_deps:
        return target, node.args, node.kwargs  # type: ignore[attr-defined]
    _, subgraph_attr, *inputs = node.args  # type: ignore[attr-defined]
    subgraph = getattr(node.graph.owning_module, subgraph_attr.target)  # type: ignore[attr-defined]
    calls = [n for n in subgraph.graph.nodes if n.op == "call_function"]
    if len(calls) != 1:
        return target, node.args, node.kwargs  # type: ignore[attr-defined]
    placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
    outer = dict(zip(placeholders, inputs, strict=True))
    args = _fx.map_arg(calls[0].args, lambda n: outer.get(n, n))
    kwargs = _fx.map_arg(calls[0].kwargs, lambda n: outer.get(n, n))
    return calls[0].target, tuple(args), dict(kwargs)


def is_fsdp_reduce_scatter(node: object) -> bool:
    """Upstream's own test for an FSDP reduce-scatter (an independent oracle for the test suite; overlapcfg's
    classification is ``overlapcfg.graph.gradients``')."""
    return bool(_bucketing.is_fsdp_reduce_scatter(node))  # type: ignore[arg-type]


# What the upstream schedulers accept differs by release; probed once, from their signatures (importing their
# modules pulls in the whole scheduler, so it happens on first use, once).
@functools.cache
def _manual_overlap_bucketing() -> tuple[Callable[..., object], frozenset[str]]:
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing as upstream

    return upstream, frozenset(inspect.signature(upstream).parameters)


@functools.cache
def _schedule_overlap_bucketing() -> tuple[Callable[..., object], frozenset[str]]:
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing as upstream

    return upstream, frozenset(inspect.signature(upstream).parameters)


class UnsupportedByThisTorch(ValueError):
    """A setting the installed torch's upstream pass has no way to honour (``setting``: the policy field; the
    message says what this torch does instead). Strategies turn it into a config error at the setting's path."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


_MANUAL_FIXED_BUCKET_MODE = "custom_ops"
"""torch 2.11's ``manual_overlap_bucketing`` has no ``bucket_mode`` and always buckets as ``custom_ops``."""


def manual_overlap_bucketing(gm: _fx.GraphModule, module_bucket_plans: list[list[str]], *,
                             insert_overlap_deps: bool = False, module_stack_fn: Callable[..., object] | None = None,
                             bucket_mode: str | None = None) -> object:
    """Upstream ``manual_overlap_bucketing`` (imported on first use: its module pulls in the whole scheduler).

    ``bucket_mode`` is passed where upstream takes it (torch >= 2.13); torch 2.11's always buckets as
    ``custom_ops``, so there any other mode raises ``UnsupportedByThisTorch`` rather than being ignored.
    """
    upstream, parameters = _manual_overlap_bucketing()
    kwargs: dict[str, object] = {"insert_overlap_deps": insert_overlap_deps, "module_stack_fn": module_stack_fn}
    if "bucket_mode" in parameters:
        kwargs["bucket_mode"] = bucket_mode
    elif bucket_mode not in (None, _MANUAL_FIXED_BUCKET_MODE):
        raise UnsupportedByThisTorch("bucket_mode", (
            f"bucket_mode {bucket_mode!r} needs torch >= 2.13: torch {_torch.__version__}'s manual_overlap_bucketing "
            f"always buckets as {_MANUAL_FIXED_BUCKET_MODE!r} (set bucket_mode: {_MANUAL_FIXED_BUCKET_MODE})"))
    return upstream(gm, module_bucket_plans, **kwargs)


def _analytical_compute_estimate(node: _fx.Node, override_size: int | None = None) -> float | None:
    """torch 2.11's ``custom_runtime_estimation`` hook answering for compute nodes as ``compute_estimator=
    "analytical"`` does from torch 2.13 on (``estimate_roofline_runtime_ms``: the larger of FLOPs at peak and bytes
    at memory bandwidth, in ms), and ``None`` (upstream's own estimate) for the rest. 2.11's own analytical estimate
    asserts a CUDA device; this one reads the device figures ``no_triton_runtime_estimates`` supplies without one."""
    from torch._inductor.fx_passes import overlap_scheduling
    from torch.utils import _runtime_estimation as runtime_estimation
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    if not overlap_scheduling.is_compute_node(node):
        return None
    target = node.target
    if isinstance(target, _OpOverload) and target.is_view and target.namespace in ("aten", "prims"):
        return 0.0
    out = node.meta.get("val")
    if out is None:
        return 0.0

    def value(arg: object) -> object:
        return arg.meta.get("val") if isinstance(arg, _fx.Node) else arg

    args, kwargs = tree_map(value, node.args), tree_map(value, node.kwargs)
    outs = [t for t in tree_leaves(out) if isinstance(t, _torch.Tensor)]
    packet = getattr(target, "overloadpacket", None)
    compute_ns = 0.0
    if packet in flop_registry and outs:
        compute_ns = float(runtime_estimation.get_compute_time(packet, args, kwargs, out, {outs[0].dtype}))
    transfer_ns = float(runtime_estimation.get_transfer_time(tree_leaves((args, kwargs)), outs))
    return max(compute_ns, transfer_ns) / 1e6


def auto_scheduler_parameters() -> frozenset[str]:
    """The keyword arguments the installed torch's ``schedule_overlap_bucketing`` takes (from torch 2.13 on it
    pre-buckets FSDP collectives itself, ``pre_bucketing_fsdp_collectives``; torch 2.11 does not)."""
    return _schedule_overlap_bucketing()[1]


def schedule_overlap_bucketing(gm: _fx.GraphModule, **knobs: object) -> object:
    """Upstream automatic ``schedule_overlap_bucketing`` (imported on first use), with ``knobs`` (``AutoPolicy``'s
    fields, named as torch 2.13 names them) mapped onto the installed release:

    - torch 2.11 has no ``compute_estimator``: it benchmarks every compute node unless a ``custom_runtime_estimation``
      answers first, so ``"analytical"`` becomes one that answers with its analytical estimate for compute nodes;
      ``"benchmark"`` is what it does anyway.
    - A knob the release does not take, set to anything but "torch's default" (``None``), raises
      ``UnsupportedByThisTorch``; ``None`` is dropped. Nothing is ignored silently.
    """
    upstream, parameters = _schedule_overlap_bucketing()
    kwargs: dict[str, object] = {}
    for name, value in knobs.items():
        if name in parameters:
            kwargs[name] = value
        elif name == "compute_estimator" and "custom_runtime_estimation" in parameters:
            if value == "analytical" and knobs.get("custom_runtime_estimation") is None:
                kwargs["custom_runtime_estimation"] = _analytical_compute_estimate
        elif value is not None:
            raise UnsupportedByThisTorch(name, (
                f"{name}={value!r} needs a newer torch: torch {_torch.__version__}'s schedule_overlap_bucketing has "
                f"no {name!r} (leave it unset, null, to use this torch's behaviour)"))
    return upstream(gm, **kwargs)


@functools.cache
def roofline_estimates_work() -> bool:
    """Whether inductor's roofline estimates can run here: triton imports *and* finds a device it drives.

    Asked once, at first need (``torch.utils._triton.has_triton``, torch's own answer; it looks at the devices, so
    not at import). A CUDA build of torch on a machine without a GPU has triton, which imports and then finds no
    driver (``RuntimeError: 0 active drivers ([]). There should only be one.``): that is a "no" like a CPU build.
    """
    from torch.utils._triton import has_triton

    try:
        return bool(has_triton())
    except (ImportError, RuntimeError):
        return False


@contextlib.contextmanager
def no_triton_runtime_estimates() -> Iterator[None]:
    """Let upstream schedulers run where inductor cannot time kernels on a GPU, for the duration of the block.

    ``OverlapScheduler.__init__`` asks ``torch._inductor.utils.get_gpu_dram_gbps`` (triton) for roofline
    estimates even when every estimate is overridden; without triton that raises ``ModuleNotFoundError``, and with
    triton but no GPU (a CUDA wheel on a laptop or login node) triton's ``RuntimeError: 0 active drivers``. Where
    the estimates work (``roofline_estimates_work``) nothing is changed.
    """
    if roofline_estimates_work():
        yield
        return
    import torch._inductor.utils as inductor_utils
    import torch.utils._runtime_estimation as runtime_estimation

    # Nominal figures (an H100's order of magnitude) only feed upstream's estimates; the manual scheduler
    # overrides every estimate with 0, and ``auto`` on a CPU is a planning aid, not a measurement.
    fakes = {"get_gpu_dram_gbps": lambda *a, **k: 3000, "get_device_tflops": lambda *a, **k: 500.0}
    saved = [(mod, name, getattr(mod, name)) for mod in (inductor_utils, runtime_estimation) for name in fakes
             if hasattr(mod, name)]
    # torch 2.11's automatic scheduler also logs an analytical estimate of every compute node from a function that
    # asserts a CUDA device (``estimate_runtime_analytical``); it only feeds that log line.
    from torch._inductor.fx_passes import overlap_scheduling

    if hasattr(overlap_scheduling, "estimate_runtime_analytical"):
        saved.append((overlap_scheduling, "estimate_runtime_analytical",
                      overlap_scheduling.estimate_runtime_analytical))
        fakes["estimate_runtime_analytical"] = lambda node: _analytical_compute_estimate(node) or 0.0
    for mod, name, _ in saved:
        setattr(mod, name, fakes[name])
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)

__all__ += ["OrderedSet"]


def _cycle_log() -> logging.Logger | None:
    """The logger torch's cyclic-hint fixer writes to, where this release has that fixer (torch >= 2.13)."""
    from torch._inductor import augmented_graph_helper
    from torch._inductor import config as inductor_config

    has_fixer = hasattr(inductor_config.aten_distributed_optimizations, "overlap_scheduling_autofix_cycles")
    return getattr(augmented_graph_helper, "log", None) if has_fixer else None


_CYCLE_LOG = _cycle_log()


@contextlib.contextmanager
def dropped_cyclic_overlap_deps() -> Iterator[list[str]]:
    """Within the block, upstream's automatic scheduler drops the ordering dependencies it added that form a
    cycle instead of raising ``RuntimeError: detected N cyclic extra dep(s)`` (inductor's own escape hatch,
    ``aten_distributed_optimizations.overlap_scheduling_autofix_cycles``), and the yielded list collects torch's
    message naming each dropped pair. The dependencies are overlap hints, not data edges: dropping one costs
    overlap, never correctness (and ``apply`` verifies the result).

    Seen with ``collective_bucketing`` on HSDP backward graphs that reduce-scatter first: a bucket of
    reduce-scatters gets a hint to wait for compute that itself needs an earlier all-reduce of the bucket.

    torch 2.11 has neither the setting nor the check (its scheduler does not look for cyclic hints): there the
    block changes nothing and the list stays empty."""
    from torch._inductor import config as inductor_config

    found: list[str] = []
    if _CYCLE_LOG is None:
        yield found
        return
    logger = _CYCLE_LOG

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "cyclic extra dep" in message:
                found.append(message)

    handler = _Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        with inductor_config.patch({"aten_distributed_optimizations.overlap_scheduling_autofix_cycles": True}):
            yield found
    finally:
        logger.removeHandler(handler)


__all__ += ["dropped_cyclic_overlap_deps"]

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


def compile_fx_from_fake_inputs(gm: _fx.GraphModule, *, is_backward: bool) -> object:
    """Inductor's ``compile_fx_inner`` of an aot graph given the fake values on its placeholders as inputs: the
    graph is lowered and its kernels are generated and compiled for the placeholders' device, and nothing runs.

    For a step captured under a fake process group (where running would move no data), or too big to run here.
    The graph must have been traced with ``inductor_decompositions()``, as inductor's own route traces it; the
    caller patches inductor's settings. The fake values come from the capture's fake mode, which inductor must see
    as the tracing context's (aot_autograd sets it up the same way before calling its compilers).
    """
    from torch._guards import TracingContext, detect_fake_mode, tracing

    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(inputs)
    if mode is None:
        raise ValueError("compile_fx_from_fake_inputs: the graph's placeholders carry no fake values (meta['val'])")
    with tracing(TracingContext(mode)), mode:
        return compile_fx_inner(gm, inputs, is_backward=is_backward)


def inductor_decompositions() -> dict[object, object]:
    """The decomposition table inductor's own ``compile_fx`` hands to aot_autograd (depends on inductor config)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


__all__ += ["compile_fx_from_fake_inputs", "compile_fx_inner", "inductor_config_patch", "inductor_decompositions"]

# torch's own file hash for ``CustomGraphPass.uuid()`` (``overlapcfg.passes.compile.source_hash``).
from torch._inductor.custom_graph_pass import get_hash_for_files as hash_files  # noqa: E402

__all__ += ["hash_files"]


# --- verify: element provenance (overlapcfg.graph.provenance) ------------------------------------------------------
# The copy-in ops that torch's bucket modes emit, which the verifier interprets, and the dtype table that
# ``_pre_bucket_all_gather`` encodes each input's dtype with (``out_dtype_ints`` are indices into it).
pre_bucket_all_gather = _torch.ops.bucketing._pre_bucket_all_gather.default
pre_bucket_reduce_scatter = _torch.ops.bucketing._pre_bucket_reduce_scatter.default
bucket_dtype_table: tuple[_torch.dtype, ...] = tuple(_bucketing._ALL_DTYPES)

_PRE_BUCKET_ALL_GATHER_ARGS = tuple(a.name for a in pre_bucket_all_gather._schema.arguments)
"""Argument names of ``_pre_bucket_all_gather``, in order: torch 2.11's schema has a ``group_name`` after
``group_size`` that 2.13 dropped, so positions differ between releases and names do not."""


def pre_bucket_all_gather_arguments(args: Sequence[object], kwargs: Mapping[str, object]) -> dict[str, object]:
    """A ``_pre_bucket_all_gather`` call's arguments by schema name (``ag_ins``, ``group_size``, ``dtype``,
    ``out_dtype_ints``, ``rank``, ``foreach_group_indices``; ``group_name`` too on torch 2.11), for readers that
    must not depend on the installed release's argument positions. Missing optional arguments are absent."""
    bound = dict(zip(_PRE_BUCKET_ALL_GATHER_ARGS, args, strict=False))
    bound.update(kwargs)
    return bound


def call_pre_bucket_all_gather(**arguments: object) -> _torch.Tensor:
    """``bucketing._pre_bucket_all_gather`` with its arguments by name, those this release's schema has (torch
    2.11's takes ``group_name`` too): passed by name, the call records the same node as upstream's positional call
    on each release."""
    return pre_bucket_all_gather(**{k: v for k, v in arguments.items() if k in _PRE_BUCKET_ALL_GATHER_ARGS})


__all__ += ["bucket_dtype_table", "call_pre_bucket_all_gather", "pre_bucket_all_gather",
            "pre_bucket_all_gather_arguments", "pre_bucket_reduce_scatter"]


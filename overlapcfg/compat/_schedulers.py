"""Torch's upstream overlap schedulers, for the ``torch_manual`` and ``auto`` strategies: ``manual_overlap_bucketing``
and ``schedule_overlap_bucketing`` with their settings mapped onto the installed release (probed from their
signatures; a setting a release cannot honour raises ``UnsupportedByThisTorch``), and the one scope in which
overlapcfg changes torch around a call to them (``upstream_scheduler_scope``: stand-in device figures without a
GPU, the cyclic ordering hints ``auto`` may make, torch's FSDP summary line), restored on exit.

Like ``overlapcfg.compat._torch``, reached as ``overlapcfg.compat.<name>``; nothing else imports them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch as _torch
from torch import fx as _fx
from torch._ops import OpOverload as _OpOverload
from torch.utils._pytree import tree_leaves

from overlapcfg.compat._torch import quiet_logger_records
from overlapcfg.errors import OverlapConfigError

__all__ = [
    "UnsupportedByThisTorch",
    "UpstreamRun",
    "auto_scheduler_parameters",
    "manual_bucketing_parameters",
    "manual_overlap_bucketing",
    "roofline_estimates_work",
    "schedule_overlap_bucketing",
    "upstream_scheduler_scope",
]


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


class UnsupportedByThisTorch(OverlapConfigError):
    """A setting the installed torch's upstream pass has no way to honour (``setting``: the policy field; the
    message says what this torch does instead). Strategies turn it into a config error at the setting's path
    (``overlapcfg.strategies.interface.this_torch_supports``); one that escapes is still a config error, without it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


_MANUAL_FIXED_BUCKET_MODE = "custom_ops"
"""torch 2.11's ``manual_overlap_bucketing`` has no ``bucket_mode`` and always buckets as ``custom_ops``."""


def manual_bucketing_parameters() -> frozenset[str]:
    """The keyword arguments the installed torch's ``manual_overlap_bucketing`` takes (``bucket_mode`` from torch
    2.12 on; 2.11 has none)."""
    return _manual_overlap_bucketing()[1]


def manual_overlap_bucketing(gm: _fx.GraphModule, module_bucket_plans: list[list[str]], *,
                             insert_overlap_deps: bool = False, module_stack_fn: Callable[..., object] | None = None,
                             bucket_mode: str | None = None) -> object:
    """Upstream ``manual_overlap_bucketing`` (imported on first use: its module pulls in the whole scheduler).

    ``bucket_mode`` is passed where upstream takes it (torch >= 2.12); torch 2.11's always buckets as
    ``custom_ops``, so there any other mode raises ``UnsupportedByThisTorch`` rather than being ignored.
    """
    upstream, parameters = _manual_overlap_bucketing()
    kwargs: dict[str, object] = {"insert_overlap_deps": insert_overlap_deps, "module_stack_fn": module_stack_fn}
    if "bucket_mode" in parameters:
        kwargs["bucket_mode"] = bucket_mode
    elif bucket_mode not in (None, _MANUAL_FIXED_BUCKET_MODE):
        raise UnsupportedByThisTorch("bucket_mode", (
            f"bucket_mode {bucket_mode!r} needs torch >= 2.12: torch {_torch.__version__}'s manual_overlap_bucketing "
            f"always buckets as {_MANUAL_FIXED_BUCKET_MODE!r} (set bucket_mode: {_MANUAL_FIXED_BUCKET_MODE})"))
    return upstream(gm, module_bucket_plans, **kwargs)


def _analytical_compute_estimate(node: _fx.Node, override_size: int | None = None) -> float | None:
    """torch 2.11's ``custom_runtime_estimation`` hook answering for compute nodes as ``compute_estimator=
    "analytical"`` does from torch 2.13 on (``estimate_roofline_runtime_ms``: the larger of FLOPs at peak and bytes
    at memory bandwidth, in ms), and ``None`` (upstream's own estimate) for the rest. 2.11's own analytical estimate
    asserts a CUDA device; this one reads the device figures ``upstream_scheduler_scope`` supplies without one."""
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


_SCOPE_LOCK = threading.RLock()
"""Held for the whole of an ``upstream_scheduler_scope``: what it changes in torch is process-wide, so two threads
running upstream's schedulers take turns rather than undo each other's changes."""


@dataclass(slots=True)
class UpstreamRun:
    """What an ``upstream_scheduler_scope`` saw: the cyclic ordering hints torch's scheduler dropped (torch's own
    message for each batch, one string per report; empty unless the scope was asked to drop them)."""

    dropped_cyclic_hints: list[str] = field(default_factory=list)


@contextlib.contextmanager
def upstream_scheduler_scope(*, drop_cyclic_hints: bool = False) -> Iterator[UpstreamRun]:
    """The one place overlapcfg changes torch, for the duration of a call to one of torch's overlap schedulers
    (``manual_overlap_bucketing``, ``schedule_overlap_bucketing``). Everything is put back on exit, on every path,
    and the scope holds a lock: nested scopes in one thread are fine, scopes in two threads run one after the other.

    - **Roofline estimates without a GPU.** ``OverlapScheduler.__init__`` asks
      ``torch._inductor.utils.get_gpu_dram_gbps`` (triton) for roofline estimates even when every estimate is
      overridden; without triton that raises ``ModuleNotFoundError``, and with triton but no GPU (a CUDA wheel on a
      laptop or login node) ``RuntimeError: 0 active drivers``. torch has no setting to skip it, so where the
      estimates cannot run (``roofline_estimates_work``) the functions it calls are replaced by nominal figures (an
      H100's order of magnitude: they only feed upstream's estimates, which the manual scheduler overrides with 0
      and which ``auto`` on a CPU uses as a planning aid). Code in other threads calling those functions while the
      scope is open sees the figures too (without a GPU the real ones fail). Where they run, nothing is replaced.
    - **Cyclic ordering hints** (``drop_cyclic_hints``): torch's automatic scheduler drops the ordering hints it
      added that would form a cycle instead of raising ``RuntimeError: detected N cyclic extra dep(s)``
      (``aten_distributed_optimizations.overlap_scheduling_autofix_cycles``, set through torch's own config
      ``patch``). Torch says which hints it dropped only in a WARNING of its augmented-graph helper's logger (that
      logger's one message): ``UpstreamRun.dropped_cyclic_hints`` collects the warnings that logger emits on this
      thread inside the scope. torch 2.11 has neither the setting nor the check: there nothing changes and the list
      stays empty.
    - **The estimate logs nobody reads.** torch 2.13's schedulers build two tables whether or not anyone reads
      them: one of every compute node (its FLOP count by a FLOP counter over the node's fake tensors, both
      estimates, a summary of its arguments: ``node_runtime_estimation._log_compute_estimations``) and one of every
      collective (its key and both of torch's estimates: ``_log_collective_benchmarks``). Each only ever reaches
      torch's structured trace (``TORCH_TRACE`` / ``tlparse``). Where that trace has no reader, both are replaced by
      a function that does nothing: about 5 CPU seconds of a 32-layer step's ``auto`` + ``collective_bucketing``
      apply, 1 of ``auto`` alone, for the compute table, and about 4 % of both for the collective one
      (``benchmarks/tune.py``'s first case). With a reader they run as torch wrote them; the schedule is the same
      either way (each table is written after the estimates are made and is read by nothing else).
    - **The FSDP pre-bucketing summary.** ``torch/_inductor/fx_passes/fsdp.py`` sets its logger to INFO at import,
      so the automatic scheduler's one-line summary per graph reaches torch's console handler whatever the user
      configured; the overlapcfg command printed two in the middle of its report. Inside the scope, records below
      WARNING that this thread logs there are dropped while the logger is still at the level torch gave it (a level
      someone chose since is left to speak).
    """
    with contextlib.ExitStack() as scope, _SCOPE_LOCK:
        run = UpstreamRun()
        if not roofline_estimates_work():
            scope.enter_context(_stand_in_estimates())
        if not _structured_trace_is_read():
            scope.enter_context(_unread_estimate_log_skipped())
        scope.enter_context(quiet_logger_records(_fsdp_logger(), below=logging.WARNING,
                                                 only_at_level=logging.INFO))
        if drop_cyclic_hints and _CYCLE_LOG is not None:
            from torch._inductor import config as inductor_config

            scope.enter_context(_collected_warnings(_CYCLE_LOG, run.dropped_cyclic_hints))
            scope.enter_context(inductor_config.patch(
                {"aten_distributed_optimizations.overlap_scheduling_autofix_cycles": True}))
        yield run


@contextlib.contextmanager
def _stand_in_estimates() -> Iterator[None]:
    """Replace the device-figure functions upstream's scheduler set-up calls (see ``upstream_scheduler_scope``);
    restored on exit. Only ever entered under ``_SCOPE_LOCK``."""
    import torch._inductor.utils as inductor_utils
    import torch.utils._runtime_estimation as runtime_estimation
    from torch._inductor.fx_passes import overlap_scheduling

    stand_ins: dict[str, Callable[..., object]] = {"get_gpu_dram_gbps": lambda *a, **k: 3000,
                                                   "get_device_tflops": lambda *a, **k: 500.0}
    replaced = [(mod, name, getattr(mod, name)) for mod in (inductor_utils, runtime_estimation) for name in stand_ins
                if hasattr(mod, name)]
    # torch 2.11's automatic scheduler also logs an analytical estimate of every compute node from a function that
    # asserts a CUDA device (``estimate_runtime_analytical``); it only feeds that log line.
    if hasattr(overlap_scheduling, "estimate_runtime_analytical"):
        replaced.append((overlap_scheduling, "estimate_runtime_analytical",
                         overlap_scheduling.estimate_runtime_analytical))
        stand_ins["estimate_runtime_analytical"] = lambda node: _analytical_compute_estimate(node) or 0.0
    try:
        for mod, name, _ in replaced:
            setattr(mod, name, stand_ins[name])
        yield
    finally:
        for mod, name, original in replaced:
            setattr(mod, name, original)


def _structured_trace_is_read() -> bool:
    """Whether torch's structured trace has a reader: a handler on its log other than torch's own lazy one without
    a directory (``TORCH_TRACE`` unset), which writes nothing outside Meta's infrastructure and removes itself at
    the first record it gets."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    return any(not (isinstance(h, LazyTraceHandler) and h.root_dir is None) for h in trace_log.handlers)


_UNREAD_LOGS = ("_log_compute_estimations", "_log_collective_benchmarks")
"""torch's functions (in ``torch._inductor.fx_passes.node_runtime_estimation``) that only build a table for the
structured trace."""


@contextlib.contextmanager
def _unread_estimate_log_skipped() -> Iterator[None]:
    """torch's estimate log tables (``_UNREAD_LOGS``) replaced by a no-op (see ``upstream_scheduler_scope``);
    restored on exit. Only ever entered under ``_SCOPE_LOCK``. torch's schedulers import these functions from their
    module at each call, so the module attribute is what they find. A release without one leaves it as it is."""
    from torch._inductor.fx_passes import node_runtime_estimation as estimation

    def unread(*args: object, **kwargs: object) -> None:
        return None

    replaced = [(name, getattr(estimation, name)) for name in _UNREAD_LOGS if hasattr(estimation, name)]
    try:
        for name, _ in replaced:
            setattr(estimation, name, unread)
        yield
    finally:
        for name, original in replaced:
            setattr(estimation, name, original)


def _fsdp_logger() -> logging.Logger:
    from torch._inductor.fx_passes import fsdp

    return logging.getLogger(fsdp.__name__)


def _cycle_log() -> logging.Logger | None:
    """The logger torch's cyclic-hint fixer reports to, where this release has that fixer (torch >= 2.13)."""
    from torch._inductor import augmented_graph_helper
    from torch._inductor import config as inductor_config

    has_fixer = hasattr(inductor_config.aten_distributed_optimizations, "overlap_scheduling_autofix_cycles")
    return getattr(augmented_graph_helper, "log", None) if has_fixer else None


_CYCLE_LOG = _cycle_log()


@contextlib.contextmanager
def _collected_warnings(logger: logging.Logger, into: list[str]) -> Iterator[None]:
    """Append the message of every WARNING (or worse) ``logger`` emits on this thread inside the block to
    ``into``; the logger's output is otherwise unchanged."""
    thread = threading.get_ident()

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.thread == thread:
                into.append(record.getMessage())

    handler = _Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)

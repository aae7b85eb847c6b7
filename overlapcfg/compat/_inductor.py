"""Private inductor pieces: collective recognition and bucketing helpers, the upstream schedulers (with their
CPU-only workaround), compiling aot graphs, the custom-pass hash, and the bucket copy-in ops the verifier reads.

Like ``overlapcfg.compat._torch``, reached as ``overlapcfg.compat.<name>``; nothing else imports them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

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
from torch.utils._ordered_set import OrderedSet

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
    "schedule_overlap_bucketing",
]


control_deps = _control_deps
"""The wrapper ``insert_overlap_deps`` puts around an op to order it (what ``unwrap_control_deps`` sees through)."""


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


def manual_overlap_bucketing(*args: object, **kwargs: object) -> object:
    """Upstream ``manual_overlap_bucketing`` (imported on first use: its module pulls in the whole scheduler)."""
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing as upstream

    return upstream(*args, **kwargs)


def schedule_overlap_bucketing(*args: object, **kwargs: object) -> object:
    """Upstream automatic ``schedule_overlap_bucketing`` (imported on first use)."""
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing as upstream

    return upstream(*args, **kwargs)


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


@contextlib.contextmanager
def dropped_cyclic_overlap_deps() -> Iterator[list[str]]:
    """Within the block, upstream's automatic scheduler drops the ordering dependencies it added that form a
    cycle instead of raising ``RuntimeError: detected N cyclic extra dep(s)`` (inductor's own escape hatch,
    ``aten_distributed_optimizations.overlap_scheduling_autofix_cycles``), and the yielded list collects torch's
    message naming each dropped pair. The dependencies are overlap hints, not data edges: dropping one costs
    overlap, never correctness (and ``apply`` verifies the result).

    Seen with ``collective_bucketing`` on HSDP backward graphs that reduce-scatter first: a bucket of
    reduce-scatters gets a hint to wait for compute that itself needs an earlier all-reduce of the bucket."""
    import logging

    from torch._inductor import augmented_graph_helper
    from torch._inductor import config as inductor_config

    found: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "cyclic extra dep" in message:
                found.append(message)

    handler = _Collect(logging.WARNING)
    logger = augmented_graph_helper.log
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


def inductor_decompositions() -> dict[object, object]:
    """The decomposition table inductor's own ``compile_fx`` hands to aot_autograd (depends on inductor config)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


__all__ += ["compile_fx_inner", "inductor_config_patch", "inductor_decompositions"]

# torch's own file hash for ``CustomGraphPass.uuid()`` (``overlapcfg.passes.compile.source_hash``).
from torch._inductor.custom_graph_pass import get_hash_for_files as hash_files  # noqa: E402

__all__ += ["hash_files"]


# --- verify: element provenance (overlapcfg.graph.provenance) ------------------------------------------------------
# The copy-in ops that torch's bucket modes emit, which the verifier interprets, and the dtype table that
# ``_pre_bucket_all_gather`` encodes each input's dtype with (``out_dtype_ints`` are indices into it).
pre_bucket_all_gather = _torch.ops.bucketing._pre_bucket_all_gather.default
pre_bucket_reduce_scatter = _torch.ops.bucketing._pre_bucket_reduce_scatter.default
bucket_dtype_table: tuple[_torch.dtype, ...] = tuple(_bucketing._ALL_DTYPES)

_PRE_BUCKET_ALL_GATHER_ARGS = frozenset(a.name for a in pre_bucket_all_gather._schema.arguments)


def call_pre_bucket_all_gather(**arguments: object) -> _torch.Tensor:
    """``bucketing._pre_bucket_all_gather`` with its arguments by name, those this release's schema has: torch 2.11
    takes the group's name too (``group_name``, third), 2.13 and 2.14 do not. Passed by name, the call records the
    same node as upstream's positional call on each release."""
    return pre_bucket_all_gather(**{k: v for k, v in arguments.items() if k in _PRE_BUCKET_ALL_GATHER_ARGS})


__all__ += ["bucket_dtype_table", "call_pre_bucket_all_gather", "pre_bucket_all_gather", "pre_bucket_reduce_scatter"]


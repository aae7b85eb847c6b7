"""Private inductor pieces: collective recognition and bucketing helpers, the ordering wrapper, compiling aot graphs,
the custom-pass hash, and the bucket copy-in ops the verifier reads. The upstream schedulers are in
``overlapcfg.compat._schedulers``.

Like ``overlapcfg.compat._torch``, reached as ``overlapcfg.compat.<name>``; nothing else imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch as _torch
from torch import fx as _fx

from overlapcfg.errors import OverlapConfigError, OverlapUsageError

__all__: list[str] = []

# --- inductor: the bucket copy-in ops and ordering wrappers ------------------------------------------------------
# What the graph pass borrows from ``torch/_inductor/fx_passes``: the ops a merged bucket is made of (importing
# ``bucketing`` registers the ``bucketing::_pre_bucket_*`` copy-ins, which inductor lowers) and ``control_deps``.
# Upstream's two passes for the ``torch_manual`` and ``auto`` strategies are ``compat._schedulers``'. The merge
# itself is overlapcfg's (``overlapcfg.graph.bucket_fns`` and ``stamp``): upstream's merge helpers differ between
# releases.
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes import bucketing as _bucketing
from torch._inductor.fx_passes.control_dependencies import control_deps as _control_deps
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.utils._ordered_set import OrderedSet

__all__ += [
    "CustomGraphPass",
    "control_deps",
    "is_fsdp_reduce_scatter",
    "unwrap_control_deps",
    "unwrapped_call",
    "preserve_node_ordering",
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
    if target is not _control_deps or not isinstance(node, _fx.Node):
        return target, tuple(getattr(node, "all_input_nodes", ())), ()
    deps, subgraph_attr, *inputs = node.args
    module = node.graph.owning_module
    subgraph = getattr(module, str(getattr(subgraph_attr, "target", ""))) if module is not None else None
    inner = [n for n in subgraph.graph.nodes if n.op == "call_function"] if subgraph is not None else []
    inner_target = inner[0].target if len(inner) == 1 else target
    return inner_target, tuple(inputs), tuple(deps) if isinstance(deps, (list, tuple)) else (deps,)

def unwrapped_call(node: object) -> tuple[object, tuple[object, ...], dict[str, object]]:
    """``(target, args, kwargs)`` of a call as the op it runs, seeing through a ``control_deps`` wrapper.

    The wrapper passes only the op's node inputs (``control_deps(deps, subgraph, *inputs)``); its constants (a
    collective's group name and size) live in the subgraph's one call, whose placeholders stand for ``inputs``.
    Everything that reads an op's arguments by position reads them here, so a wrapped op is still that op.
    """
    if not isinstance(node, _fx.Node):
        raise OverlapUsageError(f"unwrapped_call: expected an fx node, got {type(node).__name__}")
    target = node.target
    if target is not _control_deps:  # the node's own containers, not copies: this runs once per node per proof
        return target, node.args, cast("dict[str, object]", node.kwargs)
    _, subgraph_attr, *inputs = node.args
    subgraph = getattr(node.graph.owning_module, str(getattr(subgraph_attr, "target", "")))
    calls = [n for n in subgraph.graph.nodes if n.op == "call_function"]
    if len(calls) != 1:
        return target, node.args, cast("dict[str, object]", node.kwargs)
    placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
    outer = dict(zip(placeholders, inputs, strict=True))
    args = _fx.map_arg(calls[0].args, lambda n: outer.get(n, n))
    kwargs = _fx.map_arg(calls[0].kwargs, lambda n: outer.get(n, n))
    return calls[0].target, tuple(args), dict(kwargs)


def is_fsdp_reduce_scatter(node: object) -> bool:
    """Upstream's own test for an FSDP reduce-scatter (an independent oracle for the test suite; overlapcfg's
    classification is ``overlapcfg.graph.gradients``')."""
    return isinstance(node, _fx.Node) and bool(_bucketing.is_fsdp_reduce_scatter(node))


__all__ += ["OrderedSet"]

# --- inductor: compiling aot graphs (overlapcfg.passes.compile) -----------------------------------------------
# ``compile_fx_inner`` is what inductor's own aot_autograd fw/bw compilers call: it runs the post-grad passes and
# lowers one graph (boxed calling convention, as aot_autograd expects). ``inductor_config_patch`` scopes the
# settings a manual schedule needs to one compile. compile_fx and the decompositions are imported on first use
# (they pull in all of inductor's lowering).
from torch._inductor import config as _inductor_config  # noqa: E402

inductor_config_patch = _inductor_config.patch


def compile_fx_inner(*args: Any, **kwargs: Any) -> Any:
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
        raise OverlapConfigError("compile_fx_from_fake_inputs: the graph's placeholders carry no fake values "
                                 "(meta['val'])")
    with tracing(TracingContext(mode)), mode:
        return compile_fx_inner(gm, inputs, is_backward=is_backward)


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
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


"""Private torch pieces for tracing and classification: dynamo, aot_autograd descriptors and partitioner, the fake
op identity and FLOP formulas, graph snapshots and lazy copies. ``torch.distributed``'s pieces (the fake process
group, the functional collectives' ops) are in ``overlapcfg.compat._distributed``, inductor's (bucketing,
compile) in ``overlapcfg.compat._inductor``, its upstream schedulers in ``overlapcfg.compat._schedulers``.

Everything else in overlapcfg imports them from here, so a torch upgrade that moves one of them breaks exactly one
module, and each probe for a changed API runs once at import instead of ``hasattr`` checks at call sites.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch as _torch
import torch.fx as _fx

# --- dynamo ------------------------------------------------------------------------------------------------------
from torch._dynamo import reset as dynamo_reset

# --- aot_autograd and the partitioner ------------------------------------------------------------------------
# The min-cut partitioner is required: the default partitioner saves the all-gathered (full) weights for backward,
# so a reshard-after-forward backward would lose its all-gathers.
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import Unsupported as DynamoUnsupported  # a graph break under fullgraph=True

# Descriptors on aot graph placeholders / outputs (``node.meta["desc"]``): which flat input a primal is, and which
# input a backward output is the gradient of. They make attribution independent of node names.
from torch._functorch._aot_autograd.descriptors import (
    GradAOTOutput,
    PlainAOTInput,
    SavedForBackwardsAOTOutput,
    SavedForBackwardsNoVcCheckAOTOutput,
)
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import Source
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY

# --- pytree: the tensors in a model's output (tuples, dicts, Hugging Face ``ModelOutput``, which registers itself),
# and fake values that are lists of tensors (a split's pieces) ---------------------------------------------------
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = [
    "DynamoUnsupported",
    "GradAOTOutput",
    "PlainAOTInput",
    "aot_autograd",
    "dynamo_input_source",
    "dynamo_recompile_limit",
    "dynamo_reset",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

# ``Source.name`` became a cached property in torch 2.13 (a method before): probe once here.
_SOURCE_NAME_IS_PROPERTY = isinstance(
    inspect.getattr_static(Source, "name"), (property, functools.cached_property)
)


@contextlib.contextmanager
def dynamo_recompile_limit(limit: int) -> Iterator[None]:
    """Within the block, dynamo keeps at least ``limit`` compiled versions of one code object (default 8): one model
    compiled once per backend, all alive at once (``overlapcfg.measure`` interleaves configs), needs one each."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(recompile_limit=max(limit, dynamo_config.recompile_limit)):
        yield


def dynamo_input_source(placeholder: object) -> str | None:
    """The dynamo source of a dynamo-graph placeholder, e.g. ``L['self']._modules['norm']._parameters['weight']``.

    ``None`` when dynamo recorded no source (a symbolic size, say).
    """
    grapharg = getattr(placeholder, "meta", {}).get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    return source.name if _SOURCE_NAME_IS_PROPERTY else source.name()


# --- op identity and FLOP formulas (graph classification, cost model) ----------------------------------------
# ``torch._ops.OpOverload`` is private; the graph layer asks these questions instead of isinstance checks.
from torch._functorch._aot_autograd.descriptors import AOTInput as _AOTInput  # noqa: E402
from torch._ops import OpOverload as _OpOverload  # noqa: E402
from torch._ops import OpOverloadPacket as _OpOverloadPacket  # noqa: E402
from torch.utils import flop_counter as _flop_counter  # noqa: E402

_aten = _torch.ops.aten
# CPU SDPA kernels (what a CPU trace records) have no formula in torch's registry; they do the work of flash
# attention and take the same arguments first, so they borrow its formula.
_EXTRA_FLOPS: dict[object, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _flop_counter.flop_registry[
        _aten._scaled_dot_product_flash_attention],
}


def _sdpa_cpu_backward_flops(grad_out: _torch.Tensor, query: _torch.Tensor, key: _torch.Tensor,
                             value: _torch.Tensor, *args: object, **kwargs: object) -> int:
    return int(_flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


_EXTRA_FLOPS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flops


def op_name(target: object) -> str:
    """``namespace.name`` of an op overload (``aten.mm``, ``_c10d_functional.all_gather_into_tensor``); the
    target's string form for anything else."""
    if isinstance(target, _OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, _OpOverloadPacket):
        return str(target)
    return getattr(target, "__name__", str(target))


def op_overload_name(target: object) -> str | None:
    """``namespace.name.overload`` of an op overload (``aten.mm.default``), which ``op_overload_named`` turns back
    into the op in another process; None for anything else (a Python function, a higher-order op)."""
    if isinstance(target, _OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return None


def op_overload_named(name: str) -> Callable[..., object] | None:
    """The op overload ``op_overload_name`` named, looked up in ``torch.ops``; None where this process has no such
    op (a custom op whose library is not loaded here)."""
    namespace, _, rest = name.partition(".")
    opname, _, overload = rest.rpartition(".")
    try:
        op = getattr(getattr(getattr(_torch.ops, namespace), opname), overload)
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, _OpOverload) else None


def is_functional_collective(target: object) -> bool:
    """An op of the ``_c10d_functional`` namespace (collectives and ``wait_tensor``)."""
    return isinstance(target, _OpOverload) and target.namespace == "_c10d_functional"


def is_op_overload(target: object) -> bool:
    return isinstance(target, _OpOverload)


_FORMULA_OF: dict[int, tuple[object, int, Callable[..., int] | None]] = {}
"""Op identity -> (op, FLOP-registry size when looked up, formula): the cost model asks for every node of a step
many times over, and an op overload hashes in Python. The entry holds the op, so no other object takes its id."""


def flop_registry_size() -> int:
    """How many formulas torch's FLOP registry holds: registering one (``register_flop_formula``) only adds, so a
    lookup made at another size may be stale."""
    return len(_flop_counter.flop_registry)


def flop_formula(target: object) -> Callable[..., int] | None:
    """torch's FLOP formula for an op (``torch.utils.flop_counter``), CPU attention kernels included; else None."""
    size = len(_flop_counter.flop_registry)
    known = _FORMULA_OF.get(id(target))
    if known is not None and known[0] is target and known[1] == size:
        return known[2]
    packet = getattr(target, "overloadpacket", None)
    if packet in _EXTRA_FLOPS:
        formula: Callable[..., int] | None = _EXTRA_FLOPS[packet]
    else:
        formula = _flop_counter.flop_registry.get(packet) or _flop_counter.flop_registry.get(target)
    _FORMULA_OF[id(target)] = (target, size, formula)
    return formula


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


def is_saved_for_backward_descriptor(desc: object) -> bool:
    """An aot forward-output descriptor of a tensor saved for the backward graph (where it is a placeholder of the
    same name, with no descriptor of its own)."""
    return isinstance(desc, (SavedForBackwardsAOTOutput, SavedForBackwardsNoVcCheckAOTOutput))


ArgumentRef = tuple[int, str]
"""An operator argument as ``(position in the schema, name)``: positional if passed so, else a keyword."""


@functools.cache
def op_effects(target: object) -> tuple[tuple[ArgumentRef, ...], ArgumentRef | None]:
    """``(written arguments, the argument the first result aliases)`` of an op, read from its schema's alias
    annotations: ``Tensor(a!) self`` / ``Tensor(a!) out`` / ``Tensor(a!)[] self`` are written; a result annotated
    ``Tensor(a)`` (a view, or an in-place op's ``self``) aliases the argument annotated ``a``, and a list of views
    (``split``, ``unbind``: ``Tensor(a -> *) self -> Tensor(a)[]``) aliases ``self``. ``((), None)`` for targets
    without a schema (Python callables, most higher-order ops). The one schema reader: node-level questions (what
    a node writes, whether it aliases) are ``overlapcfg.graph.ops``'."""
    schema = getattr(target, "_schema", None)
    if not isinstance(schema, _torch._C.FunctionSchema):
        return (), None
    args = schema.arguments
    writes = tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
    alias = None
    if schema.returns and schema.returns[0].alias_info is not None:
        sets = set(schema.returns[0].alias_info.before_set) - {"*"}

        def aliased(info: _torch._C.AliasInfo | None) -> bool:
            if info is None:
                return False
            if sets:
                return bool(sets & set(info.before_set))
            # A list of views (``split``: ``Tensor(a -> *) self -> Tensor(a)[]``) or a wildcard result: the
            # elements alias the argument whose set flows into the wildcard, or any annotated one.
            return "*" in info.after_set or bool(info.before_set)

        alias = next(((i, a.name) for i, a in enumerate(args) if aliased(a.alias_info)), None)
    return writes, alias


__all__ += ["ArgumentRef", "flop_formula", "flop_registry_size", "is_functional_collective", "is_op_overload",
            "is_plain_input_descriptor", "is_saved_for_backward_descriptor", "op_effects", "op_name",
            "op_overload_name", "op_overload_named"]

class GraphSnapshot:
    """What a graph is now, kept to rebuild it as an independent copy later, if a pass fails half-way.

    Taking it costs a reference per node field and a shallow copy of each node's ``meta`` dict: a node's ``args``
    and ``kwargs`` are immutable containers that fx replaces rather than mutates, and the original node objects
    stay alive as keys even when a pass erases them. ``rebuild()`` then makes what an up-front copy would have made
    (same node names, metadata dicts copied, the output node's metadata too, same tracer class and code generator),
    paying for new nodes only on the failure path. ``Graph`` has no public copy that keeps its tracer class and
    codegen, and ``graph_copy`` leaves the output node out (aot's ``desc``, inductor's ``output_stack_traces``
    live in its metadata)."""

    __slots__ = ("_codegen", "_nodes", "_owning_module", "_tracer_cls")

    def __init__(self, graph: _fx.Graph) -> None:
        self._nodes = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, dict(n.meta)) for n in graph.nodes]
        self._owning_module = graph.owning_module
        self._tracer_cls = graph._tracer_cls
        self._codegen = graph._codegen

    def rebuild(self) -> _fx.Graph:
        """A new graph holding what the snapshot saw (the snapshot stays usable)."""
        graph = _fx.Graph(owning_module=self._owning_module, tracer_cls=self._tracer_cls)
        env: dict[_fx.Node, _fx.Node] = {}
        lookup = env.__getitem__
        for node, op, target, args, kwargs, name, type_expr, meta in self._nodes:
            if op == "output":
                new = graph.output(_fx.map_arg(args[0], lookup), type_expr=type_expr)
            else:
                new = graph.create_node(op, target, _fx.map_arg(args, lookup), _fx.map_arg(kwargs, lookup), name,
                                        type_expr)
                env[node] = new
            new.meta = dict(meta)
        graph._codegen = self._codegen
        return graph


__all__ += ["GraphSnapshot"]


def lazy_graph_module_copy(gm: _fx.GraphModule) -> _fx.GraphModule:
    """A copy of ``gm`` that writes its Python code only when it is first called or read.

    The graph is copied as ``copy.deepcopy`` copies it (same node names, metadata dicts copied, the output node's
    too, same code generator) and so is ``gm.meta``. Attributes the graph reads (``get_attr`` targets, called
    submodules) are shared with ``gm``, as ``GraphModule(gm, graph)`` shares them, except graph modules (the
    subgraphs of higher-order ops), which are deep-copied: inductor rewrites those in place when it compiles ``gm``,
    and that must not reach the copy. The copy is torch's ``_LazyGraphModule``, which inductor uses for the same
    reason: a copy made to be transformed and inspected need not pay for generating and compiling code nobody runs
    (for a 12k-node graph, most of ``deepcopy``'s time, and as much again for the pass's closing ``recompile``).
    ``.code``, ``print_readable`` and calling it generate the code then, as for any ``GraphModule``."""
    copied = _LazyGraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    _own_subgraphs(copied, gm)
    copied.meta = copy.deepcopy(getattr(gm, "meta", {}))
    for name, value in copied.meta.get(_USER_PRESERVED_ATTRIBUTES_KEY, {}).items():
        setattr(copied, name, value)  # as GraphModule.__deepcopy__ puts them back
    return copied


def _own_subgraphs(copied: _torch.nn.Module, original: _torch.nn.Module) -> None:
    """Replace the graph modules ``copied`` shares with ``original`` by deep copies, also under the holder modules
    ``GraphModule.__init__`` makes for dotted targets (new objects; modules shared with ``original`` are left
    alone, so nothing of ``original`` is changed)."""
    for name, child in list(copied.named_children()):
        source = getattr(original, name, None)
        if isinstance(child, _fx.GraphModule):
            setattr(copied, name, copy.deepcopy(child))
        elif source is not None and child is not source:
            _own_subgraphs(child, source)


LazyGraphModule = _LazyGraphModule
"""Torch's ``GraphModule`` whose ``recompile()`` only marks the code stale (generated when first read or called)."""

__all__ += ["LazyGraphModule", "lazy_graph_module_copy"]


# --- fx: hooks a GraphModule may carry, and copying a node a second time ------------------------------------------
# ``GraphModule`` lets code register callbacks that see every node created and every use replaced
# (``_register_create_node_hook``, ``_register_replace_node_hook``); torch keeps them in private lists, and has no
# public way to ask whether there are any. The merge asks, to take its short cuts only where nobody is watching.


def has_node_creation_hooks(gm: object) -> bool:
    """Whether ``gm`` (a ``GraphModule``, or None) has callbacks that must see each node ``create_node`` makes."""
    return bool(getattr(gm, "_create_node_hooks", None))


def has_replace_hooks(gm: object) -> bool:
    """Whether ``gm`` (a ``GraphModule``, or None) has callbacks that must see each ``replace_all_uses_with``."""
    return bool(getattr(gm, "_replace_hooks", None))


def copy_node_checked_before(g: _fx.Graph, node: _fx.Node,
                             arg_transform: Callable[[_fx.Node], _fx.node.Argument]) -> _fx.Node:
    """``g.node_copy(node, arg_transform)`` for a node whose arguments ``node_copy`` already checked when the same
    traced graph was first stamped into ``g``, without ``create_node``'s scan of every argument for raw symbolic
    values (a ``pytree`` walk, 80% of ``create_node``'s time on a merge's long argument lists): the arguments are
    the ones it scanned then, with other nodes in place of nodes, so a scan would find what it found then. The
    node is created without arguments and given them through the ``args``/``kwargs`` setters, which keep the
    inputs and users as ``Node.__init__`` does. That the setters do all the bookkeeping but the scan is a property
    of fx's implementation, which is why this lives here. Only where ``g``'s module has no node-creation hooks
    (``has_node_creation_hooks``): they would see a node without arguments."""
    args = _fx.map_arg(node.args, arg_transform)
    kwargs = _fx.map_arg(node.kwargs, arg_transform)
    copied = g.create_node(node.op, node.target, name=node.name, type_expr=node.type)
    if args:
        copied.args = args
    if kwargs:
        copied.kwargs = kwargs
    copied.meta = dict(node.meta)
    return copied


__all__ += ["copy_node_checked_before", "has_node_creation_hooks", "has_replace_hooks"]


# --- what torch.compile and dynamo leave on objects -----------------------------------------------------------------


def compiled_inner_module(model: object) -> _torch.nn.Module | None:
    """The module a ``torch.compile`` wrapper (dynamo's ``OptimizedModule``) holds, in its private ``_orig_mod``;
    None for anything else."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, _torch.nn.Module) else None


def marked_as_parameter(example: object) -> bool:
    """Whether a dynamo graph input's example value stands for an ``nn.Parameter``: dynamo's fake tensors of
    parameters carry the private mark ``_is_param``."""
    return bool(getattr(example, "_is_param", False))


__all__ += ["compiled_inner_module", "marked_as_parameter"]


# --- torch's loggers: quiet for one thread, for one block --------------------------------------------------------


@contextlib.contextmanager
def quiet_logger_records(logger: logging.Logger, *, below: int, only_at_level: int | None = None) -> Iterator[None]:
    """Within the block, drop the records below level ``below`` that this thread logs to ``logger`` (a filter on
    the logger, removed on exit; other threads' records and the logger's level are untouched, so two threads
    quieting the same logger cannot undo each other). ``only_at_level``: drop them only while the logger's own level
    is this one (someone who set another level since wants to see them)."""
    thread = threading.get_ident()

    def keep(record: logging.LogRecord) -> bool:
        if record.thread != thread or record.levelno >= below:
            return True
        return only_at_level is not None and logger.level != only_at_level

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


__all__ += ["quiet_logger_records"]


# --- what torchtitan 0.3.0's graph trainer calls in torch ---------------------------------------------------------
_GRAPH_TRAINER_NEEDS = (("torch.compiler", "_patch_engine_backward"),
                        ("torch.optim", "swap_in_optimizer_params_and_state"))
"""torch APIs torchtitan 0.3.0's graph trainer (``make_fx_tracer``) calls while tracing a whole step: torch 2.13 and
2.14 have both, 2.12 neither (2.11 fails earlier, at torchtitan's model imports)."""


def graph_trainer_missing_apis() -> tuple[str, ...]:
    """The torch APIs torchtitan 0.3.0's graph trainer calls that this torch lacks (empty where it has them all)."""
    return tuple(f"{module}.{name}" for module, name in _GRAPH_TRAINER_NEEDS
                 if not hasattr(importlib.import_module(module), name))


__all__ += ["graph_trainer_missing_apis"]


# --- torch.profiler: the labels and the record a compiled graph leaves in a trace ---------------------------------

def profiler_active() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) session is recording in this process (torch
    keeps the flag in a private module global, set when a session starts and cleared when it stops)."""
    return bool(_torch.autograd.profiler._is_profiler_enabled)


def add_trace_metadata(key: str, value_json: str) -> None:
    """Put ``key: <value_json>`` at the top level of the Chrome trace the running profiler session exports (what
    ``profile.add_metadata_json`` does, without the ``profile`` object: the backend does not hold it)."""
    _torch.autograd._add_metadata_json(key, value_json)


__all__ += ["add_trace_metadata", "profiler_active"]


# --- the dispatcher: which operators a call runs -----------------------------------------------------------------

def dispatched_ops(fn: Callable[[], object]) -> tuple[str, ...]:
    """The aten operators ``fn()`` dispatches to, in order (``aten::_scaled_dot_product_flash_attention_for_cpu``
    for a CPU SDPA call): what a backend choice resolved to, read from the call itself rather than assumed. A
    dispatch mode (torch's is private) sees each operator below autograd; it is on only for this call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            seen.append(str(func._schema.name))
            return func(*args, **(kwargs or {}))

    with _Record():
        fn()
    return tuple(seen)


__all__ += ["dispatched_ops"]

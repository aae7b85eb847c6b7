"""Fake tensors and tracing under a fake mode: what the bucket merge (``overlapcfg.graph.stamp``) needs of torch's
private fake-tensor and dispatch machinery, in one place. Each piece here exists unchanged in torch 2.11 to 2.14.

Reached as ``overlapcfg.compat.<name>``, like the rest of ``overlapcfg.compat``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

import torch as _torch
from torch import fx as _fx
from torch._dispatch.python import enable_python_dispatcher as _enable_python_dispatcher
from torch._guards import detect_fake_mode as _detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx as _make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as _statically_known_true
from torch.utils import _pytree

from overlapcfg.errors import OverlapUsageError, UnsupportedGraphError

__all__ = [
    "detect_fake_mode",
    "fake_tensor",
    "meta_view_of_storage",
    "propagate_fake_values",
    "run_under_fake_mode",
    "size_hint",
    "statically_equal",
    "storage_id",
    "trace_with_fake_mode",
]

logger = logging.getLogger(__name__)


def detect_fake_mode(values: object) -> object | None:
    """The fake mode the fake tensors among ``values`` (any nesting) belong to, or None."""
    return _detect_fake_mode(values)


def trace_with_fake_mode(fn: Callable[..., object], inps: Sequence[object], mode: object) -> _fx.GraphModule:
    """``fn(*inps)`` traced into a graph of aten ops by ``make_fx``, on fake tensors of ``mode`` (those among
    ``inps`` belong to it): the trace the bucket merge stamps into a graph of the same capture.

    The trace runs inside ``mode`` on the fake tensors as given (``make_fx``'s "real" tracing: its ``fake`` mode
    would make fake copies of them), so factory ops in ``fn`` (``torch.empty``) make fake tensors of that mode,
    every value in the trace belongs to the caller's capture, and a traced view of an input shares that input's
    storage, as the stamped view of the graph's node must. Where a size is symbolic the trace
    is symbolic, under the Python dispatcher (as aot_autograd traces graphs with a shape environment); for static
    shapes it is off, which records the same nodes (``tests/graph/test_merge_speed_invariants.py`` compares them
    with upstream's merge) with less dispatch overhead. Unbacked symbols the trace creates are not left pending on the
    caller's shape environment (``ShapeEnv.ignore_fresh_unbacked_symbols``): they belong to the trace, which the
    caller's graph never has to account for. ``detach`` nodes, which ``make_fx`` may record after an op's outputs
    (there is no autograd in a merge), are dropped: their readers read the tensor itself."""
    if not isinstance(mode, _FakeTensorMode):
        raise OverlapUsageError(f"trace_with_fake_mode: expected a FakeTensorMode, got {type(mode).__name__}")
    symbolic = _has_symbolic_size(inps)
    shape_env = mode.shape_env
    if symbolic and shape_env is None:
        raise UnsupportedGraphError("overlapcfg merge: symbolic sizes without a shape environment on their fake mode")
    with contextlib.ExitStack() as scope:
        scope.enter_context(mode)
        if symbolic:
            scope.enter_context(_enable_python_dispatcher())
        if shape_env is not None:
            scope.enter_context(shape_env.ignore_fresh_unbacked_symbols())
        gm = _make_fx(fn)(*inps)
    _drop_detaches(gm.graph)
    return gm


def _has_symbolic_size(values: object) -> bool:
    for leaf in _pytree.tree_leaves(values):
        if isinstance(leaf, _torch.Tensor) and any(
                not isinstance(s, int) for s in (*leaf.shape, *leaf.stride(), leaf.storage_offset())):
            return True
    return False


def _drop_detaches(graph: _fx.Graph) -> None:
    """Remove ``aten.detach`` nodes: each reader reads the detached tensor itself (the trace has no autograd)."""
    for node in list(graph.find_nodes(op="call_function", target=_torch.ops.aten.detach.default)):
        source = node.args[0]
        if isinstance(source, _fx.Node):
            node.replace_all_uses_with(source)
            graph.erase_node(node)


def fake_tensor(mode: object, elem: _torch.Tensor, device: _torch.device) -> _torch.Tensor:
    """A fake tensor of ``mode`` on ``device`` whose shape, strides, offset, dtype and storage are those of the meta
    tensor ``elem``: what running an op under the mode would return, made without dispatching one (~10 us against
    ~1 ms)."""
    return _FakeTensor(mode, elem, device)


def storage_id(t: _torch.Tensor) -> int:
    """An identity for ``t``'s storage: equal for two tensors exactly when they share one."""
    return int(t.untyped_storage()._cdata)


def meta_view_of_storage(t: _torch.Tensor, dtype: _torch.dtype) -> _torch.Tensor:
    """A one-dimensional meta tensor of ``dtype`` over the whole storage of the fake tensor ``t``, from offset 0:
    views of it share ``t``'s storage."""
    storage = t.untyped_storage()
    numel = int(storage.nbytes()) // dtype.itemsize
    return _torch.empty(0, dtype=dtype, device="meta").set_(storage, 0, (numel,), (1,))


def propagate_fake_values(gm: _fx.GraphModule, inputs: Sequence[object]) -> dict[_fx.Node, object]:
    """Every node's value when ``gm`` runs on the fake tensors ``inputs`` under their mode; ``gm`` is not changed
    (unlike ``FakeTensorProp``, which writes them into its nodes)."""
    mode = _detect_fake_mode(inputs)
    interpreter = _fx.Interpreter(gm, garbage_collect_values=False)
    with mode if mode is not None else contextlib.nullcontext():
        interpreter.run(*inputs)
    return dict(interpreter.env)


def run_under_fake_mode(target: Callable[..., object], args: Sequence[object], kwargs: Mapping[str, object],
                        current: object) -> object | None:
    """``target(*args, **kwargs)`` on fake values under their mode; None where the op cannot run so (the caller
    keeps what it had)."""
    mode = _detect_fake_mode((current, args, kwargs))
    try:
        with mode if mode is not None else contextlib.nullcontext():
            return target(*args, **kwargs)
    except Exception:  # a node whose op fails on fake values keeps its value, as inductor's own repair does
        logger.debug("fake metadata of a reader left as it was: %s", target, exc_info=True)
        return None


def statically_equal(lhs: Sequence[object], rhs: Sequence[object]) -> bool:
    """Two sequences of sizes are equal for every value of their symbols (plain ints are simply compared)."""
    if len(lhs) != len(rhs):
        return False
    for a, b in zip(lhs, rhs, strict=True):
        if type(a) is int and type(b) is int:
            if a != b:
                return False
        elif not _statically_known_true(a == b):
            return False
    return True


def size_hint(size: object) -> int:
    """A size as an int: itself, or a symbolic size's hint (the value it had when traced). Sizes decide grouping
    only, never the traced shapes."""
    if type(size) is int:
        return size
    if isinstance(size, _torch.SymInt):
        hint = size.node.hint
        if hint is not None:
            return int(hint)
    raise UnsupportedGraphError(f"overlapcfg merge: the size {size!r} has no value to group collectives by")

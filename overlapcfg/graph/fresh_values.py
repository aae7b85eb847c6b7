"""Fake values for one more stamp of a kept trace (``overlapcfg.graph.stamp.splice`` with ``fresh=True``), laid on
storages of the stamp's own instead of computed again.

Stamped nodes of identical buckets would share the trace's fake tensors; that is harmless where the graph runs as it
is, but inductor tells buffers apart by storage, so each stamp for a compiler gets fake tensors of its own: the
trace's layouts (shape, strides, offset, dtype) are laid on new storages, and on the bucket's own inputs' storages
where the trace viewed an input. How to do that is worked out once per trace (a ``Recipe``, kept with the trace).
Building a fake tensor from a meta view costs ~10 us; running the op again under the fake mode costs ~1 ms
(``FakeTensorProp``, what this replaced). Where a layout cannot be copied (symbolic sizes, a value that requires
grad, inputs sharing a storage) the bucket's ops are re-run instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from overlapcfg import compat

__all__ = ["Recipe", "fresh_values", "recipe_of"]


@dataclass(frozen=True, slots=True)
class Recipe:
    """How to lay a trace's fake values on new storages (``fresh_values``), worked out once per trace.

    ``storages[k]``: ``("input", i)`` for storage ``k`` that is the trace's i-th input's, ``("new", nbytes)`` for
    one the trace allocated. ``tensors[j]``: the j-th distinct fake tensor as ``(storage, dtype, shape, strides,
    offset, device)``. ``nodes``: per traced node, the index of its one tensor, or its value's pytree spec with a
    tensor index or a constant per leaf."""

    storages: tuple[tuple[str, int], ...]
    tensors: tuple[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int, torch.device], ...]
    nodes: tuple[tuple[fx.Node, int | None, Any, tuple[int | _Constant, ...]], ...]


def recipe_of(gm: fx.GraphModule, placeholders: Sequence[fx.Node]) -> Recipe | None:
    """How to lay ``gm``'s fake values on new storages, worked out once per trace (the caller keeps it with the
    trace, ``overlapcfg.graph.traces.Trace``); None where a layout is not plain integers, a value requires grad, or
    the trace's inputs share a storage (then a storage does not say which input a view is of)."""
    return _make_recipe(gm, placeholders)


def _make_recipe(gm: fx.GraphModule, placeholders: Sequence[fx.Node]) -> Recipe | None:
    storage_index: dict[int, int] = {}
    storages: list[tuple[str, int]] = []
    for i, p in enumerate(placeholders):
        val = p.meta.get("val")
        if isinstance(val, torch.Tensor):
            key = compat.storage_id(val)
            if key in storage_index:
                return None
            storage_index[key] = len(storages)
            storages.append(("input", i))
    tensor_index: dict[int, int] = {}
    tensors: list[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int, torch.device]] = []
    nodes: list[tuple[fx.Node, int | None, Any, tuple[int | _Constant, ...]]] = []

    def index_of(t: torch.Tensor) -> int | None:
        if id(t) in tensor_index:
            return tensor_index[id(t)]
        nbytes = t.untyped_storage().nbytes()
        numbers = (*t.shape, *t.stride(), t.storage_offset(), nbytes)
        if t.requires_grad or not all(type(n) is int for n in numbers):
            return None
        key = compat.storage_id(t)
        if key not in storage_index:
            storage_index[key] = len(storages)
            storages.append(("new", nbytes))
        tensor_index[id(t)] = len(tensors)
        tensors.append((storage_index[key], t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()),
                        t.device))
        return tensor_index[id(t)]

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            index = index_of(val)
            if index is None:
                return None
            nodes.append((node, index, None, ()))
            continue
        leaves, spec = compat.tree_flatten(val)
        refs: list[int | _Constant] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                index = index_of(leaf)
                if index is None:
                    return None
                refs.append(index)
            else:
                refs.append(_Constant(leaf))
        nodes.append((node, None, spec, tuple(refs)))
    return Recipe(tuple(storages), tuple(tensors), tuple(nodes))


@dataclass(frozen=True, slots=True)
class _Constant:
    """A non-tensor leaf of a traced value (kept as it is)."""

    value: object


def fresh_values(gm: fx.GraphModule, recipe: Recipe | None, g_fn_inps: Sequence[fx.Node]) -> dict[fx.Node, object]:
    """Fake values for one more stamp of ``gm``: the trace's layouts on storages of this stamp's own (``recipe``,
    from ``recipe_of``; None: the ops are run again), one tensor object wherever the trace had one (a split's pieces
    and their ``getitem`` nodes)."""
    inputs = [n.meta.get("val") for n in g_fn_inps]
    mode = compat.detect_fake_mode(inputs)
    if recipe is None or mode is None or _inputs_share_a_storage(inputs):
        return _rerun(gm, g_fn_inps)
    # an "input" storage is a tensor input's (the recipe gives storage keys to tensors only)
    raw = [compat.meta_view_of_storage(inputs[ref], torch.uint8) if kind == "input"  # type: ignore[arg-type]
           else torch.empty(ref, dtype=torch.uint8, device="meta") for kind, ref in recipe.storages]
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    tensors: list[torch.Tensor] = []
    for storage, dtype, shape, stride, offset, device in recipe.tensors:
        base = typed.get((storage, dtype))
        if base is None:
            base = typed[(storage, dtype)] = raw[storage].view(dtype)
        tensors.append(compat.fake_tensor(mode, base.as_strided(shape, stride, offset), device))
    out: dict[fx.Node, object] = {}
    for node, single, spec, refs in recipe.nodes:
        if single is not None:
            out[node] = tensors[single]
        else:
            leaves = [r.value if isinstance(r, _Constant) else tensors[r] for r in refs]
            out[node] = compat.tree_unflatten(leaves, spec)
    return out


def _inputs_share_a_storage(inputs: Sequence[object]) -> bool:
    ids = [compat.storage_id(v) for v in inputs if isinstance(v, torch.Tensor)]
    return len(set(ids)) != len(ids)


def _rerun(gm: fx.GraphModule, g_fn_inps: Sequence[fx.Node]) -> dict[fx.Node, object]:
    """Fake values for a stamp by running the trace's ops on this bucket's inputs (the slow, general way)."""
    env = compat.propagate_fake_values(gm, compat.tree_leaves([n.meta.get("val") for n in g_fn_inps]))
    return {node: env[node] for node in gm.graph.nodes if node.op not in ("placeholder", "output") and node in env}

"""Attribution: which parameter an FSDP collective carries and which module owns it, whoever traced the graph.

Evidence, in this order (the first that speaks wins; later ones are checked against it where they also speak):

1. **aot descriptors** (``owner`` annotations stamped by ``annotate_owners``): an all-gather reads a forward
   placeholder whose ``meta["desc"]`` names a flat aot input; a reduce-scatter's result flows into a backward
   output whose ``meta["desc"]`` is the gradient of one. Descriptors of tensor subclasses (DTensor flattens into
   several flat inputs) are unwrapped to the ``PlainAOTInput`` they come from, whose ``idx`` indexes the *dynamo*
   graph's inputs, and dynamo's source for that input names the parameter. Only a backend sees the dynamo graph,
   so only the backend path has this evidence.
2. ``node.meta["custom"]["module_fqn"]`` (torchtitan's ``annotate_module_fqns`` writes it on every node).
3. ``nn_module_stack`` (forward nodes) / ``fwd_nn_module_stack`` (backward nodes): the innermost entry that is a
   module path. Any dynamo root is accepted (``L['self']``, ``L['args'][0]``, ``L['kwargs']['model']``, globals),
   and wrapper noise is removed: ``forward.__closure__[1].cell_contents.__self__`` (wrapped forwards),
   ``_orig_mod`` / ``_checkpoint_wrapped_module`` / ``_fsdp_wrapped_module``, and parametrization internals
   (``wq.parametrizations.weight.0`` is ``wq``). Entries that are not module paths, such as torchtitan's
   ``dict(type(L['self'].X).__dict__)['weight'].fget`` (which names the *first* module of a class, not this
   one), are skipped.

A user ``module_fqn_fn`` given to ``apply`` replaces all of this. Two sources that disagree about one collective
(neither module inside the other) are an ``AttributionError`` naming the node and both candidates: the pass never
picks one silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias, cast

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.errors import AttributionError
from overlapcfg.graph.gradients import partial_sum_root
from overlapcfg.graph.meta import CollectiveOwner, owner, saved_view, set_owner
from overlapcfg.graph.ops import collective_kind, wait_of
from overlapcfg.graph.parameters import placeholder_sources
from overlapcfg.module_paths import clean_path, is_inside, parameter_owner, user_fqn

__all__ = [
    "CollectiveOwner",
    "ModuleFqnFn",
    "annotate_owners",
    "custom_module_fqn",
    "dynamo_parameter_inputs",
    "module_fqn",
    "parameter_fqn",
    "stack_module_fqn",
]

ModuleFqnFn: TypeAlias = Callable[[fx.Node], "str | None"]
"""Maps a node to the FQN of the module it belongs to (``None``: unknown)."""

# --- evidence per node ------------------------------------------------------------------------------------------

def stack_module_fqn(node: fx.Node) -> str | None:
    """The innermost module-path entry of the node's module stack (forward or backward), cleaned; else None."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    for value in reversed(list(stack.values())):
        path = value[0] if isinstance(value, (tuple, list)) else value
        if not isinstance(path, str):
            continue
        fqn = clean_path(path)
        if fqn is not None:
            return fqn or None
    return None


def custom_module_fqn(node: fx.Node) -> str | None:
    """``node.meta["custom"]["module_fqn"]`` (torchtitan's annotation), cleaned; else None."""
    custom = node.meta.get("custom")
    value = custom.get("module_fqn") if isinstance(custom, Mapping) else None
    return user_fqn(value) or None if isinstance(value, str) else None


def module_fqn(node: fx.Node) -> str | None:
    """The owning module by the evidence order above (descriptor annotation, custom metadata, module stack)."""
    found = owner(node)
    if found is not None:
        return found.module_fqn
    return custom_module_fqn(node) or stack_module_fqn(node)


def check_agreement(node: fx.Node, chosen: str | None) -> None:
    """Raise ``AttributionError`` when the node's metadata names an owner unrelated to ``chosen``."""
    if chosen is None:
        return
    for label, other in (("meta['custom']['module_fqn']", custom_module_fqn(node)),):
        if other is not None and not (is_inside(other, chosen) or is_inside(chosen, other)):
            raise AttributionError(f"collective {node.name}: the aot descriptors attribute it to {chosen!r} but "
                                   f"{label} says {other!r}; pass module_fqn_fn= to apply to decide")


# --- descriptors ------------------------------------------------------------------------------------------------

def _input_root_index(desc: object) -> int | None:
    """The dynamo input index behind a flat aot input descriptor (subclass attributes unwrapped to their base)."""
    for _ in range(8):
        if isinstance(desc, compat.PlainAOTInput):
            return desc.idx
        desc = getattr(desc, "base", None)
        if desc is None:
            return None
    return None


def _grad_root_index(desc: object) -> int | None:
    """The dynamo input index whose gradient an aot output descriptor is (subclass attributes unwrapped)."""
    for _ in range(8):
        if isinstance(desc, compat.GradAOTOutput):
            return _input_root_index(desc.grad_of)
        desc = getattr(desc, "base", None)
        if desc is None:
            return None
    return None


def dynamo_parameter_inputs(dynamo_gm: fx.GraphModule) -> tuple[str | None, ...]:
    """Parameter FQN (cleaned) for each placeholder of the dynamo graph, ``None`` for inputs that are not
    parameters (the tokens, buffers, symbolic sizes, opaque objects such as a ``DeviceMesh`` a parametrization
    module holds: its source names ``parametrizations`` too, but it is no tensor)."""
    out: list[str | None] = []
    for node in dynamo_gm.graph.find_nodes(op="placeholder"):
        source = compat.dynamo_input_source(node)
        example = node.meta.get("example_value")
        is_param = source is not None and (example is None or isinstance(example, torch.Tensor)) and (
            "_parameters[" in source or "parametrizations" in source or _looks_like_parameter(node))
        out.append(clean_path(source) or None if is_param and source is not None else None)
    return tuple(out)


def _looks_like_parameter(node: fx.Node) -> bool:
    example = node.meta.get("example_value")
    return compat.marked_as_parameter(example) or type(example).__name__ == "Parameter"


def parameter_fqn(placeholder: fx.Node, parameter_inputs: Sequence[str | None]) -> str | None:
    desc = placeholder.meta.get("desc") or saved_view(placeholder)
    index = _input_root_index(desc)
    if index is None or not 0 <= index < len(parameter_inputs):
        return None
    return parameter_inputs[index]


def _single_placeholder_source(start: fx.Node) -> fx.Node | None:
    """The one placeholder an all-gather reads through non-compute ops (None if none or several)."""
    sources = placeholder_sources(start)
    return sources[0] if sources is not None and len(sources) == 1 else None


def _gradient_output_index(wait: fx.Node) -> tuple[int | None, bool]:
    """The dynamo input whose gradient ``wait`` is returned as, through single-user unary chains (casts, views),
    and whether it is one partial of a shared parameter's gradient: a parameter used by N >= 2 modules (tied or
    shared embeddings) gets one reduce-scatter per use, summed before it is returned (``gradients.partial_sum_
    root``)."""
    root = partial_sum_root(wait)
    cur = root if root is not None else wait
    for _ in range(32):
        users = list(cur.users)
        outputs = [u for u in users if u.op == "output"]
        if outputs:
            flat = list(cast("Sequence[fx.Node]", outputs[0].args[0]))  # the output node's one argument
            position = flat.index(cur)
            desc = outputs[0].meta.get("desc")
            index = _grad_root_index(desc[position]) if desc is not None and position < len(desc) else None
            return index, root is not None
        if len(users) != 1 or len(users[0].all_input_nodes) != 1:
            return None, False
        if collective_kind(users[0]) == "reduce_scatter":
            return None, False  # reduced again (FSDP + TP: the tp half of a weight's gradient): the last is FSDP's
        cur = users[0]
    return None, False


def annotate_owners(gm: fx.GraphModule, graph: str,
                    parameter_inputs: Sequence[str | None]) -> tuple[CollectiveOwner, ...]:
    """Stamp a ``CollectiveOwner`` on every all-gather / reduce-scatter (start and wait) that the aot descriptors
    tie to a parameter; return the records in graph order.

    Collectives the descriptors do not tie to a parameter (tensor-parallel activations, user collectives) are left
    unannotated: they are classified by ``overlapcfg.graph.collectives`` and left alone if not FSDP's.
    """
    records: list[CollectiveOwner] = []
    for node in gm.graph.nodes:
        kind = collective_kind(node) if node.op == "call_function" else None
        if kind not in ("all_gather", "reduce_scatter"):
            continue
        wait = wait_of(node)
        if wait is None:
            continue
        param: str | None = None
        partial = False
        if kind == "all_gather":
            placeholder = _single_placeholder_source(node)
            param = parameter_fqn(placeholder, parameter_inputs) if placeholder is not None else None
        else:
            index, partial = _gradient_output_index(wait)
            param = parameter_inputs[index] if index is not None and 0 <= index < len(parameter_inputs) else None
        if not param:
            continue
        found = CollectiveOwner(graph, node.name, kind, parameter_owner(param), param, wait.name)
        if not partial:  # a shared gradient's partial: metadata names its use, the one-owner rule its owner
            check_agreement(node, found.module_fqn)
        for n in (node, wait):
            set_owner(n, found)
        records.append(found)
    return tuple(records)

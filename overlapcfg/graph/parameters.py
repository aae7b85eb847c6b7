"""Which graph inputs are parameter shards: read from the graph, never from a node's name.

An FSDP all-gather gathers a parameter shard, a graph input, through ops that only move its elements (views,
casts, copies: ``overlapcfg.graph.ops.is_transparent``). Whether a gathered input *is* a parameter shard is a
question about the graph's inputs, and graphs answer it differently:

- **A whole-step graph or a forward graph** (graph_trainer's ``make_fx`` trace, aot's forward graph, any graph that
  holds the forward): every input is one of the step's own inputs (parameters, buffers, optimizer state, the
  batch); nothing saved by an earlier graph comes in. A floating input whose all-gathered value feeds compute is a
  parameter shard: the structure says so (evidence ``structure``).
- **aot's descriptors**, where the graph has them (``meta["desc"]``): an input rooted in a ``PlainAOTInput`` is one
  of the step's own inputs (``descriptor``); a tangent is not. In aot's *backward* graph the saved tensors carry no
  descriptor: a saved parameter view and a saved activation look alike there, so neither is confirmed.
- **The forward graph, for the backward** (``saved_view``): the backend marks backward inputs that the forward
  saved as views of a parameter input (``saved_parameter_views``, ``overlapcfg.graph.meta.saved_view``).
- **The tracer's state list** (``state``, optional): ``{placeholder name: parameter FQN}`` for the inputs the tracer
  fed from the model's state (torchtitan's ``TracedResult.state_fqns`` over its static inputs). Where given, an
  input it does not name is no parameter (a user input), and records name parameters by these FQNs.

An all-gather shaped like FSDP's (graph inputs through transparent ops, gathered value feeding compute) whose
inputs nothing confirms is *undecided*: ``undecided_reason`` says why, and the pass counts it as uncovered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.errors import OverlapConfigError
from overlapcfg.graph.meta import saved_view, set_saved_view
from overlapcfg.graph.ops import data_inputs, is_transparent

__all__ = [
    "InputEvidence",
    "ParameterEvidence",
    "graph_inputs",
    "is_parameter_placeholder",
    "mark_saved_parameter_views",
    "placeholder_sources",
    "saved_parameter_views",
    "state_input_names",
]

ParameterEvidence: TypeAlias = Literal["descriptor", "saved_view", "state", "structure"]

def placeholder_sources(start: fx.Node) -> tuple[fx.Node, ...] | None:
    """The placeholders an all-gather reads through transparent ops alone (views, casts, copies, a merged bucket's
    copy-in), in discovery order; ``None`` if any other op lies between (an activation gather: sequence or tensor
    parallel, or a gather of an embedding's *output*).

    One placeholder: an FSDP gather; two or more: a bucket torch's merge helpers (any bucket mode) already merged.
    The walk stops at placeholders and at the first non-transparent op, so it is linear in the copy-in region.
    """
    seen: set[fx.Node] = set()
    stack = list(data_inputs(start))
    found: list[fx.Node] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.append(node)
        elif node.op == "get_attr" or is_transparent(node):
            stack.extend(data_inputs(node))
        else:
            return None
    return tuple(found)


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def is_parameter_placeholder(node: fx.Node) -> bool:
    """An input aot's descriptors (or, in a backward graph, the forward's saved views) name as one of the step's own
    floating inputs: the descriptor evidence of ``InputEvidence``, for graphs that carry descriptors."""
    if node.op != "placeholder" or not _floating(node):
        return False
    if saved_view(node) is not None:
        return True
    desc = node.meta.get("desc")
    return desc is not None and compat.is_plain_input_descriptor(desc)


GraphInputs: TypeAlias = Literal["descriptors", "step_inputs", "saved_tensors"]


@dataclass(frozen=True, slots=True)
class InputEvidence:
    """What one graph says about its inputs (``graph_inputs`` reads it once per graph).

    ``kind``: ``descriptors`` (aot's; they decide), ``step_inputs`` (a whole-step or forward graph without them:
    every input is the step's own, the structure decides), ``saved_tensors`` (a backward graph without them: its
    inputs are saved tensors and tangents, nothing confirms a parameter).
    """

    kind: GraphInputs
    state: Mapping[str, str] | None = None
    """The tracer's ``{placeholder name: parameter FQN}``, if given."""
    backward: bool = False
    """The graph (or the forced direction) is a backward graph."""

    def verdict(self, node: fx.Node) -> ParameterEvidence | bool | None:
        """How ``node`` (a placeholder) is known to be a parameter shard (the evidence), ``False`` if it is known
        not to be one, ``None`` if the graph cannot tell. ``structure`` still needs the gather to feed compute."""
        if node.op != "placeholder" or not _floating(node):
            return False
        if saved_view(node) is not None:
            return "saved_view"
        if self.state is not None and not self.backward:
            return "state" if node.name in self.state else False
        desc = node.meta.get("desc")
        if desc is not None:
            return "descriptor" if compat.is_plain_input_descriptor(desc) else False
        if self.kind == "step_inputs":
            return "structure"
        return None

    def undecided_reason(self) -> str:
        """Why an FSDP-shaped all-gather of this graph's inputs could not be attributed: the real cause, and what
        resolves it."""
        if self.kind == "descriptors":
            return ("they read backward-graph inputs that carry no aot descriptor (tensors the forward saved): a "
                    "parameter view saved by the forward (FSDP + TP with reshard-after-forward) and a saved "
                    "activation look alike there; overlapcfg.backend sees the forward graph and buckets them")
        return ("they read inputs of a backward graph with no aot descriptors (saved tensors, not the step's own "
                "inputs), which cannot be told from saved activations; a whole-step graph (graph_kind='joint' or "
                "'auto'), aot's descriptors (overlapcfg.backend) or state_inputs= would decide them")


def graph_inputs(graph: fx.Graph, *, backward: bool, state: Mapping[str, str] | None = None) -> InputEvidence:
    """The input evidence of ``graph``. ``backward``: the graph is a split backward graph (forced direction, or
    every compute node tagged ``autograd_backward``); ``state``: the tracer's state list, if known."""
    placeholders = graph.find_nodes(op="placeholder")
    if any(n.meta.get("desc") is not None for n in placeholders):
        kind: GraphInputs = "descriptors"
    else:
        kind = "saved_tensors" if backward else "step_inputs"
    return InputEvidence(kind, state, backward)


def state_input_names(graph: fx.Graph, state_fqns: list[str] | tuple[str, ...],
                      flat_counts: list[int] | tuple[int, ...]) -> dict[str, str]:
    """``{placeholder name: parameter FQN}`` for a graph whose first inputs are the model's state, flattened: state
    entry ``i`` (``state_fqns[i]``) became ``flat_counts[i]`` placeholders (a DTensor: its local shard first, then
    its mesh), in order. What torchtitan's ``TracedResult`` records (``state_fqns``, ``input_subclass_layouts``).
    Buffers are named too; they are never gathered, so they never count."""
    if len(state_fqns) != len(flat_counts):
        raise OverlapConfigError(f"state_fqns has {len(state_fqns)} entries but flat_counts {len(flat_counts)}")
    placeholders = graph.find_nodes(op="placeholder")
    if sum(flat_counts) > len(placeholders):
        raise OverlapConfigError(
            f"the state flattens to {sum(flat_counts)} inputs but the graph has {len(placeholders)}")
    names: dict[str, str] = {}
    position = 0
    for fqn, count in zip(state_fqns, flat_counts, strict=True):
        names[placeholders[position].name] = fqn
        position += count
    return names


def saved_parameter_views(forward: fx.GraphModule) -> dict[str, object]:
    """Forward outputs saved for backward that are a parameter input seen through transparent ops only (the local
    shard of a 2-D DTensor parameter, viewed), by node name -> that input's aot descriptor.

    With reshard-after-forward on an FSDP + TP model, the backward re-gathers such a saved view instead of the
    parameter input itself; the backward graph alone cannot tell it from a saved activation (its placeholder has
    no descriptor), the forward graph can.
    """
    output = next((n for n in forward.graph.nodes if n.op == "output"), None)
    descs = output.meta.get("desc") if output is not None else None
    if output is None or not descs:
        return {}
    found: dict[str, object] = {}
    for node, desc in zip(cast("Sequence[object]", output.args[0]), descs, strict=False):
        if not isinstance(node, fx.Node) or not compat.is_saved_for_backward_descriptor(desc):
            continue
        if node.op == "placeholder":
            sources: tuple[fx.Node, ...] | None = (node,)
        elif is_transparent(node):
            sources = placeholder_sources(node)
        else:
            continue
        if sources is not None and len(sources) == 1 and is_parameter_placeholder(sources[0]) \
                and sources[0].meta.get("desc") is not None:
            found[node.name] = sources[0].meta["desc"]
    return found


def mark_saved_parameter_views(backward: fx.GraphModule, views: dict[str, object]) -> int:
    """Mark the backward placeholders ``saved_parameter_views`` names (same node name, no descriptor of their own)
    with the parameter input's descriptor (``overlapcfg.graph.meta.set_saved_view``); returns how many."""
    marked = 0
    for node in backward.graph.nodes:
        if node.op == "placeholder" and node.name in views and node.meta.get("desc") is None:
            set_saved_view(node, views[node.name])
            marked += 1
    return marked

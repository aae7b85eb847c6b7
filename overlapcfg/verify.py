"""Structural proof that a rewritten graph still computes what the original did, as far as collectives go.

``verify(before, after)`` checks, and on failure raises ``OverlapVerificationError`` naming the nodes:

- ``graph.lint()`` passes and every node's inputs come before it (a topological order);
- every collective start is waited exactly once (once per output for coalesced ones), after the start, and
  nothing but its waits reads the start;
- nothing reads an all-gather's output buffer between the start and its wait;
- the same parameters are all-gathered, per direction, and the same graph outputs are reduce-scattered.

``before`` may be a ``GraphModule`` or its ``summarize()``: taking the summary is cheap, copying a graph is not.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.errors import OverlapVerificationError
from overlapcfg.passes.collectives import data_inputs, positions, started_by

__all__ = ["GraphSummary", "summarize", "verify"]

_ANCESTOR_LIMIT = 64
"""An all-gather whose input has more computed ancestors than this is not a parameter gather (TP activations,
say); it is left out of the parameter comparison on both sides."""


@dataclass(frozen=True, slots=True)
class GraphSummary:
    """What must not change: parameters gathered (placeholder name, direction) and outputs reduce-scattered."""

    gathered: frozenset[tuple[str, str]]
    reduce_scattered: frozenset[int]


def _direction(node: fx.Node, forced: str | None) -> str:
    if forced is not None:
        return forced
    return "backward" if node.meta.get("autograd_backward", False) else "forward"


def _placeholder_ancestors(start: fx.Node) -> set[str] | None:
    found: set[str] = set()
    seen: set[fx.Node] = set()
    stack = list(data_inputs(start))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _ANCESTOR_LIMIT:
            return None
        if node.op == "placeholder":
            found.add(node.name)
        else:
            stack.extend(data_inputs(node))
    return found


def _collective_behind(node: object) -> fx.Node | None:
    """Walk back from a graph output through single-input nodes (views, getitem, casts) to a collective."""
    cur = node
    for _ in range(16):
        if not isinstance(cur, fx.Node) or cur.op != "call_function":
            return None
        start = started_by(cur)
        if start is not None:
            return start
        inputs = data_inputs(cur)
        if len(inputs) != 1:
            return None
        cur = inputs[0]
    return None


def summarize(gm: fx.GraphModule, *, direction: str | None = None) -> GraphSummary:
    """``direction``: "forward"/"backward" for aot_autograd's separate graphs, None to read node metadata."""
    gathered: set[tuple[str, str]] = set()
    for node in gm.graph.nodes:
        if compat.is_all_gather_into_tensor(node):
            phs = _placeholder_ancestors(node)
            if phs is not None:
                gathered.update((p, _direction(node, direction)) for p in phs)
    output = next(iter(gm.graph.find_nodes(op="output")), None)
    scattered: set[int] = set()
    if output is not None:
        outs = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
        for i, value in enumerate(outs):
            coll = _collective_behind(value)
            if coll is not None and _is_reduce_scatter(coll):
                scattered.add(i)
    return GraphSummary(frozenset(gathered), frozenset(scattered))


def _is_reduce_scatter(node: fx.Node) -> bool:
    return compat.is_reduce_scatter_tensor(node) or (
        node.op == "call_function" and "reduce_scatter_tensor_coalesced" in str(node.target)
    )


def _collective_starts(graph: fx.Graph) -> Iterable[fx.Node]:
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "_c10d_functional" and not compat.is_wait_tensor(node):
            yield node


def _check_waits(graph: fx.Graph, index: dict[fx.Node, int], problems: list[str]) -> None:
    waits_of: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        start = started_by(node)
        if start is not None:
            waits_of.setdefault(node.args[0] if compat.is_wait_tensor(node) else data_inputs(node)[0], []).append(node)
    for start in _collective_starts(graph):
        heads = [u for u in start.users if u.target is operator.getitem] or [start]
        for head in heads:
            waits = waits_of.get(head, [])
            if len(waits) != 1:
                problems.append(f"{head.name}: expected exactly one wait_tensor, found {len(waits)} "
                                f"({', '.join(w.name for w in waits) or 'none'})")
            # A reader is a user taking the tensor as data; a control_deps edge only orders, it does not read.
            readers = [u.name for u in head.users if u not in waits and head in data_inputs(u)]
            if readers:
                problems.append(f"{head.name}: read before its wait by {', '.join(readers)}")
            for w in waits:
                if index[w] < index[start]:
                    problems.append(f"{w.name}: waits on {start.name} before it is issued")
        out = start.kwargs.get("out")
        if isinstance(out, fx.Node):
            waits = [w for h in heads for w in waits_of.get(h, [])]
            done = min((index[w] for w in waits), default=index[start])
            early = [u.name for u in out.users if u is not start and u not in start.all_input_nodes
                     and index[start] < index[u] < done]
            if early:
                problems.append(f"{start.name}: output buffer {out.name} read before the wait by {', '.join(early)}")


def _check_order(graph: fx.Graph, index: dict[fx.Node, int], problems: list[str]) -> None:
    for node in graph.nodes:
        late = [i.name for i in node.all_input_nodes if index[i] >= index[node]]
        if late:
            problems.append(f"{node.name}: reads {', '.join(late)} before they are computed")


def verify(before: fx.GraphModule | GraphSummary, after: fx.GraphModule, *, direction: str | None = None,
           pass_name: str = "overlapcfg") -> None:
    """Raise ``OverlapVerificationError`` listing every broken invariant; return None if all hold.

    ``direction`` as for ``summarize``: pass it for a forward or backward graph (upstream's merged nodes do not
    keep the metadata that tells the two apart)."""
    problems: list[str] = []
    try:
        after.graph.lint()
    except Exception as err:  # lint raises RuntimeError/AssertionError with its own message
        problems.append(f"graph.lint(): {err}")
    index = positions(after.graph)
    _check_order(after.graph, index, problems)
    _check_waits(after.graph, index, problems)
    expected = before if isinstance(before, GraphSummary) else summarize(before, direction=direction)
    got = summarize(after, direction=direction)
    for param, where in sorted(expected.gathered - got.gathered):
        problems.append(f"parameter {param} is no longer all-gathered in {where}")
    for param, where in sorted(got.gathered - expected.gathered):
        problems.append(f"parameter {param} is now all-gathered in {where} but was not before")
    for i in sorted(expected.reduce_scattered - got.reduce_scattered):
        problems.append(f"graph output {i} is no longer reduce-scattered")
    for i in sorted(got.reduce_scattered - expected.reduce_scattered):
        problems.append(f"graph output {i} is now reduce-scattered but was not before")
    if problems:
        raise OverlapVerificationError(problems, pass_name=pass_name)

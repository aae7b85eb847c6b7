"""Structural proof that a rewritten graph still computes what the original did, as far as collectives go.

``verify(before, after)`` checks, and on failure raises ``OverlapVerificationError`` naming the nodes:

- ``graph.lint()`` passes and every node's inputs come before it (a topological order);
- every collective start is waited exactly once (once per output for coalesced ones), after the start, and
  nothing but its waits reads the start;
- nothing reads an all-gather's output buffer between the start and its wait;
- the same parameters are all-gathered, per direction, and each reduce-scattered graph output is still the
  gradient of the same node (through a merged bucket's slices).

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
from overlapcfg.graph.collectives import data_inputs, node_direction, parameter_sources, positions, started_by

__all__ = ["GraphSummary", "summarize", "verify"]


@dataclass(frozen=True, slots=True)
class GraphSummary:
    """What must not change: parameters gathered (placeholder name, direction), and for each graph output that
    is reduce-scattered, the node whose gradient it is (so two swapped gradients are caught, not only a lost one).
    """

    gathered: frozenset[tuple[str, str]]
    reduce_scattered: frozenset[tuple[int, str]]


def _collective_behind(node: object) -> tuple[fx.Node, int | None] | None:
    """Walk back from a graph output through single-input nodes (views, casts, getitem) to a collective.

    Returns the collective start and, when the path came through ``getitem(split, k)`` of a merged result, ``k``:
    which slice of the bucket this output is.
    """
    cur, piece = node, None
    for _ in range(16):
        if not isinstance(cur, fx.Node) or cur.op != "call_function":
            return None
        start = started_by(cur)
        if start is not None:
            return start, piece
        if cur.target is operator.getitem and isinstance(cur.args[1], int):
            piece = cur.args[1]
        inputs = data_inputs(cur)
        if len(inputs) != 1:
            return None
        cur = inputs[0]
    return None


def _through_views(node: object) -> object:
    """Skip view ops (reshape, flatten, t, ...): merging adds and removes them, the data behind them stays."""
    while isinstance(node, fx.Node) and node.op == "call_function" and getattr(node.target, "is_view", False):
        inputs = data_inputs(node)
        if len(inputs) != 1:
            break
        node = inputs[0]
    return node


def _gradient_source(start: fx.Node, piece: int | None) -> str:
    """The node a reduce-scatter reduces: for a merged bucket, the ``piece``-th input of its copy-in (torch's
    ``_pre_bucket_reduce_scatter``, a concatenation, or a coalesced collective's input list), seen through views
    on both sides so the merged and unmerged graphs name the same node."""
    source: object = start.args[0]
    if isinstance(source, (list, tuple)):  # coalesced: one input per output
        source = source[piece] if piece is not None and piece < len(source) else None
    else:
        source = _through_views(source)
        if piece is not None and isinstance(source, fx.Node) and source.args \
                and isinstance(source.args[0], (list, tuple)) and piece < len(source.args[0]):
            source = source.args[0][piece]
    source = _through_views(source)
    return source.name if isinstance(source, fx.Node) else repr(source)


def summarize(gm: fx.GraphModule, *, direction: str | None = None) -> GraphSummary:
    """``direction``: "forward"/"backward" for aot_autograd's separate graphs, None to read node metadata."""
    gathered: set[tuple[str, str]] = set()
    for node in gm.graph.nodes:
        if compat.is_all_gather_into_tensor(node):
            sources = parameter_sources(node)  # None: an activation gather, not ours to compare
            if sources is not None:
                gathered.update((p, direction or node_direction(node)) for p in sources)
    output = next(iter(gm.graph.find_nodes(op="output")), None)
    scattered: set[tuple[int, str]] = set()
    if output is not None:
        outs = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
        for i, value in enumerate(outs):
            found = _collective_behind(value)
            if found is not None and _is_reduce_scatter(found[0]):
                scattered.add((i, _gradient_source(*found)))
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
    for i, source in sorted(expected.reduce_scattered - got.reduce_scattered):
        problems.append(f"graph output {i} is no longer the reduce-scattered gradient of {source}")
    for i, source in sorted(got.reduce_scattered - expected.reduce_scattered):
        problems.append(f"graph output {i} is now the reduce-scattered gradient of {source}, which it was not")
    if problems:
        raise OverlapVerificationError(problems, pass_name=pass_name)

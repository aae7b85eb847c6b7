"""What a rewritten graph must satisfy on its own, before its contents are compared (``overlapcfg.graph.verify``):

- ``graph.lint()`` passes and every node's inputs come before it;
- every collective start (a ``control_deps``-wrapped one too) is waited exactly once (once per output for
  coalesced ones), after it is issued, and nothing but its wait reads a start;
- while a collective is in flight (start to last wait), nothing reads the storage it fills (its ``out=`` buffer,
  through any view of it) and nothing writes into that storage or into a storage it sends from. Storages and
  writes are ``overlapcfg.graph.memory``'s: an in-place op, an ``out=`` buffer, a view of either.

Each check is one walk over the graph.
"""

from __future__ import annotations

import operator

from torch import fx

from overlapcfg import compat
from overlapcfg.graph.collectives import data_inputs, is_collective_start, positions, started_by
from overlapcfg.graph.memory import Interpretation

__all__ = ["structure_faults"]


def structure_faults(graph: fx.Graph, memory: Interpretation) -> list[str]:
    """Every structural fault of ``graph`` (one line each, naming the nodes); ``memory`` is its interpretation."""
    problems: list[str] = []
    try:
        graph.lint()
    except Exception as err:  # lint raises RuntimeError/AssertionError with its own message
        problems.append(f"graph.lint(): {err}")
    index = positions(graph)
    _check_order(graph, index, problems)
    _check_waits(graph, index, problems)
    _check_in_flight(graph, memory, problems)
    return problems


def _check_waits(graph: fx.Graph, index: dict[fx.Node, int], problems: list[str]) -> None:
    waits_of: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        start = started_by(node)
        if start is not None:
            waits_of.setdefault(data_inputs(node)[0], []).append(node)
    for start in (n for n in graph.nodes if is_collective_start(n)):
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


def _check_in_flight(graph: fx.Graph, memory: Interpretation, problems: list[str]) -> None:
    """Between a collective's start and its (last) wait, nothing may read the storage it fills (its ``out=``
    buffer, through any view of it) and nothing may write into that storage or into a storage it sends from."""
    waits_left: dict[fx.Node, int] = {}
    for node in graph.nodes:
        start = started_by(node)
        if start is not None:
            waits_left[start] = waits_left.get(start, 0) + 1
    filling: dict[fx.Node, fx.Node] = {}  # storage (its allocating node) -> the start filling it
    sending: dict[fx.Node, dict[fx.Node, None]] = {}  # storage -> the starts sending from it
    held: dict[fx.Node, list[fx.Node]] = {}  # start -> the storages it fills or sends from, dropped at its last wait
    early: dict[fx.Node, list[str]] = {}
    for node in graph.nodes:
        start = started_by(node)
        if start is not None:
            waits_left[start] -= 1
            if not waits_left[start]:
                for storage in held.pop(start, ()):
                    if filling.get(storage) is start:
                        del filling[storage]
                    sending.get(storage, {}).pop(start, None)
            continue
        if filling:
            for read in data_inputs(node):
                by = filling.get(memory.root(read))  # type: ignore[arg-type]
                if by is not None and read is not by:  # reading the start itself is "read before its wait"
                    early.setdefault(by, []).append(node.name)
        for storage in memory.writes.get(node, ()):
            by = filling.get(storage) or next(iter(sending.get(storage, ())), None)
            if by is not None and by is not node:
                what = "output buffer" if storage in filling else "input"
                problems.append(f"{node.name}: writes into the {what} of {by.name} while it is in flight "
                                "(before its wait)")
        if is_collective_start(node) and waits_left.get(node):
            out = compat.unwrapped_call(node)[2].get("out")
            entries = held.setdefault(node, [])
            if isinstance(out, fx.Node) and memory.root(out) is not None:
                filling[memory.root(out)] = node  # type: ignore[index]
                entries.append(memory.root(out))  # type: ignore[arg-type]
            for read in data_inputs(node):
                storage = memory.root(read)
                if storage is not None:
                    sending.setdefault(storage, {})[node] = None
                    entries.append(storage)
    for start, readers in early.items():
        out = compat.unwrapped_call(start)[2].get("out")
        problems.append(f"{start.name}: output buffer {getattr(out, 'name', out)} read before the wait by "
                        f"{', '.join(readers)}")


def _check_order(graph: fx.Graph, index: dict[fx.Node, int], problems: list[str]) -> None:
    for node in graph.nodes:
        late = [i.name for i in node.all_input_nodes if index[i] >= index[node]]
        if late:
            problems.append(f"{node.name}: reads {', '.join(late)} before they are computed")

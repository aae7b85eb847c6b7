"""What a rewritten graph must satisfy on its own, before its contents are compared (``overlapcfg.graph.verify``):

- ``graph.lint()`` passes and every node's inputs come before it;
- every collective start (a ``control_deps``-wrapped one too) is waited exactly once (once per output for
  coalesced ones; more than once only where the graph before the pass did so, ``GraphSummary.waited_repeatedly``),
  after it is issued, and nothing but its waits read a start;
- while a collective is in flight (start to last wait), nothing reads the storage it fills (its ``out=`` buffer,
  through any view of it) and nothing writes into that storage or into a storage it sends from. Storages and
  writes are ``overlapcfg.graph.memory``'s: an in-place op, an ``out=`` buffer, a view of either.

Each check is one walk over the graph.
"""

from __future__ import annotations

import operator

from torch import fx

from overlapcfg import compat
from overlapcfg.graph.collectives import positions
from overlapcfg.graph.memory import Interpretation
from overlapcfg.graph.ops import data_inputs, is_collective_start, started_by

__all__ = ["structure_faults"]


def structure_faults(graph: fx.Graph, memory: Interpretation,
                     waited_repeatedly: tuple[tuple[str, int], ...] = ()) -> list[str]:
    """Every structural fault of ``graph`` (one line each, naming the nodes); ``memory`` is its interpretation;
    ``waited_repeatedly``: ``(collective result, waits)`` the graph before the pass waited more than once: up to
    that many waits stay allowed, no more."""
    problems: list[str] = []
    try:
        graph.lint()
    except Exception as err:  # lint raises RuntimeError/AssertionError with its own message
        problems.append(f"graph.lint(): {err}")
    index = positions(graph)
    waited = {node: start for node in graph.nodes if (start := started_by(node)) is not None}
    if problems:  # lint stops at the first input read before it is computed; a graph it passes has none
        _check_order(graph, index, problems)
    _check_waits(graph, index, waited, waited_repeatedly, problems)
    _check_in_flight(graph, memory, index, waited, problems)
    return problems


def _check_waits(graph: fx.Graph, index: dict[fx.Node, int], waited: dict[fx.Node, fx.Node],
                 waited_repeatedly: tuple[tuple[str, int], ...], problems: list[str]) -> None:
    allowed = dict(waited_repeatedly)
    waits_of: dict[fx.Node, list[fx.Node]] = {}
    for wait in waited:
        waits_of.setdefault(data_inputs(wait)[0], []).append(wait)
    for start in (n for n in graph.nodes if is_collective_start(n)):
        heads = [u for u in start.users if u.target is operator.getitem] or [start]
        for head in heads:
            waits = waits_of.get(head, [])
            most = allowed.get(head.name, 1)
            if not 1 <= len(waits) <= most:
                expected = ("exactly one wait_tensor" if most == 1
                            else f"at most {most} wait_tensors (as before the pass)")
                problems.append(f"{head.name}: expected {expected}, found {len(waits)} "
                                f"({', '.join(w.name for w in waits) or 'none'})")
            # A reader is a user taking the tensor as data; a control_deps edge only orders, it does not read. The
            # graph's output, where the tensor is waited, returns the finished tensor (``wait_tensor`` returns its
            # argument, and nothing runs after the output): torch 2.14's forward returns a tied weight's gather so,
            # saved for the backward. Any other reader could be scheduled before the wait, and is a fault.
            readers = [u.name for u in head.users if u not in waits and head in data_inputs(u)
                       and not (u.op == "output" and waits)]
            if readers:
                problems.append(f"{head.name}: read before its wait by {', '.join(readers)}")
            for w in waits:
                if index[w] < index[start]:
                    problems.append(f"{w.name}: waits on {start.name} before it is issued")


def _check_in_flight(graph: fx.Graph, memory: Interpretation, index: dict[fx.Node, int],
                     waited: dict[fx.Node, fx.Node], problems: list[str]) -> None:
    """Between a collective's start and its last wait, nothing may read the storage it fills (its ``out=`` buffer,
    through any view of it) and nothing may write into that storage or into a storage it sends from.

    Walked from the storages' side: each in-flight window is registered on the storages it fills and sends from,
    then only the aliases of filled storages (their users) and the writers are looked at."""
    last_wait: dict[fx.Node, int] = {}
    for wait, start in waited.items():
        last_wait[start] = max(last_wait.get(start, -1), index[wait])
    windows: dict[fx.Node, list[tuple[int, int, fx.Node, bool]]] = {}  # storage -> (start, end, by, fills)
    for start, end in last_wait.items():
        out = compat.unwrapped_call(start)[2].get("out")
        filled = memory.root(out) if isinstance(out, fx.Node) else None
        if filled is not None:
            windows.setdefault(filled, []).append((index[start], end, start, True))
        for read in data_inputs(start):
            sent = memory.root(read)
            if sent is not None and sent is not filled:
                windows.setdefault(sent, []).append((index[start], end, start, False))
    if not windows:
        return
    early: dict[fx.Node, dict[fx.Node, None]] = {}
    for node in graph.nodes:
        # root() of a node the interpretation saw is a node; None only for nodes it did not
        spans = windows.get(memory.root(node))  # type: ignore[arg-type]
        if not spans:
            continue
        for user in node.users:
            at = index[user]
            for begin, end, by, fills in spans:
                if fills and begin < at < end and node is not by and waited.get(user) is not by \
                        and node in data_inputs(user):  # reading the start itself is "read before its wait"
                    early.setdefault(by, {})[user] = None
    for writer, storages in memory.writes.items():
        at = index[writer]
        for storage in dict.fromkeys(storages):
            for begin, end, by, fills in windows.get(storage, ()):
                if begin < at < end:
                    what = "output buffer" if fills else "input"
                    problems.append(f"{writer.name}: writes into the {what} of {by.name} while it is in flight "
                                    "(before its wait)")
    for start, readers in sorted(early.items(), key=lambda item: index[item[0]]):
        out = compat.unwrapped_call(start)[2].get("out")
        names = ", ".join(r.name for r in sorted(readers, key=index.__getitem__))
        problems.append(f"{start.name}: output buffer {getattr(out, 'name', out)} read before the wait by {names}")


def _check_order(graph: fx.Graph, index: dict[fx.Node, int], problems: list[str]) -> None:
    for node in graph.nodes:
        late = [i.name for i in node.all_input_nodes if index[i] >= index[node]]
        if late:
            problems.append(f"{node.name}: reads {', '.join(late)} before they are computed")

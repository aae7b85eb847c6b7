"""What the verifier compares: a graph's content, summarized once (``summarize``), so that a pass can take the
summary of its input before rewriting it instead of copying the whole graph.

A ``GraphSummary`` holds, from one interpretation of the graph (``overlapcfg.graph.memory``), what each compute
node reads (``CallRecord``), the bytes each collective sends (``CollectiveData``), what each graph output holds and
what each written input is left holding. ``overlapcfg.graph.verify`` compares two of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx

from overlapcfg import compat
from overlapcfg.graph.byte_runs import Key
from overlapcfg.graph.memory import Interpretation, interpret
from overlapcfg.graph.ops import MODELLED_COLLECTIVES, data_inputs, group_name, node_direction
from overlapcfg.graph.provenance import Run, Value
from overlapcfg.kinds import CollectiveKind, Direction

__all__ = ["CallRecord", "CollectiveData", "GraphSummary", "summarize", "summarize_with_memory"]

_WAIT = compat.WAIT_TENSOR
_KIND_IDS = frozenset(id(target) for target in MODELLED_COLLECTIVES)
"""The collectives by identity (``MODELLED_COLLECTIVES`` keeps them alive): an op overload hashes in Python."""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """A compute node and its arguments as read (contents, ``provenance.Value``, in place of nodes), flattened into
    ``inputs`` only where two records differ, to say where: nearly all of a graph's ~6k compare equal whole."""

    name: str
    target: str
    args: tuple[object, ...]
    kwargs: dict[str, object]

    @property
    def inputs(self) -> tuple[tuple[str, object], ...]:
        """``(argument path, content)``: ``("args[1]", Value(...))``; a constant stands for itself (or its repr)."""
        out = _leaves(self.args, "args", [])
        return tuple(_leaves(self.kwargs, "kwargs", out) if self.kwargs else out)

    def reads_as(self, other: CallRecord) -> bool:
        """``inputs`` equal. Compared whole first; a constant whose ``==`` gives no truth value (a tensor) sends it
        to the leaf-by-leaf comparison."""
        try:
            if self.args == other.args and self.kwargs == other.kwargs:
                return True
        except (RuntimeError, TypeError, ValueError):
            pass
        return self.inputs == other.inputs


@dataclass(frozen=True, slots=True)
class CollectiveData:
    """The bytes one collective sends, canonical (runs grouped by source key, merged where contiguous)."""

    start: str
    kind: CollectiveKind
    direction: Direction
    attrs: tuple[object, ...]
    """(group, size) for all-gathers; (group, size, reduce op, dtype) for reduce-scatters; (group, op, dtype)."""
    data: tuple[Run, ...]


@dataclass(frozen=True, slots=True)
class GraphSummary:
    """What a bucketing pass must not change (see the module docstring): compute nodes and their inputs' contents
    as read, the graph outputs' contents, what the graph leaves in the inputs it writes, the inputs' order and the
    data every collective sends."""

    calls: tuple[CallRecord, ...]
    outputs: tuple[tuple[str, object], ...]
    collectives: tuple[CollectiveData, ...]
    inputs: tuple[str, ...] = ()
    """Graph input names by position."""
    written_inputs: tuple[tuple[int, str, object], ...] = ()
    """``(position, name, content at the end)`` of every input the graph writes into."""
    waited_repeatedly: tuple[tuple[str, int], ...] = ()
    """``(collective result, waits)`` for each result (a start, or a coalesced start's ``getitem``) the graph waits
    more than once, by name. A tracer's CSE of two equal collectives leaves one wait per use (GPT-NeoX's and Phi's
    parallel blocks); ``wait_tensor`` returns its argument, so the graph is sound, and a pass may keep or fold such
    waits but not add any (``overlapcfg.graph.well_formed``)."""


def _freeze(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _leaves(obj: object, path: str, out: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Argument paths and what they hold, appended to ``out``: contents (as read) for tensors, the constant itself
    otherwise."""
    if isinstance(obj, Value) or obj is None:
        out.append((path, obj))
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _leaves(item, f"{path}[{i}]", out)
    elif isinstance(obj, dict):
        for k, item in obj.items():
            _leaves(item, f"{path}[{k!r}]", out)
    else:
        out.append((path, _freeze(obj)))
    return out


_TARGET_NAMES: dict[int, tuple[object, str]] = {}
"""Target identity -> (target, name), as ``memory._PLANS``: an op overload's ``str`` is built on every call."""


def _target_name(target: object) -> str:
    cached = _TARGET_NAMES.get(id(target))
    if cached is not None and cached[0] is target:
        return cached[1]
    name = str(target) if compat.is_op_overload(target) else compat.op_name(target)
    _TARGET_NAMES[id(target)] = (target, name)
    return name


def _canonical(values: Iterable[object]) -> tuple[Run, ...]:
    by_key: dict[Key, list[tuple[int, int]]] = {}
    for value in values:
        if isinstance(value, Value):
            for key, start, n in value.runs:
                by_key.setdefault(key, []).append((start, n))
    out: list[Run] = []
    for key, spans in by_key.items():
        spans.sort()
        lo, n = spans[0]
        for s, m in spans[1:]:
            if s == lo + n:
                n += m
            else:
                out.append((key, lo, n))
                lo, n = s, m
        out.append((key, lo, n))
    return tuple(out)


def _collective(node: fx.Node, target: object, args: tuple[object, ...],
                direction: Direction | None) -> CollectiveData:
    """``args``: the collective's arguments as read (its inputs' contents at its start)."""
    kind = MODELLED_COLLECTIVES[target]
    values = list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
    dtype = next((v.dtype for v in values if isinstance(v, Value)), None)
    group = group_name(node)
    if kind == "all_gather":
        attrs: tuple[object, ...] = (group, args[1])
    elif kind == "reduce_scatter":
        attrs = (group, args[2], args[1], dtype)
    else:
        attrs = (group, args[1], dtype)
    where: Direction = "backward" if kind == "reduce_scatter" else direction or node_direction(node)
    return CollectiveData(node.name, kind, where, tuple(_freeze(a) for a in attrs), _canonical(values))


def summarize_with_memory(gm: fx.GraphModule, direction: Direction | None) -> tuple[GraphSummary, Interpretation]:
    calls: list[CallRecord] = []
    collectives: list[CollectiveData] = []
    outputs: list[tuple[str, object]] = []
    waits: dict[fx.Node, int] = {}

    def visit(node: fx.Node, target: object, args: tuple[object, ...], kwargs: dict[str, object],
              opaque: bool) -> None:
        if node.op == "output":
            outs = args[0]
            if isinstance(outs, (list, tuple)):
                for i, o in enumerate(outs):
                    _leaves(o, str(i), outputs)
            else:
                _leaves(outs, "0", outputs)
        elif id(target) in _KIND_IDS:
            collectives.append(_collective(node, target, args, direction))
        elif target is _WAIT:
            head = data_inputs(node)[0]
            waits[head] = waits.get(head, 0) + 1
        elif opaque:
            calls.append(CallRecord(node.name, _target_name(target), args, kwargs))

    interpretation = interpret(gm.graph, visit)
    written = tuple((i, name, content) for i, (name, content) in sorted(interpretation.final_inputs().items()))
    summary = GraphSummary(tuple(calls), tuple(outputs), tuple(collectives),
                           tuple(p.name for p in interpretation.inputs), written,
                           tuple((head.name, n) for head, n in waits.items() if n > 1))
    return summary, interpretation


def summarize(gm: fx.GraphModule, *, direction: Direction | None = None) -> GraphSummary:
    """``direction``: "forward"/"backward" for aot_autograd's separate graphs, None to read node metadata
    (it only words messages: "parameter p is no longer all-gathered in forward")."""
    return summarize_with_memory(gm, direction)[0]

"""Proof that a bucketing/reordering pass changed nothing but how FSDP collectives are grouped and ordered.

``verify(before, after)`` raises ``OverlapVerificationError`` listing every fault, each naming the node,
parameter or gradient involved; it returns None when all of these hold:

- **structure** (``overlapcfg.graph.well_formed``): lint, inputs before readers, one wait per collective after
  its start, nothing reading a collective's result before its wait, and nothing reading what a collective fills or
  writing what it fills or sends while it is in flight;
- **what every consumer reads**: each compute node (anything ``provenance`` does not interpret) is still there,
  runs the same op, and reads, input by input, exactly the bytes it read before, *at the moment it runs*: the same
  shape and dtype, made of the same parameter's or gradient's elements, cast the same way, through collectives
  with the same group, group size and reduce op (``overlapcfg.graph.provenance``), after the same in-place writes
  (``overlapcfg.graph.memory``: ``copy_``, ops whose schema marks an argument written, ``out=`` buffers). So a
  merged all-gather must hand each consumer its own parameter's slice, a reader may not move past a write to what
  it reads (nor a write before a reader), and each reduce-scattered graph output must be its gradient's slice of
  a merged reduce-scatter. No compute node may appear (a ``mul`` on a parameter before its gather is one);
- **each graph output** holds what it held before (reported as "graph output i is now the reduce-scattered
  gradient of X" for swapped gradients);
- **graph inputs**, identified by position (callers pass them so): the same names in the same places, and every
  input the graph writes (an optimizer step, a buffer update) is left holding what it was left holding before;
- **collective data, counted**: the bytes every all-gather, reduce-scatter and all-reduce sends, by (group,
  size[, op, dtype]), are the same multiset before and after: merged buckets are allowed, a dropped, duplicated
  or regrouped collective is not.

What may change, and is therefore not compared: copy-in and copy-out ops (``_pre_bucket_*``, ``cat``, ``copy_``
into bucket buffers, ``split``, slices, views, ``empty``), the collective and wait nodes themselves, node order
(within topological order, the wait rules and the writes above) and ``control_deps`` wrappers.

``before`` may be a ``GraphModule`` or its ``summarize()``: taking the summary is cheap, copying a graph is not.
Cost is linear in graph size (one interpretation pass per graph, one walk per structure check).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterable
from typing import TypeAlias, TypeGuard

from torch import fx

from overlapcfg.errors import OverlapVerificationError
from overlapcfg.graph.byte_runs import Key
from overlapcfg.graph.provenance import Value, describe, leaf_name, render_key
from overlapcfg.graph.summary import CallRecord, CollectiveData, GraphSummary, summarize, summarize_with_memory
from overlapcfg.graph.well_formed import structure_faults
from overlapcfg.kinds import Direction

__all__ = ["CallRecord", "CollectiveData", "GraphSummary", "summarize", "verify"]

# --- contents ----------------------------------------------------------------------------------------------------

_NOUN = {"all_gather": ("parameter", "all-gathered"), "reduce_scatter": ("gradient", "reduce-scattered"),
         "all_reduce": ("tensor", "all-reduced")}


Span: TypeAlias = tuple[tuple[object, ...], Key, int, int]
"""``(collective attributes, byte-run key, offset, bytes)``: one span of data a collective sends, for counting."""


def _attrs_text(kind: str, attrs: tuple[object, ...]) -> str:
    if kind == "all_gather":
        return f"group {attrs[0]!r} of {attrs[1]}"
    if kind == "reduce_scatter":
        return f"group {attrs[0]!r} of {attrs[1]}, op {attrs[2]}, {str(attrs[3]).removeprefix('torch.')}"
    return f"group {attrs[0]!r}, op {attrs[1]}, {str(attrs[2]).removeprefix('torch.')}"


def _coverage(spans: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(start, nbytes, times covered)`` segments of a list of possibly overlapping ``(start, nbytes)`` spans."""
    events: dict[int, int] = {}
    for start, n in spans:
        events[start] = events.get(start, 0) + 1
        events[start + n] = events.get(start + n, 0) - 1
    out: list[tuple[int, int, int]] = []
    depth, prev = 0, 0
    for pos in sorted(events):
        if depth and pos > prev:
            if out and out[-1][2] == depth and out[-1][0] + out[-1][1] == prev:
                out[-1] = (out[-1][0], out[-1][1] + pos - prev, depth)
            else:
                out.append((prev, pos - prev, depth))
        depth += events[pos]
        prev = pos
    return out


def _by_leaf(collectives: Iterable[CollectiveData]) -> dict[tuple[str, str], tuple[Counter[Span], list[str],
                                                                                 dict[str, None]]]:
    """(kind, source node) -> (how often each byte range is sent, by which collective starts, directions).

    Counting covered bytes rather than spans makes a merged bucket (one span per rank row) equal to the
    collectives it replaced, and a duplicated one (every byte sent twice) differ from them."""
    spans: dict[tuple[str, str], dict[tuple[tuple[object, ...], Key], list[tuple[int, int]]]] = {}
    out: dict[tuple[str, str], tuple[Counter[Span], list[str], dict[str, None]]] = {}
    for c in collectives:
        for key, start, n in c.data:
            leaf: tuple[str, str] = (c.kind, leaf_name(key))
            spans.setdefault(leaf, {}).setdefault((c.attrs, key), []).append((start, n))
            _, starts, where = out.setdefault(leaf, (Counter(), [], {}))
            if c.start not in starts:
                starts.append(c.start)
            where.setdefault(c.direction)
    for leaf, by_key in spans.items():
        counter = out[leaf][0]
        for (attrs, key), key_spans in by_key.items():
            for start, n, times in _coverage(key_spans):
                counter[(attrs, key, start, n)] += times
    return out


def _attrs_list(kind: str, counter: Counter[Span]) -> str:
    return "; ".join(_attrs_text(kind, a) for a in dict.fromkeys(a for a, *_ in counter))


def _compare_collectives(before: GraphSummary, after: GraphSummary, problems: list[str]) -> None:
    old, new = _by_leaf(before.collectives), _by_leaf(after.collectives)
    for kind, leaf in [*old, *(k for k in new if k not in old)]:
        was, _, where = old.get((kind, leaf), (Counter(), [], {}))
        now, now_starts, now_where = new.get((kind, leaf), (Counter(), [], {}))
        if was == now:
            continue
        noun, verb = _NOUN[kind]
        places = "/".join(where or now_where)
        by = ", ".join(now_starts)
        if not now:
            problems.append(f"{noun} {leaf} is no longer {verb} in {places}")
        elif not was:
            problems.append(f"{noun} {leaf} is now {verb} in {places} but was not before (by {by})")
        elif {a for a, *_ in was} != {a for a, *_ in now}:
            problems.append(f"{noun} {leaf}: {verb} in {_attrs_list(kind, now)} by {by}, "
                            f"was {_attrs_list(kind, was)}")
        elif _keys_text(was) == _keys_text(now) and max(was.values()) != max(now.values()):
            problems.append(f"{noun} {leaf} is {verb} {max(now.values())} times in {places} (by {by}), "
                            f"was {max(was.values())}")
        else:
            keys, keys_was = _keys_text(now), _keys_text(was)
            what = f"as {keys}, was {keys_was}" if keys != keys_was else \
                f"(offset, bytes, times) {_spans(now)}, was {_spans(was)}"
            problems.append(f"{noun} {leaf}: other data is {verb} in {places} (by {by}): {what}")


def _keys_text(counter: Counter[Span]) -> str:
    return " + ".join(dict.fromkeys(render_key(k) for _, k, _, _ in counter))


def _spans(counter: Counter[Span]) -> list[tuple[int, int, int]]:
    return sorted((s, n, times) for (_, _, s, n), times in counter.items())


def _is_scattered(content: object) -> TypeGuard[Value]:
    return isinstance(content, Value) and bool(content.runs) and all(k[0] == "rs" for k, _, _ in content.runs)


def _compare_outputs(before: GraphSummary, after: GraphSummary, problems: list[str]) -> None:
    if len(before.outputs) != len(after.outputs):
        problems.append(f"the graph has {len(after.outputs)} outputs, had {len(before.outputs)}")
    for (label, was), (_, now) in zip(before.outputs, after.outputs, strict=False):
        if was == now:
            continue
        if _is_scattered(was):
            grad = leaf_name(was.runs[0][0])
            if _is_scattered(now) and leaf_name(now.runs[0][0]) != grad:
                problems.append(f"graph output {label} is now the reduce-scattered gradient of "
                                f"{leaf_name(now.runs[0][0])}, which it was not (it was {grad}'s)")
                continue
            if not _is_scattered(now):
                problems.append(f"graph output {label} is no longer the reduce-scattered gradient of {grad}: "
                                f"it is {_text(now)}")
                continue
        problems.append(f"graph output {label} is {_text(now)}, was {_text(was)}")


def _text(content: object) -> str:
    return describe(content) if isinstance(content, (Value, tuple)) else repr(content)


def _compare_inputs(before: GraphSummary, after: GraphSummary, problems: list[str]) -> None:
    """Inputs are passed by position: the same names in another order hand each input what another received. And
    what the graph leaves in the inputs it writes (an optimizer step, a buffer update) is part of its result."""
    if len(before.inputs) != len(after.inputs):
        problems.append(f"the graph takes {len(after.inputs)} inputs, took {len(before.inputs)}")
    was_at = {name: i for i, name in enumerate(before.inputs)}
    for i, name in enumerate(after.inputs):
        j = was_at.get(name)
        if j is not None and j != i:
            problems.append(f"graph input {name} is now input {i}, was input {j}: inputs are passed by position, so "
                            f"it receives what {before.inputs[i] if i < len(before.inputs) else 'nothing'} did")
    was = {i: (name, content) for i, name, content in before.written_inputs}
    now = {i: (name, content) for i, name, content in after.written_inputs}
    for i in sorted(was.keys() | now.keys()):
        name = (now.get(i) or was[i])[0]
        if i not in now:
            problems.append(f"graph input {i} ({name}) is no longer written; the graph used to leave "
                            f"{_text(was[i][1])} in it")
        elif i not in was:
            problems.append(f"graph input {i} ({name}) is now written: the graph leaves {_text(now[i][1])} in it")
        elif was[i][1] != now[i][1]:
            problems.append(f"graph input {i} ({name}) is left holding {_text(now[i][1])}; before it was left "
                            f"holding {_text(was[i][1])}")


def _compare_calls(before: GraphSummary, after: GraphSummary, problems: list[str]) -> None:
    old = {c.name: c for c in before.calls}
    new = {c.name: c for c in after.calls}
    for name, was in old.items():
        now = new.get(name)
        if now is None:
            problems.append(f"{name} ({was.target}) is gone: a bucketing pass may only replace collectives and "
                            "their copies")
        elif now.target != was.target:
            problems.append(f"{name}: runs {now.target}, ran {was.target}")
        elif not now.reads_as(was):
            olds = dict(was.inputs)
            for path, content in now.inputs:
                if path not in olds:
                    problems.append(f"{name} ({now.target}) {path}: a new input, {_text(content)}")
                elif olds[path] != content:
                    problems.append(f"{name} ({now.target}) {path}: reads {_text(content)}; "
                                    f"before it read {_text(olds[path])}")
            for path in dict(was.inputs).keys() - dict(now.inputs).keys():
                problems.append(f"{name} ({now.target}) {path}: no longer read")
    for name, now in new.items():
        if name not in old:
            problems.append(f"{name} ({now.target}) is new: bucketing adds only copies, views and collectives")


def _without_regathers(summary: GraphSummary, names: frozenset[str], problems: list[str]) -> GraphSummary:
    """``summary`` less the named backward all-gathers (see ``verify``); a name that is not one is a problem."""
    found = {c.start: c for c in summary.collectives if c.start in names}
    for name in sorted(names):
        c = found.get(name)
        if c is None or c.kind != "all_gather" or c.direction != "backward":
            what = "no collective" if c is None else f"a {c.direction} {c.kind}"
            problems.append(f"{name}: reported as a removed backward re-gather, but before the pass it was {what}")
    return dataclasses.replace(summary, collectives=tuple(c for c in summary.collectives if c.start not in found))


def verify(before: fx.GraphModule | GraphSummary, after: fx.GraphModule, *, direction: Direction | None = None,
           pass_name: str = "overlapcfg", reused_regathers: Collection[str] = ()) -> None:
    """Raise ``OverlapVerificationError`` listing every broken invariant; return None if all hold.

    ``direction`` as for ``summarize``: pass it for a forward or backward graph (upstream's merged nodes do not
    keep the metadata that tells the two apart).

    ``reused_regathers``: start nodes of ``before``'s backward all-gathers that a pass removed because their readers
    now read the forward's gathered value of the same elements (per-bucket ``reshard_after_forward: false`` on a
    whole-step graph, ``overlapcfg.passes.keep_unsharded``). They are not expected in ``after``; nothing else is
    relaxed: each must be a backward all-gather of ``before``, every reader must still read the same elements
    (now through a forward gather), and every other collective must send the same data."""
    expected = before if isinstance(before, GraphSummary) else summarize(before, direction=direction)
    got, memory = summarize_with_memory(after, direction)
    problems = structure_faults(after.graph, memory, expected.waited_repeatedly)
    if reused_regathers:
        expected = _without_regathers(expected, frozenset(reused_regathers), problems)
    _compare_inputs(expected, got, problems)
    _compare_collectives(expected, got, problems)
    _compare_outputs(expected, got, problems)
    _compare_calls(expected, got, problems)
    if problems:
        raise OverlapVerificationError(problems, pass_name=pass_name)

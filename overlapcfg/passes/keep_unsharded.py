"""Per-bucket ``reshard_after_forward: false`` on whole-step graphs: the backward reads the forward's gathered
parameters instead of gathering them again.

A whole-step graph traced with resharding (torchtitan's graph trainer with ``fsdp_reshard_after_forward=always``,
or any rematerialization of the parameter gathers) all-gathers each parameter twice: once in forward, and again
in backward (a recomputed re-gather), so that the unsharded parameter need not live from its forward use to its
backward use. A bucket marked ``reshard_after_forward: false`` trades that memory for communication, as FSDP2's
flag does (torchtitan's eager FSDP keeps the last block unsharded for the same reason: its backward starts at
once)::

    before                                            after (bucket layers.1 kept)
    ag_f = all_gather(w)   # forward                  ag_f = all_gather(w)
    w_f  = wait(ag_f)                                 w_f  = wait(ag_f)
    y    = mm(x, t(w_f))                              y    = mm(x, t(w_f))
    ...                                               ...
    ag_b = all_gather(w)   # backward re-gather       (gone)
    w_b  = wait(ag_b)
    dx   = mm(dy, w_b)                                dx   = mm(dy, w_f)    # w_f held from forward to here

Which forward value replaces a re-gather is decided by dataflow, never by names: the element provenance of the
two waits (``overlapcfg.graph.provenance``: the same shard bytes, cast the same way, gathered over the same group
and size) must be equal, and nothing may write the shard between the two gathers or the forward's gathered value
before the last backward reader (checked from op schemas). Where no forward gather qualifies, the re-gather stays
and the record says why. The verifier accepts exactly this change: the removed re-gathers are named to it, every
consumer must still read the same elements, and every other collective must send the same data
(``overlapcfg.graph.verify``, ``reused_regathers``).

The memory held is reported per bucket (``BucketRecord.held_bytes``): the unsharded bytes of the parameters whose
gathered value now lives from its forward gather to its last backward use instead of being freed after forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import fx

from overlapcfg.config import OverlapConfig
from overlapcfg.config.plan import Bucket
from overlapcfg.graph.collectives import Collective, positions
from overlapcfg.graph.memory import interpret
from overlapcfg.graph.ops import may_alias_input, written_inputs
from overlapcfg.graph.parameters import placeholder_sources
from overlapcfg.resolve import ResolvedPlan

__all__ = ["Kept", "KeepResult", "Unkept", "UnkeptWhy", "keep_unsharded", "reshard_setting"]


@dataclass(frozen=True, slots=True)
class Kept:
    """One bucket whose backward now reads forward-gathered parameters."""

    bucket: int
    regathers: tuple[str, ...]
    """Start nodes of the backward re-gathers removed."""
    params: tuple[str, ...]
    held_bytes: int
    """Unsharded bytes held from forward to backward (what the removed re-gathers brought in)."""


UnkeptWhy = Literal["separate_graph", "not_traced", "ranks", "already_kept", "kept_regathers"]
"""Why a ``reshard_after_forward`` setting did not act (``overlapcfg.passes.notes.unkept_settings`` words each)."""


@dataclass(frozen=True, slots=True)
class Unkept:
    """A plan entry's ``reshard_after_forward`` that did not act on a bucket, or not on all its re-gathers."""

    entry: int
    """The plan entry that sets it (``plan.buckets[entry]``)."""
    bucket: str
    setting: bool | int
    why: UnkeptWhy
    detail: tuple[str, ...] = ()
    """``separate_graph``: the graph's direction; ``kept_regathers``: each re-gather kept, with why."""


@dataclass(frozen=True, slots=True)
class KeepResult:
    kept: tuple[Kept, ...] = ()
    unkept: tuple[Unkept, ...] = ()

    @property
    def removed(self) -> frozenset[str]:
        """Start node names of every removed re-gather (what the verifier is told)."""
        return frozenset(name for k in self.kept for name in k.regathers)

    def held_bytes(self, bucket: int) -> int:
        return sum(k.held_bytes for k in self.kept if k.bucket == bucket)


def reshard_setting(cfg: OverlapConfig, plan: ResolvedPlan, bucket: int) -> bool | int | None:
    """The ``reshard_after_forward`` the plan entry behind resolved bucket ``bucket`` sets (None: not set)."""
    entries = cfg.plan.buckets if cfg.plan is not None else ()
    index = plan.buckets[bucket].entry_index
    entry = entries[index] if index < len(entries) else None
    return entry.reshard_after_forward if isinstance(entry, Bucket) else None


def keep_unsharded(gm: fx.GraphModule, cfg: OverlapConfig, plan: ResolvedPlan,
                   covered: Sequence[tuple[int, Collective]], *, forced: str | None) -> KeepResult:
    """Replace the backward re-gathers of every bucket whose plan entry sets ``reshard_after_forward: false`` by
    the forward's gathered values (module docstring); say where a setting cannot act (``KeepResult.unkept``,
    worded by ``overlapcfg.passes.notes``). Mutates ``gm.graph`` (``apply`` restores it if anything after fails)."""
    settings = {i: s for i in range(len(plan.buckets)) if (s := reshard_setting(cfg, plan, i)) is not None}
    if not settings:
        return KeepResult()
    unkept: list[Unkept] = []
    if forced is not None:
        return KeepResult(unkept=tuple(Unkept(plan.buckets[i].entry_index, plan.buckets[i].name, s, "separate_graph",
                                              (forced,)) for i, s in settings.items()))
    regathers = {i: [c for b, c in covered if b == i and c.kind == "all_gather" and c.direction == "backward"]
                 for i in settings}
    wanted: list[int] = []
    for i, setting in settings.items():
        entry, name = plan.buckets[i].entry_index, plan.buckets[i].name
        if setting is True and not regathers[i]:
            unkept.append(Unkept(entry, name, setting, "not_traced"))
        elif setting is not True and setting is not False:
            unkept.append(Unkept(entry, name, setting, "ranks"))
        elif setting is False and not regathers[i]:
            unkept.append(Unkept(entry, name, setting, "already_kept"))
        elif setting is False:
            wanted.append(i)
    if not wanted:
        return KeepResult(unkept=tuple(unkept))
    forward: dict[tuple[object, ...], list[Collective]] = {}  # candidates, graph order, by shard and group
    for _, c in covered:
        if c.kind == "all_gather" and c.direction == "forward" and len(c.waits) == 1:
            forward.setdefault(_gathered_from(c), []).append(c)
    content_of = _contents(gm)
    index = positions(gm.graph)
    kept: list[Kept] = []
    for i in wanted:
        removed: list[str] = []
        params: list[str] = []
        left: list[str] = []
        held: dict[fx.Node, int] = {}  # per forward value now kept alive (two re-gathers of one value hold it once)
        for c in regathers[i]:
            source, why = _forward_value(c, forward.get(_gathered_from(c), []), content_of, index)
            if source is None:
                left.append(f"{c.start.name} ({why})")
                continue
            _replace(gm.graph, c, source)
            removed.append(c.start.name)
            params.extend(p for p in c.params if p not in params)
            held[source] = c.unsharded_bytes
        if left:
            unkept.append(Unkept(plan.buckets[i].entry_index, plan.buckets[i].name, False, "kept_regathers",
                                 tuple(left)))
        if removed:
            kept.append(Kept(i, tuple(removed), tuple(params), sum(held.values())))
    return KeepResult(tuple(kept), tuple(unkept))


def _gathered_from(c: Collective) -> tuple[object, ...]:
    """Which shard(s), over which group: where to look for a forward gather a re-gather could reuse."""
    return (tuple(placeholder_sources(c.start) or (c.start,)), c.group, c.group_size)


def _contents(gm: fx.GraphModule) -> Callable[[fx.Node], object]:
    """``node -> the elements it holds`` (``overlapcfg.graph.provenance``); None where unknown."""
    return interpret(gm.graph).read


def _forward_value(regather: Collective, candidates: Sequence[Collective], content_of: Callable[[fx.Node], object],
                   index: dict[fx.Node, int]) -> tuple[fx.Node | None, str]:
    """The first forward gather's wait (graph order) that ``regather``'s readers can read instead, or None and why
    none can: the same shard over the same group, nothing writing the shard between the two gathers or the
    forward's gathered value before the last reader, and the same elements (equal provenance: same cast, view and
    group size)."""
    if len(regather.waits) != 1 or not candidates:
        return None, "no forward all-gather of the same shard over the same group"
    wait = regather.waits[0]
    first_reader = min((index[u] for u in wait.users), default=index[wait])
    last_reader = max((index[u] for u in wait.users), default=index[wait])
    why = ""
    for candidate in candidates:
        source = candidate.waits[0]
        if index[source] > first_reader:
            why = f"the forward's gathered value {source.name} comes after the re-gather's first reader"
        elif (writer := _first_writer(regather, source, index)) is not None:
            why = writer
        elif (mine := content_of(wait)) is None or mine != content_of(source):
            why = f"it gathers other elements than the forward's {candidate.start.name} (another cast or view)"
        elif (written := _writer(source, index[source], last_reader, index)) is not None:
            why = f"{written.name} writes the forward's gathered value before the backward reads it"
        else:
            return source, ""
    return None, why


def _first_writer(regather: Collective, source: fx.Node, index: dict[fx.Node, int]) -> str | None:
    for shard in placeholder_sources(regather.start) or ():
        writer = _writer(shard, index[source], index[regather.start], index)
        if writer is not None:
            return f"{writer.name} writes the shard {shard.name} between the forward gather and the re-gather"
    return None


def _writer(node: fx.Node, lo: int, hi: int, index: dict[fx.Node, int]) -> fx.Node | None:
    """The first node strictly between positions ``lo`` and ``hi`` that writes ``node`` or a view of it."""
    aliases, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user not in aliases and may_alias_input(user):
                aliases.add(user)
                stack.append(user)
    writers = [u for a in aliases for u in a.users if a in written_inputs(u) and lo < index[u] < hi]
    return min(writers, key=index.__getitem__, default=None)


def _replace(graph: fx.Graph, regather: Collective, source: fx.Node) -> None:
    """Every reader of the re-gather's wait reads ``source``; the wait, the start and whatever fed only the start
    (the re-gather's own recomputed casts and views) are erased."""
    wait = regather.waits[0]
    wait.replace_all_uses_with(source)
    feeding = list(regather.start.all_input_nodes)
    graph.erase_node(wait)
    graph.erase_node(regather.start)
    while feeding:
        node = feeding.pop()
        if node.op == "call_function" and not node.users and not node.is_impure():
            feeding.extend(node.all_input_nodes)
            graph.erase_node(node)

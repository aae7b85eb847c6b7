"""Every note the graph pass leaves in its record besides its buckets, worded here and put in order by ``pass_notes``:
settings the strategy ignores (never dropped silently), collectives left alone or unattributed, per-bucket
``reshard_after_forward`` settings that did not act, waits folded, the strategy's own notes, partial gradients held
for a merged reduce-scatter, HSDP all-reduces a strategy left unbucketed.

Pure functions of the config and the pass's facts; ``overlapcfg.passes.pipeline`` logs the ones that are also
warnings (once each) and puts ``pass_notes`` into the ``PassRecord``. A note about a setting is a ``SettingNote``,
its path relative to the config (``plan.buckets[1].reshard_after_forward``): ``apply`` words it at the user's path
(``overlapcfg.config.boundary``). A strategy's notes (``StrategyResult.notes``) are its own words: a strategy may come
from another package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from overlapcfg.config import OverlapConfig
from overlapcfg.config.boundary import SettingNote
from overlapcfg.graph.collectives import Collective
from overlapcfg.graph.merge import MergedCollective
from overlapcfg.passes.keep_unsharded import Unkept
from overlapcfg.resolve import ResolvedPlan
from overlapcfg.strategies import Strategy

__all__ = ["LOOK_LIKE", "NOTHING_TO_DO", "Note", "folded_waits", "held_partials", "ignored_settings",
           "left_alone_chains", "pass_notes", "unattributed", "unbucketed_all_reduces", "unkept_settings"]

Note: TypeAlias = str | SettingNote
"""A record note: text, or a note about a setting (``SettingNote``) that ``apply`` words at the user's path."""

NOTHING_TO_DO = "no FSDP collectives: nothing to do"

LOOK_LIKE = {"all_gather": ("all-gathers", "FSDP parameter gathers"),
             "reduce_scatter": ("reduce-scatters", "FSDP gradient reductions")}
"""How ``Collective.unattributed`` collectives of each kind are described."""


def pass_notes(cfg: OverlapConfig, strategy: Strategy, collectives: Sequence[Collective], *,
               nothing_to_do: bool = False, unkept: Sequence[Unkept] = (), folded: Sequence[str] = (),
               strategy_notes: Sequence[str] = (), held: Sequence[str] = (),
               all_reduces: Sequence[str] = ()) -> tuple[Note, ...]:
    """The record's notes, in the order the pass learns them: nothing to do (a graph without FSDP collectives), the
    settings the strategy ignores, the collectives found but left alone, then what the rewrite did: settings that
    did not act (``unkept``), waits folded, the strategy's notes, partial gradients held (``held_partials``) and
    all-reduces left unbucketed (``unbucketed_all_reduces``)."""
    return ((NOTHING_TO_DO,) if nothing_to_do else ()) + (
        *ignored_settings(cfg, strategy), *unattributed(collectives), *left_alone_chains(collectives),
        *unkept_settings(unkept), *folded_waits(folded), *strategy_notes, *held, *all_reduces)


def ignored_settings(cfg: OverlapConfig, strategy: Strategy) -> tuple[SettingNote, ...]:
    """Settings the selected strategy does not read, written by the user: never silently dropped."""
    notes = []
    if not strategy.uses_plan and cfg.plan is not None and cfg.plan.buckets:
        notes.append(SettingNote("plan", f" is ignored: strategy {cfg.strategy!r} does not bucket by plan"))
    if not strategy.uses_plan and cfg.overrides:
        notes.append(SettingNote("overrides", f" are ignored: strategy {cfg.strategy!r} does not bucket by plan"))
    if not strategy.reads_policy and cfg.policy != type(cfg.policy)():
        notes.append(SettingNote("policy", f" is ignored: strategy {cfg.strategy!r} reads no policy"))
    if not strategy.uses_plan:
        notes += [SettingNote(s.path(), f" is ignored: strategy {cfg.strategy!r} does not bucket by plan")
                  for s in cfg.settings("reshard_after_forward", sites=("plan",))]
    return tuple(notes)


def left_alone_chains(collectives: Sequence[Collective]) -> tuple[str, ...]:
    """Collectives shaped like data-parallel traffic that classification deliberately left alone, said once."""
    return tuple(dict.fromkeys(c.note for c in collectives if c.note))


def unattributed(collectives: Sequence[Collective]) -> tuple[str, ...]:
    """Collectives shaped like FSDP's that the graph's evidence cannot confirm (``Collective.unattributed``): left
    where they are, counted as uncovered, said loudly with the cause; one note per kind."""
    notes = []
    for kind, (plural, what) in LOOK_LIKE.items():
        found = [c for c in collectives if c.unattributed and c.kind == kind]
        if not found:
            continue
        names = [c.start.name for c in found]
        shown = ", ".join(names[:4]) + (f" ... ({len(names)} in all)" if len(names) > 4 else "")
        causes = "; ".join(dict.fromkeys(c.unattributed for c in found if c.unattributed))
        notes.append(f"overlapcfg: {len(found)} {plural} look like {what} ({shown}) but are left unbucketed and "
                     f"counted as uncovered: {causes}")
    return tuple(notes)


def unkept_settings(unkept: Sequence[Unkept]) -> tuple[SettingNote, ...]:
    """Per-bucket ``reshard_after_forward`` settings that did not act, or not on every re-gather
    (``overlapcfg.passes.keep_unsharded``), each at its plan entry's path; once per entry on an aot graph."""
    notes: dict[SettingNote, None] = {}
    for u in unkept:
        path = f"plan.buckets[{u.entry}].reshard_after_forward"
        if u.why == "separate_graph":
            text = (f" is ignored: aot's separate {u.detail[0]} graph cannot reach the other graph's gathered "
                    "parameters (it applies to whole-step graphs and to overlapcfg.fully_shard)")
        elif u.why == "not_traced":
            text = (f" is ignored for bucket {u.bucket}: this graph has no backward re-gather of it (traced without "
                    "resharding); overlapcfg does not add all-gathers")
        elif u.why == "ranks":
            text = (f" = {u.setting} is ignored for bucket {u.bucket}: resharding to groups of ranks applies to "
                    "overlapcfg.fully_shard only")
        elif u.why == "already_kept":
            text = (f": bucket {u.bucket} has no backward re-gather in this graph; its parameters already stay "
                    "unsharded from forward to backward")
        else:  # some re-gathers stay: the first few with their reasons (a 32-block model would print hundreds)
            more = f"; ... ({len(u.detail)} in all)" if len(u.detail) > 3 else ""
            text = (f": bucket {u.bucket} keeps {len(u.detail)} backward re-gather(s): "
                    + "; ".join(u.detail[:3]) + more)
        notes[SettingNote(path, text)] = None
    return tuple(notes)


def folded_waits(starts: Sequence[str]) -> tuple[str, ...]:
    """Said in the record: the pass erased waits (``fold_repeated_waits``; torch's merge helpers take one wait per
    collective, and "none" leaves the graph be)."""
    if not starts:
        return ()
    return (f"{len(starts)} collectives were waited more than once (the tracer merged equal collectives, e.g. "
            f"two equal bias gradients, or waited a tied weight's gather once per use) or returned unwaited (saved "
            f"for the backward); their first wait now serves every reader: {', '.join(starts[:4])}"
            f"{' ...' if len(starts) > 4 else ''}",)


def held_partials(gradients: Sequence[tuple[Collective, ...]], plan: ResolvedPlan,
                  merged: Sequence[MergedCollective]) -> tuple[str, ...]:
    """Per gradient summed from several reduce-scattered partials that one merged reduce-scatter now carries, what
    merging them costs: the partials (full size) all stay alive until the bucket's reduce-scatter, where alone each
    was reduce-scattered as soon as it was computed. The sums are as before, bit for bit (each element is reduced
    over the same ranks, and summed after in the traced order)."""
    merged_into = {source: m for m in merged if m.kind == "reduce_scatter" for source in m.sources}
    notes = []
    for partials in gradients:
        into = {id(merged_into[c.start.name]) for c in partials if c.start.name in merged_into}
        if len(into) != 1 or not all(c.start.name in merged_into for c in partials):
            continue  # not merged (an upstream strategy), or not together: nothing held longer than traced
        bucket = merged_into[partials[0].start.name].bucket
        held = sum(c.unsharded_bytes for c in partials)
        owner = partials[-1].module_fqn or "?"
        notes.append(f"bucket {plan.buckets[bucket].name!r}: {len(partials)} reduce-scatters are partial "
                     f"gradients of one parameter of {owner!r} (a shared parameter, or a module run "
                     f"{len(partials)} times a step, such as a chunked loss's head), summed after them as traced; "
                     f"merged, all {len(partials)} unsharded partials ({held:,} bytes) stay alive until the "
                     "bucket's reduce-scatter")
    return tuple(notes)


def unbucketed_all_reduces(cfg: OverlapConfig, covered: Sequence[tuple[int, Collective]],
                           merged: Sequence[object], after: Sequence[Collective]) -> tuple[str, ...]:
    """A strategy that buckets HSDP all-reduces emits merged all-reduces; one that does not (upstream's before
    torch 2.14) leaves one per parameter on the replicate group's links: say so, loudly, rather than report a
    bucketed step. Strategies that return no merges (upstream's passes) are judged by the graph they left."""
    ars = [c for _, c in covered if c.role == "hsdp_all_reduce"]
    if not ars or any(getattr(m, "kind", None) == "all_reduce" for m in merged):
        return ()
    groups = {c.group for c in ars}
    if sum(1 for c in after if c.kind == "all_reduce" and c.group in groups) < len(ars):
        return ()  # fewer all-reduces on those groups than HSDP gradients: the strategy bucketed them
    shown = ", ".join(sorted(repr(g) for g in groups))
    return (f"overlapcfg[{cfg.strategy}]: {len(ars)} HSDP gradient all-reduces (group {shown}) left unbucketed and "
            "unscheduled: this strategy does not handle them (upstream manual_overlap_bucketing skips all-reduces "
            "before torch 2.14); strategy 'manual' buckets them per bucket with all_reduce_delay",)

"""Plan resolution: a ``BucketPlan`` of patterns, matched against one model's modules, becomes concrete buckets.

What lives here: expanding each entry form into buckets, the checks that need the real module tree (unmatched
patterns, modules claimed twice, overrides that reach nothing, coverage), bucket names and effective depths.
Pattern syntax lives in ``overlapcfg.config.patterns``; field validation in ``overlapcfg.config``; nothing here
touches a graph or imports torch.

Rules, in the order they are applied:

- Entry forms: a pattern gives one bucket per matched module; a list gives one bucket holding everything its
  patterns match; a ``Bucket`` mapping with ``per`` gives one bucket per ``per`` match holding the matches of
  ``modules`` inside it (then split by ``group_size``, if set); without ``per``, the matches chunked into
  consecutive groups of ``group_size`` (``None``: one bucket).
- A match nested inside another match of the same entry collapses into the outer one (``per`` matches too).
- Every pattern must match a module; with ``per``, every ``per`` module must hold a match and every match must
  lie in a ``per`` module (a silently empty or dropped bucket is how a plan rots unnoticed).
- A module may be claimed by one entry only, counting nesting: ``layers.0.attention`` in one entry and
  ``layers.*`` in another is an error naming both.
- Depths: the policy's value, then the entry's own value, then each matching override in order (later wins).
  An override applies to the bucket that each module it matches belongs to (the module is one of the bucket's
  modules or nested in one). It is matched against module FQNs only, never against bucket names. An override
  reaching no bucket is an error.
- Coverage: parameter owners outside every bucket are listed on ``ResolvedPlan.uncovered``; with
  ``require_full_coverage`` they are an error.

All faults are collected and raised together as one ``OverlapConfigError``; nothing is partially resolved.

Bucket names are described in ``overlapcfg.resolve.names``; pattern matching and its "did you mean" hints in
``overlapcfg.resolve.matcher``; overrides in ``overlapcfg.resolve.overrides``. Every step is about linear in
the plan plus the model (patterns are matched through an index, never patterns x modules).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from overlapcfg.config.depths import DEPTH_FIELDS, Depths, settle
from overlapcfg.config.module_index import ModuleIndex
from overlapcfg.config.plan import Bucket, BucketPlan, ModuleOverride
from overlapcfg.errors import Fault, OverlapConfigError, OverlapUsageError
from overlapcfg.module_paths import ancestors, normalize_fqns
from overlapcfg.resolve.matcher import Matcher, outermost, show
from overlapcfg.resolve.names import bucket_name, unique_names
from overlapcfg.resolve.overrides import apply_overrides
from overlapcfg.resolve.resolved import ResolvedBucket, ResolvedPlan

__all__ = ["ResolvedBucket", "ResolvedPlan", "bucket_name", "entry_text", "resolve_plan"]

logger = logging.getLogger(__name__)

Entry: TypeAlias = str | tuple[str, ...] | list[str] | Bucket


@dataclass(slots=True)
class _Draft:
    modules: tuple[str, ...]
    entry_index: int
    values: dict[str, int]


def resolve_plan(
    plan: BucketPlan,
    module_fqns: Sequence[str],
    owners: Sequence[str] | None = None,
    *,
    overrides: Sequence[ModuleOverride] = (),
    policy: Depths | None = None,
    path: str = "plan",
    overrides_path: str = "overrides",
) -> ResolvedPlan:
    """Resolve ``plan`` against a model's module FQNs (``named_modules()`` order; wrappers and root allowed).

    ``owners`` are the FQNs of the modules owning FSDP parameters (for coverage); ``None`` means unknown, in
    which case ``uncovered`` is empty and ``require_full_coverage`` cannot be honoured (``TypeError``).
    ``path`` / ``overrides_path`` prefix fault paths so they point where the user wrote the plan.
    """
    if plan.require_full_coverage and owners is None:
        raise OverlapUsageError("resolve_plan: the plan sets require_full_coverage, so pass owners=[...] to check it")
    fqns = normalize_fqns(module_fqns)
    texts = [entry_text(e) for e in plan.buckets]
    faults: list[Fault] = []
    matcher = Matcher(ModuleIndex(fqns), faults)
    drafts: list[_Draft] = []
    for i, entry in enumerate(plan.buckets):
        drafts += _resolve_entry(entry, i, f"{path}.buckets[{i}]", texts[i], matcher)
    faults += _conflicts(drafts, texts, path)
    names = unique_names([bucket_name(d.modules) for d in drafts])
    base = policy if policy is not None else Depths()
    buckets = [_finish(d, n, texts[d.entry_index], base, path) for d, n in zip(drafts, names, strict=True)]
    buckets = apply_overrides(ResolvedPlan(tuple(buckets)), overrides, overrides_path, matcher, plan_ok=not faults)
    result = ResolvedPlan(tuple(buckets))
    uncovered = _uncovered(result, owners, fqns)
    if uncovered and plan.require_full_coverage and not faults:
        faults.append(
            Fault(
                f"{path}.require_full_coverage",
                f"{len(uncovered)} module(s) owning FSDP parameters "
                f"are in no bucket: {show(uncovered, limit=20)} (add entries for them, or set "
                "require_full_coverage: false)",
            )
        )
    if faults:
        raise OverlapConfigError(faults, header="the bucket plan does not fit the model")
    logger.info(
        "resolved %d plan entries into %d buckets (%d uncovered owners)", len(texts), len(buckets), len(uncovered)
    )
    return ResolvedPlan(result.buckets, uncovered)


def entry_text(entry: Entry) -> str:
    """How an entry is shown in messages and reports, close to what was written in YAML."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        return "[" + ", ".join(entry) + "]"
    parts = [f"modules: {entry_text(tuple(entry.modules))}"]
    parts += [f"{k}: {v}" for k in ("per", "group_size", *DEPTH_FIELDS) if (v := getattr(entry, k)) is not None]
    return "{" + ", ".join(parts) + "}"


def _resolve_entry(entry: Entry, index: int, path: str, text: str, m: Matcher) -> list[_Draft]:
    if isinstance(entry, str):
        return [_Draft((hit,), index, {}) for hit in outermost(m.match(entry, path, text))]
    if isinstance(entry, (tuple, list)):
        matches = m.match_all(entry, path, text)
        return [_Draft(tuple(matches), index, {})] if matches else []
    values = entry.changes()
    return [_Draft(group, index, values) for group in _resolve_mapping(entry, path, text, m)]


def _resolve_mapping(entry: Bucket, path: str, text: str, m: Matcher) -> list[tuple[str, ...]]:
    before = len(m.faults)
    size = entry.group_size
    if size is not None and size < 1:
        m.faults.append(Fault(f"{path}.group_size", f"group_size must be an integer >= 1, got {size!r}"))
    matches = m.match_all(entry.modules, f"{path}.modules", text)
    homes = [matches] if entry.per is None else _split_per(entry, matches, path, text, m)
    if len(m.faults) > before:
        return []
    return [group for home in homes for group in _chunk(home, size)]


def _split_per(entry: Bucket, matches: list[str], path: str, text: str, m: Matcher) -> list[list[str]]:
    """Group ``matches`` by the (outermost) ``per`` module containing them; empty homes and strays are faults."""
    per = entry.per or ""
    homes = outermost(m.match(per, f"{path}.per", text))
    if not homes or not matches:
        return []
    grouped: dict[str, list[str]] = {h: [] for h in homes}
    strays = []
    for x in matches:  # homes are outermost, so at most one of them holds x
        home = next((a for a in (x, *ancestors(x)) if a in grouped), None)
        if home is None:
            strays.append(x)
        else:
            grouped[home].append(x)
    empty = [h for h, members in grouped.items() if not members]
    if empty:
        m.faults.append(
            Fault(
                f"{path}.per",
                f"per module(s) {show(empty)} hold no match of modules "
                f"{entry_text(tuple(entry.modules))}; narrow 'per' (e.g. an index range) so that "
                "every per module holds a match",
            )
        )
    if strays:
        m.faults.append(
            Fault(
                f"{path}.modules",
                f"matches {show(strays)} lie outside every 'per' module "
                f"({per!r}); move them to an entry of their own",
            )
        )
    return list(grouped.values())


def _chunk(modules: list[str], size: int | None) -> Iterator[tuple[str, ...]]:
    if size is None:
        yield tuple(modules)
        return
    for start in range(0, len(modules), size):
        yield tuple(modules[start : start + size])


def _conflicts(drafts: list[_Draft], texts: list[str], path: str) -> list[Fault]:
    """Modules claimed by two entries, directly or by nesting; one fault per pair of entries."""
    claimed: dict[str, int] = {}
    for d in drafts:
        for m in d.modules:
            claimed.setdefault(m, d.entry_index)
    clashes: dict[tuple[int, int], list[str]] = {}
    for d in drafts:
        for m in d.modules:
            owner = claimed[m]
            if owner != d.entry_index:
                clashes.setdefault((owner, d.entry_index), []).append(show([m]))
            for a in ancestors(m):
                other = claimed.get(a)
                if other is not None and other != d.entry_index:
                    first, second = sorted((other, d.entry_index))
                    clashes.setdefault((first, second), []).append(f"{show([m])} inside {show([a])}")
    faults = []
    for (first, second), what in sorted(clashes.items()):
        unique = list(dict.fromkeys(what))
        shown = ", ".join(unique[:4]) + (f" ... ({len(unique)} in all)" if len(unique) > 4 else "")
        faults.append(
            Fault(
                f"{path}.buckets[{second}]",
                f"entry {second} ({texts[second]}) and entry {first} "
                f"({texts[first]}) both claim {shown}; a module belongs to one bucket only",
            )
        )
    return faults


def _finish(d: _Draft, name: str, text: str, policy: Depths, path: str) -> ResolvedBucket:
    entry = f"{path}.buckets[{d.entry_index}]"
    set_values = {key: (value, "policy") for key in DEPTH_FIELDS if (value := getattr(policy, key)) is not None}
    set_values.update({key: (value, entry) for key, value in d.values.items() if value is not None})
    settled = settle(set_values)
    return ResolvedBucket(name=name, modules=d.modules, entry_index=d.entry_index, entry_text=text,
                          **{key: value for key, (value, _) in settled.items()},
                          origins=tuple((key, source) for key, (_, source) in settled.items()))


def _uncovered(plan: ResolvedPlan, owners: Sequence[str] | None, fqns: tuple[str, ...]) -> tuple[str, ...]:
    if owners is None:
        return ()
    order = {f: i for i, f in enumerate(fqns)}
    missing = [o for o in normalize_fqns(owners) if plan.bucket_of(o) is None]
    return tuple(sorted(missing, key=lambda o: order.get(o, len(order))))

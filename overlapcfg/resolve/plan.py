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

Bucket names (unique, deterministic, a function of the bucket's modules): a single module is its FQN (the root
is ``<root>``); several are joined by ``+``, with runs of consecutive integer siblings written as a range
(``layers.0-1``; ``norm+output``; ``layers.0.attention_norm+layers.0.attention``). Names with more than four
parts keep the first and last (``a+...+z``). A name that would repeat gets ``#2``, ``#3`` ... in plan order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeAlias, runtime_checkable

from overlapcfg.config.patterns import (
    Pattern,
    compile_pattern,
    is_inside,
    match_modules,
    normalize_fqns,
    split_fqn,
    strip_wrappers,
    suggest_fixes,
)
from overlapcfg.config.plan import Bucket, BucketPlan, ModuleOverride
from overlapcfg.config.policy import OverlapPolicy
from overlapcfg.errors import Fault, OverlapConfigError, closest

__all__ = ["DEPTH_FIELDS", "DepthSource", "ResolvedBucket", "ResolvedPlan", "bucket_name", "entry_text", "resolve_plan"]

logger = logging.getLogger(__name__)

DEPTH_FIELDS: tuple[str, ...] = ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay")
"""The per-bucket values an entry or an override may set."""

Entry: TypeAlias = str | tuple[str, ...] | list[str] | Bucket


@runtime_checkable
class DepthSource(Protocol):
    """Anything with the three depths (``OverlapPolicy``, ``TorchManualPolicy``)."""

    forward_prefetch: int
    backward_prefetch: int
    reduce_scatter_delay: int


@dataclass(frozen=True, slots=True)
class ResolvedBucket:
    """One bucket: concrete modules (wrappers stripped, model order), where it came from, its effective depths."""

    name: str
    modules: tuple[str, ...]
    entry_index: int
    entry_text: str
    forward_prefetch: int
    backward_prefetch: int
    reduce_scatter_delay: int
    overridden_by: tuple[str, ...] = ()
    """Paths of the overrides that set a value here, in the order applied (``overrides[1]``)."""
    origins: tuple[tuple[str, str], ...] = ()
    """``(field, source)`` for each depth: ``policy``, the entry's path, or the winning override's path."""

    def origin(self, name: str) -> str:
        """Where the effective value of depth field ``name`` came from."""
        for key, source in self.origins:
            if key == name:
                return source
        raise KeyError(f"{name!r} is not a depth field; expected one of {', '.join(DEPTH_FIELDS)}")


@dataclass(frozen=True, slots=True)
class ResolvedPlan:
    """The buckets in plan order, plus the parameter owners that no bucket covers (model order)."""

    buckets: tuple[ResolvedBucket, ...]
    uncovered: tuple[str, ...] = ()
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {m: i for i, b in enumerate(self.buckets) for m in b.modules}
        object.__setattr__(self, "_index", MappingProxyType(index))

    def bucket_index(self, module_fqn: str) -> int | None:
        """Position in ``buckets`` of the bucket whose module ``module_fqn`` is or is nested in, else None.

        Nesting is by whole segments (``layers.10`` is not in ``layers.1``); wrapper segments are ignored.
        """
        fqn = strip_wrappers(module_fqn)
        for candidate in (fqn, *reversed(_ancestors(fqn))):
            if candidate in self._index:
                return self._index[candidate]
        return None

    def bucket_of(self, module_fqn: str) -> ResolvedBucket | None:
        """The bucket ``module_fqn`` belongs to (see ``bucket_index``), else None."""
        i = self.bucket_index(module_fqn)
        return None if i is None else self.buckets[i]

    def by_name(self, name: str) -> ResolvedBucket:
        """The bucket called ``name``; ``KeyError`` lists the closest names."""
        for bucket in self.buckets:
            if bucket.name == name:
                return bucket
        hint = _show(closest(name, [b.name for b in self.buckets])) or "none close"
        raise KeyError(f"no bucket named {name!r} (closest: {hint})")

    def module_lists(self) -> list[list[str]]:
        """The plan as torch's ``manual_overlap_bucketing`` takes it: one list of FQNs per bucket."""
        return [list(b.modules) for b in self.buckets]


@dataclass(slots=True)
class _Draft:
    modules: tuple[str, ...]
    entry_index: int
    values: dict[str, int | None]


def resolve_plan(
    plan: BucketPlan,
    module_fqns: Sequence[str],
    owners: Sequence[str] | None = None,
    *,
    overrides: Sequence[ModuleOverride] = (),
    policy: DepthSource | None = None,
    path: str = "plan",
    overrides_path: str = "overrides",
) -> ResolvedPlan:
    """Resolve ``plan`` against a model's module FQNs (``named_modules()`` order; wrappers and root allowed).

    ``owners`` are the FQNs of the modules owning FSDP parameters (for coverage); ``None`` means unknown, in
    which case ``uncovered`` is empty and ``require_full_coverage`` cannot be honoured (``TypeError``).
    ``path`` / ``overrides_path`` prefix fault paths so they point where the user wrote the plan.
    """
    if plan.require_full_coverage and owners is None:
        raise TypeError("resolve_plan: the plan sets require_full_coverage, so pass owners=[...] to check it")
    fqns = normalize_fqns(module_fqns)
    texts = [entry_text(e) for e in plan.buckets]
    faults: list[Fault] = []
    matcher = _Matcher(fqns, faults)
    drafts: list[_Draft] = []
    for i, entry in enumerate(plan.buckets):
        drafts += _resolve_entry(entry, i, f"{path}.buckets[{i}]", texts[i], matcher)
    faults += _conflicts(drafts, texts, path)
    names = _unique([bucket_name(d.modules) for d in drafts])
    base = policy if policy is not None else OverlapPolicy()
    buckets = [_finish(d, n, texts[d.entry_index], base, path) for d, n in zip(drafts, names, strict=True)]
    buckets = _apply_overrides(buckets, overrides, overrides_path, matcher, plan_ok=not faults)
    result = ResolvedPlan(tuple(buckets))
    uncovered = _uncovered(result, owners, fqns)
    if uncovered and plan.require_full_coverage and not faults:
        faults.append(
            Fault(
                f"{path}.require_full_coverage",
                f"{len(uncovered)} module(s) owning FSDP parameters "
                f"are in no bucket: {_show(uncovered, limit=20)} (add entries for them, or set "
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


def bucket_name(modules: Sequence[str]) -> str:
    """The readable name of a bucket holding ``modules`` (see the module docstring for the scheme)."""
    parts = list(_compress(modules))
    if len(parts) > 4:
        parts = [parts[0], "...", parts[-1]]
    return "+".join(parts)


@dataclass(slots=True)
class _Matcher:
    """The model's FQNs plus the fault list every lookup appends to (so all faults surface at once)."""

    fqns: tuple[str, ...]
    faults: list[Fault]

    def match(self, text: str, path: str, entry: str) -> list[str]:
        """Matches of one pattern, in model order; a bad or unmatched pattern records a fault."""
        try:
            pattern = compile_pattern(text, path=path)
        except OverlapConfigError as err:
            self.faults += err.faults
            return []
        hits = match_modules(pattern, self.fqns)
        if not hits:
            where = "" if entry == text else f" (in entry {entry})"
            self.faults.append(Fault(path, f"pattern {text!r}{where} matches no module{self._suggest(pattern)}"))
        return hits

    def match_all(self, patterns: Sequence[str], path: str, entry: str) -> list[str]:
        """The union of the patterns' matches in model order, nested ones collapsed."""
        hits: dict[str, None] = {}
        for j, pattern in enumerate(patterns):
            hits.update(dict.fromkeys(self.match(pattern, f"{path}[{j}]", entry)))
        return _outermost([f for f in self.fqns if f in hits])

    def _suggest(self, pattern: Pattern) -> str:
        fixes = suggest_fixes(pattern, self.fqns)
        near = closest(str(pattern), [f for f in self.fqns if f], n=3)
        hint = f"; did you mean {_show(fixes)}?" if fixes else ""
        if near:
            return hint + f" (closest modules: {_show(near)})"
        top = [f for f in self.fqns if f and "." not in f][:6]
        return hint + (f" (top-level modules: {_show(top)})" if top else " (the model has no named modules)")


def _resolve_entry(entry: Entry, index: int, path: str, text: str, m: _Matcher) -> list[_Draft]:
    if isinstance(entry, str):
        return [_Draft((hit,), index, {}) for hit in _outermost(m.match(entry, path, text))]
    if isinstance(entry, (tuple, list)):
        matches = m.match_all(entry, path, text)
        return [_Draft(tuple(matches), index, {})] if matches else []
    values = {k: getattr(entry, k) for k in DEPTH_FIELDS}
    return [_Draft(group, index, values) for group in _resolve_mapping(entry, path, text, m)]


def _resolve_mapping(entry: Bucket, path: str, text: str, m: _Matcher) -> list[tuple[str, ...]]:
    before = len(m.faults)
    size = entry.group_size
    if size is not None and size < 1:
        m.faults.append(Fault(f"{path}.group_size", f"group_size must be an integer >= 1, got {size!r}"))
    matches = m.match_all(entry.modules, f"{path}.modules", text)
    homes = [matches] if entry.per is None else _split_per(entry, matches, path, text, m)
    if len(m.faults) > before:
        return []
    return [group for home in homes for group in _chunk(home, size)]


def _split_per(entry: Bucket, matches: list[str], path: str, text: str, m: _Matcher) -> list[list[str]]:
    """Group ``matches`` by the (outermost) ``per`` module containing them; empty homes and strays are faults."""
    per = entry.per or ""
    homes = _outermost(m.match(per, f"{path}.per", text))
    if not homes or not matches:
        return []
    grouped = {h: [x for x in matches if is_inside(x, h)] for h in homes}
    empty = [h for h, members in grouped.items() if not members]
    if empty:
        m.faults.append(
            Fault(
                f"{path}.per",
                f"per module(s) {_show(empty)} hold no match of modules "
                f"{entry_text(tuple(entry.modules))}; narrow 'per' (e.g. an index range) so that "
                "every per module holds a match",
            )
        )
    strays = [x for x in matches if not any(is_inside(x, h) for h in homes)]
    if strays:
        m.faults.append(
            Fault(
                f"{path}.modules",
                f"matches {_show(strays)} lie outside every 'per' module "
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
                clashes.setdefault((owner, d.entry_index), []).append(_show([m]))
            for a in _ancestors(m):
                other = claimed.get(a)
                if other is not None and other != d.entry_index:
                    first, second = sorted((other, d.entry_index))
                    clashes.setdefault((first, second), []).append(f"{_show([m])} inside {_show([a])}")
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


def _finish(d: _Draft, name: str, text: str, policy: DepthSource, path: str) -> ResolvedBucket:
    values: dict[str, int] = {}
    origins: list[tuple[str, str]] = []
    for key in DEPTH_FIELDS:
        own = d.values.get(key)
        values[key] = own if own is not None else getattr(policy, key)
        origins.append((key, f"{path}.buckets[{d.entry_index}]" if own is not None else "policy"))
    return ResolvedBucket(name, d.modules, d.entry_index, text, **values, origins=tuple(origins))


def _apply_overrides(
    buckets: list[ResolvedBucket], overrides: Sequence[ModuleOverride], path: str, m: _Matcher, *, plan_ok: bool
) -> list[ResolvedBucket]:
    """Later overrides win; each must reach a bucket (checked only once the plan itself resolved)."""
    index = ResolvedPlan(tuple(buckets))
    out = list(buckets)
    for k, override in enumerate(overrides):
        where = f"{path}[{k}]"
        hits = m.match(override.match, f"{where}.match", override.match)
        if not hits or not plan_ok:
            continue
        targets = [i for x in hits if (i := index.bucket_index(x)) is not None]
        if not targets:
            inner = [b.name for b in buckets if any(is_inside(x, h) for x in b.modules for h in hits)]
            hint = ""
            if inner:
                hint = f"; buckets inside them: {_show(inner)} (write {override.match}.** to reach them)"
            m.faults.append(
                Fault(
                    f"{where}.match",
                    f"override {override.match!r} matches {_show(hits)}, which belong to no bucket{hint}",
                )
            )
            continue
        out = [_override(b, override, where) if i in targets else b for i, b in enumerate(out)]
    return out


def _override(bucket: ResolvedBucket, override: ModuleOverride, where: str) -> ResolvedBucket:
    changes = {k: v for k in DEPTH_FIELDS if (v := getattr(override, k)) is not None}
    origins = tuple((k, where if k in changes else src) for k, src in bucket.origins)
    return ResolvedBucket(
        bucket.name,
        bucket.modules,
        bucket.entry_index,
        bucket.entry_text,
        **{k: changes.get(k, getattr(bucket, k)) for k in DEPTH_FIELDS},
        overridden_by=(*bucket.overridden_by, where),
        origins=origins,
    )


def _uncovered(plan: ResolvedPlan, owners: Sequence[str] | None, fqns: tuple[str, ...]) -> tuple[str, ...]:
    if owners is None:
        return ()
    order = {f: i for i, f in enumerate(fqns)}
    missing = [o for o in normalize_fqns(owners) if plan.bucket_of(o) is None]
    return tuple(sorted(missing, key=lambda o: order.get(o, len(order))))


def _outermost(matches: list[str]) -> list[str]:
    """Drop matches nested inside another match (the outer module's bucket already holds them)."""
    present = set(matches)  # membership only; order comes from ``matches``
    return [m for m in matches if not any(a in present for a in _ancestors(m))]


def _ancestors(fqn: str) -> list[str]:
    """Proper ancestors, outermost first: ``a.b.c`` -> ``["", "a", "a.b"]``; the root has none."""
    parts = split_fqn(fqn)
    return [".".join(parts[:i]) for i in range(len(parts))]


def _compress(modules: Sequence[str]) -> Iterator[str]:
    """Yield name parts, writing runs of consecutive integer siblings as ``parent.first-last``."""
    i = 0
    while i < len(modules):
        j = i
        while j + 1 < len(modules) and _next_sibling(modules[j], modules[j + 1]):
            j += 1
        if j == i:
            yield modules[i] or "<root>"
        else:
            parent, _, first = modules[i].rpartition(".")
            last = modules[j].rpartition(".")[2]
            yield f"{parent}.{first}-{last}" if parent else f"{first}-{last}"
        i = j + 1


def _next_sibling(a: str, b: str) -> bool:
    pa, _, la = a.rpartition(".")
    pb, _, lb = b.rpartition(".")
    return bool(a) and pa == pb and la.isdecimal() and lb.isdecimal() and int(lb) == int(la) + 1


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def _show(items: Sequence[str], limit: int = 6) -> str:
    """Quoted FQNs for messages (at most ``limit``, then a count); the root module reads ``<root>``."""
    shown = ", ".join(repr(x) if x else "<root>" for x in items[:limit])
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")

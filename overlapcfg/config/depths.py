"""The depths: how far ahead each kind of collective runs. Declared once, in ``Depths``; everything else about
them is computed from that declaration.

- ``Depths``: the one declaration. Each field is a depth: its default, its docstring, and what it schedules
  (``Schedules``: direction, kind, the depth it follows when unset, its short label, the values the tuner tries).
  ``OverlapPolicy`` and ``TorchManualPolicy`` derive from it (``TorchManualPolicy`` pins each to its default).
- Derived from it, never written again:
  - ``DEPTH_OF``: ``(direction, kind) -> field``, what the scheduler (``overlapcfg.graph.schedule``), the report's
    table, the tuner's quick model and its search look a depth up in; ``DEPTH_FIELDS``, ``FOLLOWED``,
    ``DEPTH_LABELS``, ``SEARCHED_DEPTHS``.
  - ``DepthChanges``: every depth, optional: what a plan entry (``Bucket``) or an override (``ModuleOverride``)
    sets in place of the value below it.
  - ``DepthGrid``: the values ``overlapcfg.tune`` tries for each depth it searches (``TuneSpace``).
- ``settle``: the one rule for what a bucket's depths end up as, given who set what (an unset depth takes the value
  of the depth it follows); resolving a plan, applying an override and ``Depths.depth`` all use it.

A new depth is a field of ``Depths`` with its ``Schedules``, plus the scheduler placing it. The YAML names are the
field names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import Field
from pydantic.fields import FieldInfo

from overlapcfg.config.base import ConfigModel, Depth
from overlapcfg.errors import OverlapLookupError
from overlapcfg.kinds import BucketKind, Direction

__all__ = ["DEPTH_FIELDS", "DEPTH_LABELS", "DEPTH_OF", "FOLLOWED", "SEARCHED_DEPTHS", "DepthChanges", "DepthGrid",
           "Depths", "Schedules", "depth_field", "depths_of", "settle"]


@dataclass(frozen=True, slots=True)
class Schedules:
    """What a depth field of ``Depths`` schedules, as metadata on the field (``Annotated[Depth, Schedules(...)]``)."""

    direction: Direction
    kind: BucketKind
    label: str
    """How a tuner candidate's name abbreviates it (``fp2 bp3 rs1``)."""
    follows: str | None = None
    """Left unset (None), the depth takes this other depth's value."""
    searched: tuple[int, ...] = ()
    """The values ``overlapcfg.tune`` tries by default; empty: the tuner does not search this depth."""


class Depths(ConfigModel):
    """Prefetch depths and delays (FSDP2 ``set_modules_to_*_prefetch`` semantics), the same for every bucket. In
    schedule order (the report's table shows its columns in this order)."""

    forward_prefetch: Annotated[Depth, Schedules("forward", "all_gather", "fp", searched=(1, 2, 3, 4))] = 1
    """While bucket i computes in forward, the all-gathers of buckets i+1..i+k are in flight. 0: each all-gather
    is issued right before its own wait (no overlap). 1 reproduces torch's ``manual_overlap_bucketing``."""

    backward_prefetch: Annotated[Depth, Schedules("backward", "all_gather", "bp", searched=(1, 2, 3, 4))] = 1
    """The same as ``forward_prefetch`` for backward all-gathers (graphs with reshard-after-forward), walking the
    buckets in reverse order."""

    reduce_scatter_delay: Annotated[Depth, Schedules("backward", "reduce_scatter", "rs", searched=(1, 2, 3))] = 1
    """Bucket i's reduce-scatter wait is placed after the reduce-scatter starts of the next d buckets. 0: wait
    right after issue."""

    all_reduce_delay: Annotated[Depth | None, Schedules("backward", "all_reduce", "ar",
                                                        follows="reduce_scatter_delay")] = None
    """HSDP graphs: bucket i's gradient all-reduce (the replicate-group half of the reduction) has its wait
    placed after the all-reduce starts of the next d buckets. None: the same as ``reduce_scatter_delay``."""

    def depth(self, direction: str, kind: str) -> int:
        """The depth ``kind`` collectives in ``direction`` are scheduled with (``DEPTH_OF``), a followed depth's
        value where this one is unset (``settle``). ``KeyError`` for collectives no depth schedules."""
        name = depth_field(direction, kind)
        if name is None:
            raise OverlapLookupError(
                f"no depth schedules {direction} {kind} collectives; depths: {', '.join(DEPTH_FIELDS)}")
        return settle({key: (value, "") for key in DEPTH_FIELDS if (value := getattr(self, key)) is not None})[name][0]


def _schedules(field: FieldInfo) -> Schedules:
    found = [m for m in field.metadata if isinstance(m, Schedules)]
    if len(found) != 1:
        raise AssertionError("overlapcfg.config.depths: each field of Depths says what it schedules (Schedules)")
    return found[0]


_SCHEDULES: dict[str, Schedules] = {name: _schedules(field) for name, field in Depths.model_fields.items()}

DEPTH_OF: Mapping[tuple[Direction, BucketKind], str] = MappingProxyType(
    {(s.direction, s.kind): name for name, s in _SCHEDULES.items()})
"""The depth each (direction, kind) is scheduled with: a prefetch depth for all-gathers, a delay for the others.
In schedule order."""

DEPTH_FIELDS: tuple[str, ...] = tuple(_SCHEDULES)
"""The depth fields, in schedule order."""

FOLLOWED: Mapping[str, str] = MappingProxyType({name: s.follows for name, s in _SCHEDULES.items() if s.follows})
"""A depth left unset (None) takes this other depth's value: an HSDP all-reduce is delayed like the reduce-scatter
it is chained with, unless told otherwise."""

DEPTH_LABELS: Mapping[str, str] = MappingProxyType({name: s.label for name, s in _SCHEDULES.items()})
"""How a tuner candidate's name abbreviates each depth (``fp2 bp3 rs1``)."""

SEARCHED_DEPTHS: tuple[str, ...] = tuple(name for name, s in _SCHEDULES.items() if s.searched)
"""The depths the tuner searches, in schedule order."""


_BY_KEY: dict[tuple[str, str], str] = {key: name for key, name in DEPTH_OF.items()}


def depth_field(direction: str, kind: str) -> str | None:
    """The depth field scheduling ``kind`` collectives in ``direction`` (``DEPTH_OF``); None for collectives no
    depth schedules (forward reduce-scatters, all-to-all, ...)."""
    return _BY_KEY.get((direction, kind))


def settle(set_values: Mapping[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
    """Every depth's value and where it came from, given the ones somebody set (``name -> (value, source)``): a
    depth nobody set takes the value of the depth it follows (``FOLLOWED``), with that depth's name as its source,
    so a later change of the followed depth can tell it still follows. The one place this rule is applied."""
    out: dict[str, tuple[int, str]] = {}
    for name in DEPTH_FIELDS:  # a followed depth comes first (checked below, at import)
        if name in set_values:
            out[name] = set_values[name]
        elif name in FOLLOWED:
            out[name] = (out[FOLLOWED[name]][0], FOLLOWED[name])
        else:
            raise OverlapLookupError(f"depth {name!r} is set by nobody and follows no other depth")
    return out


def depths_of(policy: object) -> Depths | None:
    """The depths a strategy's policy sets for every bucket: the policy itself where it derives from ``Depths``
    (``OverlapPolicy``, ``TorchManualPolicy``); a third party's policy model declaring every depth that follows
    none, read by name (a followed one it lacks follows); None for a policy without depths (``AutoPolicy``): the
    defaults then."""
    if isinstance(policy, Depths):
        return policy
    fields = getattr(type(policy), "model_fields", {})
    if not all(name in fields for name in DEPTH_FIELDS if name not in FOLLOWED):
        return None
    return Depths.model_validate({name: getattr(policy, name) for name in DEPTH_FIELDS if name in fields})


def _derived_fields(make: Any) -> dict[str, Any]:
    """A class namespace's fields, one per depth, as ``make(name, schedules, field) -> (annotation, FieldInfo)``
    builds them (or None to leave the depth out). A type checker sees none of them, which is right: these classes
    are read by field name (``DepthChanges.changes``, ``getattr``), never by attribute."""
    built = {name: make(name, _SCHEDULES[name], field) for name, field in Depths.model_fields.items()}
    kept = {name: pair for name, pair in built.items() if pair is not None}
    return {"__annotations__": {name: annotation for name, (annotation, _) in kept.items()},
            **{name: info for name, (_, info) in kept.items()}}


class DepthChanges(ConfigModel):
    """The depths a plan entry or an override sets for the buckets it reaches; None keeps the value below it (the
    policy's; for an override, also a plan entry's or an earlier override's). One field per depth of ``Depths``,
    with its description."""

    locals().update(_derived_fields(lambda name, s, field: (
        "Depth | None", Field(None, description=f"For these buckets: {field.description}"))))

    def changes(self) -> dict[str, int]:
        """The depths set, by field name."""
        return {k: v for k in DEPTH_FIELDS if (v := getattr(self, k)) is not None}


class DepthGrid(ConfigModel):
    """The values ``overlapcfg.tune`` tries for each depth its quick model replays, every bucket alike (the
    per-bucket refinement departs from them): one field per depth of ``Depths`` whose ``Schedules`` lists values
    to try (HSDP all-reduces are not replayed, so not searched)."""

    locals().update(_derived_fields(lambda name, s, field: (
        "Annotated[tuple[Depth, ...], Field(min_length=1)]",
        Field(s.searched, description=f"Global {name.replace('_', ' ')} values to try.")) if s.searched else None))


if any(FOLLOWED.get(f) is not None and DEPTH_FIELDS.index(FOLLOWED[f]) > DEPTH_FIELDS.index(f) for f in FOLLOWED):
    raise AssertionError("overlapcfg.config.depths: a followed depth must come before its follower (settle)")

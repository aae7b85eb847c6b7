"""The depths: how far ahead each kind of collective runs. Declared here once, with the one table saying which
depth schedules which collectives.

- ``DEPTH_OF``: ``(direction, kind) -> field``. The scheduler (``overlapcfg.graph.schedule``), the report's
  table, the tuner's quick model and its search all look a depth up here.
- ``Depths``: the values themselves (a policy's, for every bucket). ``OverlapPolicy`` and ``TorchManualPolicy``
  derive from it (``TorchManualPolicy`` pins each field to its default, upstream's behaviour).
- ``DepthChanges``: the same fields, each optional: what a plan entry (``Bucket``) or an override
  (``ModuleOverride``) sets in place of the value below it.
- ``ResolvedDepths``: one bucket's effective values, the all-reduce delay filled in (``ResolvedBucket``).
- ``DepthGrid``: the values ``overlapcfg.tune`` tries for the depths its quick model replays (``TuneSpace``).

A new depth is a field in each of these classes and a row of ``DEPTH_OF`` (all in this file), plus the scheduler
placing it; everything else reads these. The YAML names are the field names.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated

from pydantic import Field

from overlapcfg.config.base import ConfigModel, Depth
from overlapcfg.errors import OverlapLookupError
from overlapcfg.kinds import BucketKind, Direction

__all__ = ["DEPTH_FIELDS", "DEPTH_OF", "FOLLOWED", "SEARCHED_DEPTHS", "DepthChanges", "DepthGrid", "Depths",
           "ResolvedDepths", "depth_field", "depths_of"]

DEPTH_OF: Mapping[tuple[Direction, BucketKind], str] = MappingProxyType({
    ("forward", "all_gather"): "forward_prefetch",
    ("backward", "all_gather"): "backward_prefetch",
    ("backward", "reduce_scatter"): "reduce_scatter_delay",
    ("backward", "all_reduce"): "all_reduce_delay",
})
"""The depth each (direction, kind) is scheduled with: a prefetch depth for all-gathers, a delay for the others.
In schedule order (the report's table shows its columns in this order)."""

DEPTH_FIELDS: tuple[str, ...] = tuple(DEPTH_OF.values())
"""The depth fields, in ``DEPTH_OF`` order."""

_BY_KEY: dict[tuple[str, str], str] = {key: name for key, name in DEPTH_OF.items()}

FOLLOWED: Mapping[str, str] = MappingProxyType({"all_reduce_delay": "reduce_scatter_delay"})
"""A depth left unset (None) takes this other depth's value: an HSDP all-reduce is delayed like the reduce-scatter
it is chained with, unless told otherwise."""


def depth_field(direction: str, kind: str) -> str | None:
    """The depth field scheduling ``kind`` collectives in ``direction`` (``DEPTH_OF``); None for collectives no
    depth schedules (forward reduce-scatters, all-to-all, ...)."""
    return _BY_KEY.get((direction, kind))


class Depths(ConfigModel):
    """Prefetch depths and delays (FSDP2 ``set_modules_to_*_prefetch`` semantics), the same for every bucket."""

    forward_prefetch: Depth = 1
    """While bucket i computes in forward, the all-gathers of buckets i+1..i+k are in flight. 0: each all-gather
    is issued right before its own wait (no overlap). 1 reproduces torch's ``manual_overlap_bucketing``."""

    backward_prefetch: Depth = 1
    """The same as ``forward_prefetch`` for backward all-gathers (graphs with reshard-after-forward), walking the
    buckets in reverse order."""

    reduce_scatter_delay: Depth = 1
    """Bucket i's reduce-scatter wait is placed after the reduce-scatter starts of the next d buckets. 0: wait
    right after issue."""

    all_reduce_delay: Depth | None = None
    """HSDP graphs: bucket i's gradient all-reduce (the replicate-group half of the reduction) has its wait
    placed after the all-reduce starts of the next d buckets. None: the same as ``reduce_scatter_delay``."""

    def depth(self, direction: str, kind: str) -> int:
        """The depth ``kind`` collectives in ``direction`` are scheduled with (``DEPTH_OF``), a followed depth's
        value where this one is unset. ``KeyError`` for collectives no depth schedules."""
        name = depth_field(direction, kind)
        if name is None:
            raise OverlapLookupError(
                f"no depth schedules {direction} {kind} collectives; depths: {', '.join(DEPTH_FIELDS)}")
        value = getattr(self, name)
        return getattr(self, FOLLOWED[name]) if value is None else value


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


class DepthChanges(ConfigModel):
    """The depths a plan entry or an override sets for the buckets it reaches; None keeps the value below it (the
    policy's; for an override, also a plan entry's or an earlier override's)."""

    forward_prefetch: Depth | None = None
    """Forward all-gather prefetch depth for these buckets."""
    backward_prefetch: Depth | None = None
    """Backward all-gather prefetch depth for these buckets."""
    reduce_scatter_delay: Depth | None = None
    """Reduce-scatter delay for these buckets."""
    all_reduce_delay: Depth | None = None
    """HSDP all-reduce delay for these buckets (by default they follow the reduce-scatter delay)."""

    def changes(self) -> dict[str, int]:
        """The depths set, by field name."""
        return {k: v for k in DEPTH_FIELDS if (v := getattr(self, k)) is not None}


class ResolvedDepths(Depths):
    """One bucket's effective depths: every one set (a followed depth is filled in with the value it follows)."""

    all_reduce_delay: Depth = 1
    """HSDP all-reduce delay (``OverlapPolicy.all_reduce_delay``); the reduce-scatter delay unless set."""


class DepthGrid(ConfigModel):
    """The values ``overlapcfg.tune`` tries for each depth its quick model replays, every bucket alike (the
    per-bucket refinement departs from them). HSDP all-reduces are not replayed, so not searched."""

    forward_prefetch: Annotated[tuple[Depth, ...], Field(min_length=1)] = (1, 2, 3, 4)
    """Global forward prefetch depths to try."""

    backward_prefetch: Annotated[tuple[Depth, ...], Field(min_length=1)] = (1, 2, 3, 4)
    """Global backward prefetch depths to try."""

    reduce_scatter_delay: Annotated[tuple[Depth, ...], Field(min_length=1)] = (1, 2, 3)
    """Global reduce-scatter delays to try."""


SEARCHED_DEPTHS: tuple[str, ...] = tuple(DepthGrid.model_fields)
"""The depths the tuner searches, in ``DEPTH_OF`` order."""

if tuple(Depths.model_fields) != DEPTH_FIELDS or tuple(DepthChanges.model_fields) != DEPTH_FIELDS \
        or not set(SEARCHED_DEPTHS) <= set(DEPTH_FIELDS):
    raise AssertionError("overlapcfg.config.depths: DEPTH_OF, Depths, DepthChanges and DepthGrid name different "
                         "fields; a new depth goes in all of them")  # a bug check on this file, run at import

"""The records plan resolution produces: resolved buckets with their depths, and the plan that holds them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict

from overlapcfg.config.depths import DEPTH_FIELDS, Depths
from overlapcfg.errors import OverlapLookupError, closest
from overlapcfg.module_paths import ancestors, strip_wrappers
from overlapcfg.resolve.matcher import show

__all__ = ["DEPTH_FIELDS", "RecordModel", "ResolvedBucket", "ResolvedPlan"]


class RecordModel(BaseModel):
    """Base of every record overlapcfg derives (a resolved bucket, a pass record, a report): frozen, no unknown
    fields, so a reader accepts exactly what a writer wrote and records are safe to share."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class _Placed(RecordModel):
    """Which bucket and where it came from (``ResolvedBucket`` holds these fields first, then its depths)."""

    name: str
    modules: tuple[str, ...]
    entry_index: int
    """Position of the plan entry that produced the bucket (``plan.buckets[i]``)."""
    entry_text: str
    """That entry as the user wrote it: ``layers.*``."""


class ResolvedBucket(Depths, _Placed):
    """One bucket: concrete modules (wrappers stripped, model order), where it came from, its effective depths
    (``overlapcfg.config.depths.Depths``, every one filled in by ``settle``: a followed depth holds the value it
    follows).

    Defined once here; the pass extends it with what it found in a graph (``overlapcfg.graph.record.BucketRecord``),
    and that is also what a report holds.
    """

    overridden_by: tuple[str, ...] = ()
    """Paths of the overrides that set a value here, in the order applied (``overrides[1]``)."""
    origins: tuple[tuple[str, str], ...] = ()
    """``(field, source)`` for each depth: ``policy``, the entry's path, or the winning override's path."""

    def origin(self, name: str) -> str:
        """Where the effective value of depth field ``name`` came from."""
        for key, source in self.origins:
            if key == name:
                return source
        raise OverlapLookupError(f"{name!r} is not a depth field; expected one of {', '.join(DEPTH_FIELDS)}")


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
        for candidate in (fqn, *reversed(ancestors(fqn))):
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
        hint = show(closest(name, [b.name for b in self.buckets])) or "none close"
        raise OverlapLookupError(f"no bucket named {name!r} (closest: {hint})")

    def module_lists(self) -> list[list[str]]:
        """The plan as torch's ``manual_overlap_bucketing`` takes it: one list of FQNs per bucket."""
        return [list(b.modules) for b in self.buckets]

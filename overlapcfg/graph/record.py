"""What a pass did, kept on the graph module (``gm.meta["overlapcfg"]``) for reports and tests.

Frozen records with tuples inside: they are written once, at the end of ``apply``, and only read after.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from overlapcfg.graph.meta import META_KEY
from overlapcfg.graph.collectives import Collective
from overlapcfg.graph.schedule import StepRecord

__all__ = ["RECORD_KEY", "BucketRecord", "CollectiveCounts", "PassRecord", "count_collectives"]

RECORD_KEY = META_KEY


@dataclass(frozen=True, slots=True)
class CollectiveCounts:
    """FSDP collectives per (direction, kind), e.g. ``{("forward", "all_gather"): 9}``, plus non-FSDP ones."""

    fsdp: tuple[tuple[str, str, int], ...]
    other: int

    def get(self, direction: str, kind: str) -> int:
        return next((n for d, k, n in self.fsdp if (d, k) == (direction, kind)), 0)

    @property
    def total_fsdp(self) -> int:
        return sum(n for _, _, n in self.fsdp)


def count_collectives(collectives: Iterable[Collective]) -> CollectiveCounts:
    counts: Counter[tuple[str, str]] = Counter()
    other = 0
    for c in collectives:
        if c.fsdp:
            counts[(c.direction, c.kind)] += 1
        else:
            other += 1
    return CollectiveCounts(tuple((d, k, n) for (d, k), n in sorted(counts.items())), other)


@dataclass(frozen=True, slots=True)
class BucketRecord:
    name: str
    entry_index: int
    entry_text: str
    modules: tuple[str, ...]
    params: tuple[str, ...]
    """Placeholder names of the parameters this bucket's collectives carried (graph order)."""
    before: tuple[tuple[str, str, int], ...]
    """Collectives per (direction, kind) before merging."""
    after: tuple[tuple[str, str, int], ...]
    """... and after."""
    unsharded_bytes: tuple[tuple[str, str, int], ...]
    """Unsharded bytes moved per (direction, kind)."""
    forward_prefetch: int
    backward_prefetch: int
    reduce_scatter_delay: int
    overridden_by: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PassRecord:
    strategy: str
    graph_kind: str
    buckets: tuple[BucketRecord, ...]
    steps: tuple[StepRecord, ...]
    """Scheduler decisions (``manual`` only): requested vs effective depth per bucket and direction."""
    before: CollectiveCounts
    after: CollectiveCounts
    uncovered: tuple[tuple[str, str | None], ...]
    """FSDP collectives in no bucket: (node name, owning module)."""
    non_fsdp: tuple[str, ...]
    """Collectives that are not FSDP's, left where data dependencies put them."""
    seconds: float
    notes: tuple[str, ...] = field(default=())
    """Anything skipped or worth knowing, one line each."""

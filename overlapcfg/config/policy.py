"""Policies: *how far ahead* collectives are issued. Which modules share a collective lives in ``plan.py``.

Each strategy declares its own policy model (``overlapcfg.config.contracts``); the policy in a config is validated
against the selected strategy's class, so a knob a strategy would ignore is rejected instead. A policy model is also
where a strategy's rules on depths live: a plan entry's or an override's depth is validated against the field of the
same name (``OverlapConfig._entries_within_policy``), so ``TorchManualPolicy``'s fixed depth of 1 holds there too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator
from pydantic_core import PydanticCustomError

from overlapcfg.config.base import ByteCount, ConfigModel, Depth

__all__ = ["AutoPolicy", "BucketMode", "IssueOrder", "MergeableKind", "OverlapPolicy", "PolicyBase",
           "TorchManualPolicy"]

BucketMode = Literal["default", "custom_ops", "custom_ops_multidtype", "coalesced"]
"""How merged collectives are emitted; the same names as ``torch._inductor.fx_passes.bucketing.BucketMode``."""

MergeableKind = Literal["all_gather", "reduce_scatter", "all_reduce"]
"""Collective kinds a bucket merges (``OverlapPolicy.unmerged`` leaves some as they are)."""

IssueOrder = Literal["gather_first", "reduce_scatter_first"]
"""Which of an all-gather prefetched far ahead and a reduce-scatter issued after it goes first on the shared
communication stream (``OverlapPolicy.issue_order``)."""


class PolicyBase(ConfigModel):
    """Base class of every strategy's policy model (third-party strategies subclass it)."""


class OverlapPolicy(PolicyBase):
    """Prefetch depths and delays for the ``manual`` scheduler (FSDP2 ``set_modules_to_*_prefetch`` semantics)."""

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

    max_inflight_bytes: ByteCount | None = None
    """Cap on the unsharded bytes of all-gathers issued but not yet waited. Where it binds, the effective depth
    shrinks (never below 0) and the pass record says where. None: no cap."""

    issue_order: IssueOrder = "gather_first"
    """All-gathers and reduce-scatters of one process group share one communication stream, first issued first
    served. ``gather_first``: an all-gather is issued where its prefetch depth puts it, ahead of every
    reduce-scatter issued later. ``reduce_scatter_first``: an all-gather prefetched two or more buckets ahead is
    issued just after the next reduce-scatter, when that comes before the previous bucket computes, so gradient
    reduction does not queue behind gathers not yet needed. Depth-1 graphs are the same either way."""

    insert_overlap_deps: bool = False
    """Wrap waits in control dependencies so a later compiler (inductor) keeps our order."""

    bucket_mode: BucketMode = "custom_ops"
    """How a bucket's collectives are merged; ``custom_ops`` is what torch's manual pass uses."""

    unmerged: tuple[MergeableKind, ...] = ()
    """Collective kinds a bucket leaves one per parameter, as traced: still scheduled with their bucket (prefetched
    by its depth, delayed by its delay, counted against the cap) but not merged, so they need no copy into and
    out of a bucket buffer, at the price of one collective's latency per parameter. ``[reduce_scatter]``: merged
    all-gathers, per-parameter gradient reductions. Empty: every kind merged (torch's manual pass)."""

    @field_validator("unmerged")
    @classmethod
    def _unmerged_once_each(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise PydanticCustomError("unmerged_repeated", "each kind at most once, got {got}", {"got": list(value)})
        return tuple(sorted(value))


def _fixed_at_one(value: Any) -> int:
    if value != 1 or isinstance(value, bool):
        raise PydanticCustomError(
            "torch_manual_depth",
            "torch_manual has a fixed depth of 1 (upstream manual_overlap_bucketing), got {got}; "
            "use strategy 'manual' for other depths",
            {"got": repr(value)},
        )
    return 1


def _unsupported(value: Any) -> None:
    if value is not None:
        raise PydanticCustomError(
            "torch_manual_cap",
            "torch_manual has no in-flight cap (upstream manual_overlap_bucketing), got {got}; "
            "use strategy 'manual' for a cap",
            {"got": repr(value)},
        )


def _gather_first(value: Any) -> str:
    if value != "gather_first":
        raise PydanticCustomError(
            "torch_manual_issue_order",
            "torch_manual issues all-gathers where its depth of 1 puts them (issue_order 'gather_first', the only "
            "order at depth 1), got {got}; use strategy 'manual' to choose the order",
            {"got": repr(value)},
        )
    return value


def _no_all_reduces(value: Any) -> None:
    if value is not None:
        raise PydanticCustomError(
            "torch_manual_all_reduce",
            "torch_manual has no all_reduce_delay (upstream manual_overlap_bucketing skips HSDP all-reduces before "
            "torch 2.14 and from 2.14 buckets them with the reduce-scatters at their fixed delay of 1), got {got}; "
            "use strategy 'manual' for all_reduce_delay",
            {"got": repr(value)},
        )


_FixedAtOne = Annotated[int, BeforeValidator(_fixed_at_one)]
_NoAllReduces = Annotated[None, BeforeValidator(_no_all_reduces)]
_Unsupported = Annotated[None, BeforeValidator(_unsupported)]
_GatherFirst = Annotated[str, BeforeValidator(_gather_first)]


class TorchManualPolicy(PolicyBase):
    """Policy of ``torch_manual``: upstream ``manual_overlap_bucketing`` has a fixed depth of 1 and no cap.

    The depth fields exist so a config written for ``manual`` at the defaults also runs the reference; any other
    value is rejected rather than silently ignored.
    """

    forward_prefetch: _FixedAtOne = 1
    """Fixed at 1 upstream."""
    backward_prefetch: _FixedAtOne = 1
    """Fixed at 1 upstream."""
    reduce_scatter_delay: _FixedAtOne = 1
    """Fixed at 1 upstream."""
    all_reduce_delay: _NoAllReduces = None
    """Upstream leaves HSDP all-reduces alone before torch 2.14 and delays them by 1 from 2.14: unset only (so the
    shipped policy presets, which list it, apply)."""
    max_inflight_bytes: _Unsupported = None
    """Not supported upstream."""
    issue_order: _GatherFirst = "gather_first"
    """Fixed upstream (at depth 1 both orders give the same graph)."""
    insert_overlap_deps: bool = False
    """Passed through to upstream."""
    bucket_mode: BucketMode = "custom_ops"
    """Passed through to upstream."""


class AutoPolicy(PolicyBase):
    """Knobs of torch's automatic scheduler ``schedule_overlap_bucketing`` (same names, same defaults).

    The estimators default to "analytical": "benchmark" needs CUDA.
    """

    max_in_flight_gb: float = Field(5.0, gt=0)
    """Maximum GB of concurrent collective data."""
    max_compute_pre_fetch: int = Field(200, ge=0)
    """Maximum compute nodes to prefetch across."""
    compute_overlap_multipler: float = Field(1.0, ge=0)
    """Scale on compute time used to hide collectives (upstream's spelling)."""
    max_coll_distance: int = Field(200, ge=0)
    """Maximum prefetch or bucketing candidates."""
    collective_bucketing: bool = False
    """Enable overlap-preserving collective bucketing."""
    max_memory_increase_gb: float | None = Field(1.0, ge=0)
    """Absolute cap on the memory increase from prefetching; None disables it."""
    max_memory_increase_ratio: float | None = Field(0.05, ge=0)
    """Relative cap on the memory increase from prefetching; None disables it."""
    insert_overlap_deps: bool = False
    """Wrap waits in control dependencies so inductor keeps the order."""
    bucket_mode: BucketMode | None = None
    """None: inductor's configured default."""
    collective_estimator: Literal["analytical", "benchmark"] = "analytical"
    """How collective runtimes are estimated."""
    compute_estimator: Literal["analytical", "benchmark"] = "analytical"
    """How compute runtimes are estimated ("benchmark" needs CUDA)."""

"""Policies: *how far ahead* collectives are issued. Which modules share a collective lives in ``plan.py``.

The depths themselves are declared in ``overlapcfg.config.depths``. Each strategy declares its own policy model
(``overlapcfg.config.contracts``); the policy in a config is validated against the selected strategy's class, so a
knob a strategy would ignore is rejected instead. A policy model is also
where a strategy's rules on depths live: a plan entry's or an override's depth is validated against the field of the
same name (``OverlapConfig._entries_within_policy``), so ``TorchManualPolicy``'s fixed depth of 1 holds there too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from overlapcfg.config.base import ByteCount, ConfigModel
from overlapcfg.config.depths import DEPTH_FIELDS, Depths
from overlapcfg.kinds import BucketKind

__all__ = ["AutoPolicy", "BucketMode", "IssueOrder", "OverlapPolicy", "PolicyBase", "TorchManualPolicy"]

BucketMode = Literal["default", "custom_ops", "custom_ops_multidtype", "coalesced"]
"""How merged collectives are emitted; the same names as ``torch._inductor.fx_passes.bucketing.BucketMode``."""

IssueOrder = Literal["gather_first", "reduce_scatter_first"]
"""Which of an all-gather prefetched far ahead and a reduce-scatter issued after it goes first on the shared
communication stream (``OverlapPolicy.issue_order``)."""


class PolicyBase(ConfigModel):
    """Base class of every strategy's policy model (third-party strategies subclass it)."""


class OverlapPolicy(PolicyBase, Depths):
    """Prefetch depths and delays for the ``manual`` scheduler (FSDP2 ``set_modules_to_*_prefetch`` semantics): the
    depths (``overlapcfg.config.depths.Depths``), then how in-flight bytes are capped and collectives ordered."""

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

    unmerged: tuple[BucketKind, ...] = ()
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


_FIXED_AT_ONE = ("torch_manual_depth", "torch_manual has a fixed depth of 1 (upstream manual_overlap_bucketing), "
                                       "got {got}; use strategy 'manual' for other depths")
_PINNED_MESSAGES = {
    "all_reduce_delay": ("torch_manual_all_reduce", "torch_manual has no all_reduce_delay (upstream "
                         "manual_overlap_bucketing skips HSDP all-reduces before torch 2.14 and from 2.14 buckets "
                         "them with the reduce-scatters at their fixed delay of 1), got {got}; use strategy 'manual' "
                         "for all_reduce_delay"),
}
"""What a value other than upstream's says, by depth; the others read ``_FIXED_AT_ONE``."""


def _pinned(name: str, value: Any) -> Any:
    """``value`` if it is ``Depths``' default for depth ``name`` (upstream's only value), else the error."""
    default = Depths.model_fields[name].default
    if value == default and not isinstance(value, bool):
        return default
    kind, message = _PINNED_MESSAGES.get(name, _FIXED_AT_ONE)
    raise PydanticCustomError(kind, message, {"got": repr(value)})


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


_Unsupported = Annotated[None, BeforeValidator(_unsupported)]
_GatherFirst = Annotated[str, BeforeValidator(_gather_first)]


class TorchManualPolicy(PolicyBase, Depths):
    """Policy of ``torch_manual``: upstream ``manual_overlap_bucketing`` has a fixed depth of 1 and no cap.

    The depth fields exist so a config written for ``manual`` at the defaults also runs the reference; any other
    value is rejected rather than silently ignored: each depth is pinned to its default (1; the all-reduce delay
    unset, since upstream leaves HSDP all-reduces alone before torch 2.14 and delays them by 1 from 2.14, so the
    shipped policy presets, which list it, apply).
    """

    max_inflight_bytes: _Unsupported = None
    """Not supported upstream."""
    issue_order: _GatherFirst = "gather_first"
    """Fixed upstream (at depth 1 both orders give the same graph)."""
    insert_overlap_deps: bool = False
    """Passed through to upstream."""
    bucket_mode: BucketMode = "custom_ops"
    """Passed through to upstream."""

    @field_validator(*DEPTH_FIELDS, mode="before")
    @classmethod
    def _upstream_depths(cls, value: Any, info: ValidationInfo) -> Any:
        return _pinned(str(info.field_name), value)


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

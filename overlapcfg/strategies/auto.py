"""``auto``: upstream's automatic ``schedule_overlap_bucketing``, its knobs validated by ``AutoPolicy``."""

from __future__ import annotations

from torch import fx

from overlapcfg import compat
from overlapcfg.config.policy import AutoPolicy
from overlapcfg.errors import OverlapUsageError
from overlapcfg.strategies.interface import PassContext, StrategyResult, this_torch_supports, torch_pass_failures

__all__ = ["run"]


def run(gm: fx.GraphModule, ctx: PassContext) -> StrategyResult:
    """Upstream's scheduler, with the ordering hints it adds that would form a cycle dropped rather than raised as
    torch's ``RuntimeError`` (``collective_bucketing`` on an HSDP backward that reduce-scatters first makes them):
    they only guide overlap, the record says how many were dropped, and ``apply`` verifies the result.

    The knobs are torch 2.13's; on an older torch ``compat.schedule_overlap_bucketing`` maps them (2.11 has no
    ``compute_estimator``: "analytical" is passed as its custom estimate) or refuses one it cannot honour (a
    ``bucket_mode`` on 2.11) as a config error at ``policy.<knob>``. Torch 2.11's scheduler also does not
    pre-bucket FSDP collectives, so its graphs differ from 2.13's for the same knobs."""
    if not isinstance(ctx.policy, AutoPolicy):
        raise OverlapUsageError(f"auto: expected an AutoPolicy, got {type(ctx.policy).__name__}")
    with compat.upstream_scheduler_scope(drop_cyclic_hints=True) as upstream, this_torch_supports(), \
            torch_pass_failures("auto"):
        compat.schedule_overlap_bucketing(gm, **ctx.policy.model_dump())
    notes = tuple(f"auto: torch's scheduler made ordering hints that form a cycle and they were dropped (overlap "
                  f"may be less than it planned; the graph is still verified): {message}"
                  for message in upstream.dropped_cyclic_hints)
    return StrategyResult(notes=notes)

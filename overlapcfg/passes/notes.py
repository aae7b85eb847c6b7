"""What a pass says in its record besides its buckets: settings the strategy ignores (never dropped silently) and
waits it folded. Pure functions of the config and the graph's facts (``overlapcfg.passes.pipeline`` adds them to the
``PassRecord``'s notes).
"""

from __future__ import annotations

from collections.abc import Sequence

from overlapcfg.config import OverlapConfig
from overlapcfg.strategies import Strategy

__all__ = ["folded_waits", "ignored_settings"]


def ignored_settings(cfg: OverlapConfig, strategy: Strategy, root: str) -> tuple[str, ...]:
    """Settings the selected strategy does not read, written by the user: never silently dropped."""
    notes = []
    if not strategy.uses_plan and cfg.plan is not None and cfg.plan.buckets:
        notes.append(f"{root}.plan is ignored: strategy {cfg.strategy!r} does not bucket by plan")
    if not strategy.uses_plan and cfg.overrides:
        notes.append(f"{root}.overrides are ignored: strategy {cfg.strategy!r} does not bucket by plan")
    if not strategy.reads_policy and cfg.policy != type(cfg.policy)():
        notes.append(f"{root}.policy is ignored: strategy {cfg.strategy!r} reads no policy")
    if not strategy.uses_plan:
        notes += [f"{s.path(root)} is ignored: strategy {cfg.strategy!r} does not bucket by plan"
                  for s in cfg.settings("reshard_after_forward", sites=("plan",))]
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

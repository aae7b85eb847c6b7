"""The tuner's baselines and cross-checks: any manual-style config scored by the quick model through its own
resolution (``resolve_config``), not as a point of the search grid. ``score_presets`` scores every shipped plan x
policy preset and ``torch_manual`` per plan that fits the model (so a tuned config is never worse than a preset the
budget allows); ``score_config`` also re-scores the winner from the config it emits (``search._check_config``).
"""

from __future__ import annotations

from overlapcfg.config import OverlapConfig, load_config, preset_names
from overlapcfg.config.depths import DEPTH_FIELDS, SEARCHED_DEPTHS, Depths, depths_of
from overlapcfg.config.policy import IssueOrder
from overlapcfg.errors import OverlapConfigError
from overlapcfg.passes.backend import CapturedStep
from overlapcfg.resolve import ResolvedPlan, resolve_config
from overlapcfg.tuning.candidates import Candidate, Knobs
from overlapcfg.tuning.merged import group
from overlapcfg.tuning.profile import Profile
from overlapcfg.tuning.quick import Stall, score
from overlapcfg.tuning.step_cache import cached

__all__ = ["score_config", "score_presets", "unit_buckets"]


def score_presets(step: CapturedStep, profile: Profile) -> tuple[list[Candidate], tuple[str, ...]]:
    """Every shipped plan x manual policy preset, and ``torch_manual`` per plan, that fits the model."""
    names = (preset_names("plan"), preset_names("policy"))
    fitting, skipped = cached(step, ("presets", names), lambda: _fitting_presets(step, names))
    return [score_config(name, cfg, resolved, profile) for name, cfg, resolved in fitting], skipped


def _fitting_presets(step: CapturedStep, names: tuple[tuple[str, ...], tuple[str, ...]],
                     ) -> tuple[tuple[tuple[str, OverlapConfig, ResolvedPlan], ...], tuple[str, ...]]:
    """The presets that fit the model, resolved, and why each other one is left out: the model's alone, so made
    once per step (``overlapcfg.tuning.step_cache``)."""
    out: list[tuple[str, OverlapConfig, ResolvedPlan]] = []
    skipped: list[str] = []
    plans, policies = names
    for plan in plans:
        for policy in (*policies, None):
            name = f"torch_manual {plan}" if policy is None else f"{plan} / {policy}"
            try:
                cfg = load_config({"strategy": "torch_manual", "plan": plan} if policy is None
                                  else {"plan": plan, "policy": policy})
                if cfg.strategy not in ("manual", "torch_manual"):  # policy auto selects its own strategy
                    skipped.append(f"{name}: strategy {cfg.strategy!r} (the quick model replays plan schedules)")
                    continue
                resolved = resolve_config(cfg, step.facts)
            except OverlapConfigError as err:
                skipped.append(f"{name}: {err.faults[0].message}")
                continue
            if resolved.uncovered:
                skipped.append(f"{name}: leaves {len(resolved.uncovered)} parameter owners unbucketed (their "
                               "collectives stay as traced, which the quick model does not replay)")
                continue
            out.append((name, cfg, resolved))
    return tuple(out), tuple(dict.fromkeys(skipped))


def score_config(name: str, cfg: OverlapConfig, resolved: ResolvedPlan, profile: Profile,
                  stalls: list[Stall] | None = None) -> Candidate:
    """Any manual-style config, through its own resolution (presets; the winner's cross-check)."""
    names = [b.name for b in resolved.buckets]
    policy = cfg.policy
    grouped = group(profile, unit_buckets(resolved, profile, name), names, getattr(policy, "unmerged", ()))
    order: IssueOrder = getattr(policy, "issue_order", "gather_first")
    cap = getattr(policy, "max_inflight_bytes", None)
    depths = Depths(**(depths_of(policy) or Depths()).model_dump(include=set(DEPTH_FIELDS)))
    s = score(grouped, {name: [getattr(b, name) for b in resolved.buckets] for name in SEARCHED_DEPTHS},
              max_inflight_bytes=cap, issue_order=order, memory=True, stalls=stalls)
    knobs = Knobs(depths, order, cap)
    return Candidate(name, -1, knobs, s, cfg)


def unit_buckets(resolved: ResolvedPlan, profile: Profile, what: str) -> list[int]:
    """The bucket of each profile unit; every unit has one (configs leaving owners out are skipped before)."""
    found = [resolved.bucket_index(u) for u in profile.units]
    if any(b is None for b in found):  # a bug check: uncovered plans never reach scoring
        raise AssertionError(f"tune: {what} leaves parameter owners unbucketed")
    return [b for b in found if b is not None]

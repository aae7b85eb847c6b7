"""``overlapcfg.tune``: search groupings and schedules with the quick model, under a budget on in-flight bytes.

The search, in order:

1. profile the step once (``overlapcfg.tuning.profile``: one real ``apply`` of the finest grouping);
2. resolve each grouping of the space to a plan and merge the profile by it (an *arm*);
3. score the grid: every arm (grouping, and which kinds stay unmerged) x forward depth x backward depth x
   reduce-scatter delay x issue order x cap, plus every shipped plan x policy preset and ``torch_manual`` that fits
   the model, plus the strategies that schedule by their own rules, applied for real and simulated
   (``overlapcfg.tuning.competitors``: ``none``, torch's ``auto`` with and without its bucketing); so the winner is
   never predicted slower than anything the user could pick instead that the budget allows;
4. refine the best few, bucket by bucket: where the replay shows compute waiting on an all-gather, prefetch it
   from further back; where it waits on a reduce-scatter, delay that wait; keep the best move, repeat;
5. pick the winner within the budget: of the candidates within ``TIE_TOLERANCE`` (0.1 %) of the fastest step and
   no slower than any preset or competitor, the one with the fewest bytes in flight (then the fastest, then the
   fewest per-bucket exceptions), and re-check it the slow way: a real ``apply`` (verified) and ``simulate``, which
   must agree within 1 %.

Deterministic: the grid is enumerated in a fixed order (sampled with ``space.seed`` only when larger than
``space.max_candidates``), and ties are broken by that order.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import random
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from overlapcfg.config.base import ByteCount, RankCount
from overlapcfg.config.depths import SEARCHED_DEPTHS, Depths, depth_field
from overlapcfg.config.load import validate_value
from overlapcfg.cost.hardware import HardwareProfile, load_hardware
from overlapcfg.cost.node_costs import NodeCosts
from overlapcfg.cost.pricing import Pricing, pricing_from
from overlapcfg.cost.pricing_plan import StepPlan, step_plans_kept
from overlapcfg.cost.throughput import StepFacts
from overlapcfg.errors import OverlapConfigError
from overlapcfg.graph.agreement import decided_on_rank_zero
from overlapcfg.passes.backend import CapturedStep
from overlapcfg.passes.gc_paused import cyclic_gc_paused
from overlapcfg.report.compare import compare_reports
from overlapcfg.report.explain import explain
from overlapcfg.report.labels import fmt_bytes, fmt_seconds
from overlapcfg.resolve import resolve_config
from overlapcfg.tuning.baselines import score_config, score_presets, unit_buckets
from overlapcfg.tuning.candidates import TIE_TOLERANCE, Arm, Candidate, Knobs, choose, describe, pareto
from overlapcfg.tuning.competitors import COMPETITORS, competitors, lower_bound
from overlapcfg.tuning.merged import group
from overlapcfg.tuning.profile import Profile, build_profile
from overlapcfg.tuning.quick import Stall
from overlapcfg.tuning.space import TuneSpace, load_space
from overlapcfg.tuning.step_cache import cached, fingerprinted
from overlapcfg.tuning.structure import Grouping, Structure, find_structure, plan_for
from overlapcfg.tuning.tune_result import AGREEMENT, TuneResult, Verification

__all__ = ["TuneProgress", "tune"]

log = logging.getLogger(__name__)

LOOKBACK = 4
"""How many buckets before a stalled all-gather the refinement tries to issue it from."""


@dataclass(frozen=True, slots=True)
class TuneProgress:
    """Where a search stands, for a progress display."""

    phase: str
    done: int
    total: int
    best_seconds: float | None
    elapsed: float


ProgressFn = Callable[[TuneProgress], None]


def tune(step: CapturedStep, *, hardware: HardwareProfile | str, world_size: int | None = None,
         memory_budget: int | str | None = None, space: TuneSpace | Mapping[str, Any] | str | None = None,
         as_dtype: torch.dtype | None = None, progress: ProgressFn | None = None, verify: bool = True,
         config_root: str | None = None, node_costs: NodeCosts | None = None,
         pricing: Pricing | Mapping[str, Any] | None = None, pricing_path: str | None = None) -> TuneResult:
    """Search the ``space`` of plans and schedules for ``step`` on ``hardware`` at ``world_size`` ranks (default:
    the trace's) for the fastest predicted step whose peak in-flight all-gather bytes stay within
    ``memory_budget`` (bytes or ``"4GiB"``; None, the default: no memory budget, and the result says so). Steps
    within ``TIE_TOLERANCE`` (0.1 %) of the fastest are a tie, won by the candidate with the fewest bytes in flight
    (``TuneResult.fastest`` keeps the fastest).

    ``as_dtype`` costs floating tensors as that dtype (``torch.bfloat16``: mixed precision from an fp32 trace).
    ``verify``: re-check the winner by a real apply + verify + simulate (the quick score must agree within 1 %).
    ``config_root``: where the caller's tune settings sit (``tune``), so faults read ``tune.memory_budget``.
    ``node_costs``: measured node durations (``overlapcfg.cost.node_costs``, best of the untransformed step)
    priced instead of the kernel model, by the search and by the winner's full check alike. ``pricing``:
    checkpointing, fusion, optimizer, attention backend, tokens (``overlapcfg.cost.pricing.Pricing``), likewise;
    its faults are reported under ``pricing_path`` (default ``<config_root>.pricing``).
    A budget no candidate fits raises ``OverlapConfigError`` naming the smallest feasible budget.

    In a job of several ranks (a real process group), rank 0 searches and every rank returns rank 0's result
    (``overlapcfg.graph.agreement``): the tuned config is the same on every rank by construction, whatever each
    rank's hardware profile, node costs or tie-breaking would say. Call it on every rank alike; ``progress`` is
    reported on rank 0.
    """
    return decided_on_rank_zero("tune", lambda: _search(
        step, hardware=hardware, world_size=world_size, memory_budget=memory_budget, space=space, as_dtype=as_dtype,
        progress=progress, verify=verify, settings_at=f"{config_root}." if config_root else "", node_costs=node_costs,
        pricing=pricing, pricing_path=pricing_path))


def _search(step: CapturedStep, *, hardware: HardwareProfile | str, world_size: int | None,
            memory_budget: int | str | None, space: TuneSpace | Mapping[str, Any] | str | None,
            as_dtype: torch.dtype | None, progress: ProgressFn | None, verify: bool, settings_at: str,
            node_costs: NodeCosts | None, pricing: Pricing | Mapping[str, Any] | None = None,
            pricing_path: str | None = None) -> TuneResult:
    """``tune`` on this rank alone; ``settings_at``: the prefix of the tune settings' paths in faults.

    Python's cyclic collector is paused for the search (``overlapcfg.passes.gc_paused``): scoring keeps thousands of
    candidates and replays alive, which makes the collector run full collections, and each walks every object of
    the process (the traced step, and the applied graphs ``overlapcfg.tuning.step_cache`` keeps); reference counting
    frees the rest as before, and cycles left behind go once it resumes. The step's fingerprint, which guards that
    cache, is taken once for the search (``fingerprinted``)."""
    with cyclic_gc_paused(), fingerprinted(step):
        return _search_paused(step, hardware=hardware, world_size=world_size, memory_budget=memory_budget,
                              space=space, as_dtype=as_dtype, progress=progress, verify=verify,
                              settings_at=settings_at, node_costs=node_costs, pricing=pricing,
                              pricing_path=pricing_path)


def _search_paused(step: CapturedStep, *, hardware: HardwareProfile | str, world_size: int | None,
                   memory_budget: int | str | None, space: TuneSpace | Mapping[str, Any] | str | None,
                   as_dtype: torch.dtype | None, progress: ProgressFn | None, verify: bool, settings_at: str,
                   node_costs: NodeCosts | None, pricing: Pricing | Mapping[str, Any] | None,
                   pricing_path: str | None) -> TuneResult:
    started = time.perf_counter()
    prefix = settings_at
    space = load_space(space, root=f"{prefix}space")
    budget = None if memory_budget is None else validate_value(ByteCount, memory_budget, path=f"{prefix}memory_budget")
    hw = load_hardware(hardware)
    # 0 is not "the traced size": None is. A size a cluster cannot have is a fault, not a search at -4 ranks.
    ws = step.world_size if world_size is None else validate_value(RankCount, world_size, path=f"{prefix}world_size")
    report = _Reporter(progress, started)
    report("profile", 0, 1, None)
    where = pricing_path or f"{prefix}pricing"
    # The graphs the profile and the competitors price are the step cache's, unchanged from search to search: their
    # pricing plans are kept with them (the winner's check prices a new graph each time, and keeps nothing).
    kept: dict[Hashable, StepPlan] = cached(step, "step plans", dict)
    with step_plans_kept(kept):
        profile = build_profile(step, hw, world_size=ws, as_dtype=as_dtype, node_costs=node_costs,
                                pricing=pricing_from(pricing, path=where), pricing_path=where)
    structure = find_structure(step.module_fqns, step.param_owners, space, root=f"{prefix}space",
                               module_types=step.module_types, facts=_unit_facts(profile))
    if structure.found:
        log.info("tune: from the module tree: %s", structure.found)
    space = _as_searched(space, structure)
    arms = _arms(profile, structure, _groupings(space, structure, f"{prefix}space"), step)
    caps = list(dict.fromkeys((*space.max_inflight_bytes,
                               *((_traced(budget, profile),) if budget is not None and space.cap_at_budget else ()))))
    grid = _grid(arms, space, caps)
    scored: list[Candidate] = []
    for i, (a, knobs) in enumerate(grid):
        arm = arms[a]
        scored.append(Candidate(describe(arm.grouping, knobs, _cap_text(knobs.max_inflight_bytes)), a, knobs,
                                arm.score(knobs)))
        if i % 50 == 0 or i == len(grid) - 1:
            report("grid", i + 1, len(grid), _best(scored, budget))
    presets, skipped = score_presets(step, profile)
    report("competitors", 0, len(COMPETITORS), _best(scored, budget))
    competing = time.perf_counter()
    with step_plans_kept(kept):
        rivals, _, failed = competitors(step, profile)
    competitor_seconds = time.perf_counter() - competing
    skipped = (*skipped, *failed)
    fits = [c for c in (*scored, *presets, *rivals) if budget is None or c.peak_inflight_bytes <= budget]
    if not fits:
        smallest = min((*scored, *presets, *rivals), key=lambda c: (c.peak_inflight_bytes, c.step_seconds))
        raise OverlapConfigError.single(
            f"{prefix}memory_budget",
            f"{fmt_bytes(budget)} is below the peak in-flight all-gather bytes of every candidate; the smallest "
            f"feasible budget in this space is {fmt_bytes(smallest.peak_inflight_bytes)} "
            f"({smallest.peak_inflight_bytes} bytes, {smallest.name}); raise the budget, or add smaller depths to "
            f"{prefix}space.forward_prefetch / backward_prefetch (0 issues each all-gather at its use)")
    refined = _refine_best(arms, fits, space, budget, report)
    pool = [*fits, *(c for c in refined if budget is None or c.peak_inflight_bytes <= budget)]
    # A tie (within TIE_TOLERANCE of the fastest) may go to fewer bytes in flight, never to a step slower than a
    # preset or a competitor the user could pick instead.
    others = [c.step_seconds for c in (*presets, *rivals) if budget is None or c.peak_inflight_bytes <= budget]
    winner = choose(pool, ceiling=min(others, default=None))
    everything = [*scored, *presets, *rivals, *refined]
    result = _result(step, profile, arms, winner, everything, presets, rivals, skipped, space, budget, as_dtype,
                     verify, started, report, competitor_seconds=competitor_seconds)
    log.info("tune: %d candidates in %.1fs, best %s (%s)", result.evaluated, result.seconds,
             fmt_seconds(winner.step_seconds), winner.name)
    return result


class _Reporter:
    def __init__(self, fn: ProgressFn | None, started: float) -> None:
        self.fn, self.started = fn, started

    def __call__(self, phase: str, done: int, total: int, best: float | None) -> None:
        if self.fn is not None:
            self.fn(TuneProgress(phase, done, total, best, time.perf_counter() - self.started))


def _unit_facts(profile: Profile) -> dict[str, tuple[float, int]]:
    """Each unit's first forward all-gather wait (compute order) and unsharded bytes, for ``find_parts``."""
    facts: dict[str, tuple[float, int]] = {}
    for g in profile.graphs:
        if g.name != "forward":
            continue
        for c in g.collectives:
            if c.kind == "all_gather":
                unit = profile.units[c.unit]
                at, size = facts.get(unit, (c.wait, 0))
                facts[unit] = (min(at, c.wait), size + c.traced_bytes)
    return facts


def _as_searched(space: TuneSpace, structure: Structure) -> TuneSpace:
    """The space with the blocks and parts that were used (found ones filled in), for the result and
    ``tune.json``."""
    if space.blocks is not None and space.block_parts is not None:
        return space
    data = space.model_dump()
    data["blocks"] = structure.pattern
    if space.block_parts is None:
        data["block_parts"] = [list(p) for p in structure.parts or ()]
    return TuneSpace.model_validate(data)


def _traced(budget: int, profile: Profile) -> int:
    """The budget (costed bytes, what the simulator counts) in traced bytes (what ``max_inflight_bytes`` counts)."""
    costed = sum(c.cost_bytes for g in profile.graphs for c in g.collectives if c.kind == "all_gather")
    traced = sum(c.traced_bytes for g in profile.graphs for c in g.collectives if c.kind == "all_gather")
    return max(1, budget * traced // costed) if costed else budget


def _cap_text(cap: int | None) -> str | None:
    return fmt_bytes(cap).replace(" ", "") if cap is not None else None


def _best(candidates: list[Candidate], budget: int | None) -> float | None:
    fits = [c.step_seconds for c in candidates if budget is None or c.peak_inflight_bytes <= budget]
    return min(fits) if fits else None


def _groupings(space: TuneSpace, structure: Structure, path: str) -> list[Grouping]:
    if True in space.split_blocks and structure.parts is None and False not in space.split_blocks:
        raise OverlapConfigError.single(f"{path}.split_blocks", f"blocks cannot be split: {structure.why_no_split}; "
                                                                f"fix {path}.block_parts or set split_blocks [false]")
    out = []
    for split in space.split_blocks:
        if split and structure.parts is None:
            log.warning("tune: not splitting blocks: %s", structure.why_no_split)
            continue
        for per in ((1,) if split else space.layers_per_bucket):
            for first in space.merge_first:
                for last in space.merge_last:
                    for unmerged in space.unmerged:
                        out.append(Grouping(per, split, first, last, tuple(sorted(set(unmerged)))))
    return list(dict.fromkeys(out))


def _arms(profile: Profile, structure: Structure, groupings: list[Grouping], step: CapturedStep) -> list[Arm]:
    arms: list[Arm] = []
    seen: set[tuple[frozenset[frozenset[str]], tuple[str, ...]]] = set()
    for g in groupings:
        # A grouping's plan depends on the model alone: resolved once per step, copied before anyone holds it.
        plan, resolved = cached(step, ("plan", structure, g), functools.partial(
            plan_for, structure, g, step.module_fqns, step.param_owners))
        plan = copy.deepcopy(plan)
        key = (frozenset(frozenset(b.modules) for b in resolved.buckets), g.unmerged)
        if key in seen:  # merge_first without a head, say: the same buckets as another grouping
            continue
        seen.add(key)
        unit_bucket = unit_buckets(resolved, profile, f"grouping {g.label!r}")
        names = [b.name for b in resolved.buckets]
        arms.append(Arm(g, plan, resolved, group(profile, unit_bucket, names, g.unmerged)))
    return arms


def _grid(arms: list[Arm], space: TuneSpace, caps: list[int | None]) -> list[tuple[int, Knobs]]:
    """Every arm x cap x the searched depths' values (``overlapcfg.config.depths.DepthGrid``, in field order) x
    issue order, in that fixed order, sampled down to ``space.max_candidates``."""
    grid = []
    choices = [getattr(space, name) for name in SEARCHED_DEPTHS]
    for a in range(len(arms)):
        for cap in caps:
            for values in itertools.product(*choices):
                depths = Depths(**dict(zip(SEARCHED_DEPTHS, values, strict=True)))
                for order in space.issue_order:
                    if order != "gather_first" and depths.backward_prefetch < 2:
                        continue  # no all-gather is prefetched two buckets ahead: the same schedule
                    grid.append((a, Knobs(depths, order, cap)))
    if len(grid) > space.max_candidates:
        keep = sorted(random.Random(space.seed).sample(range(len(grid)), space.max_candidates))
        grid = [grid[i] for i in keep]
    return grid


def _refine_best(arms: list[Arm], fits: list[Candidate], space: TuneSpace, budget: int | None,
                 report: _Reporter) -> list[Candidate]:
    """Per-bucket refinement of the best candidates of distinct groupings (then the next best of any)."""
    if not space.per_bucket_rounds:
        return []
    ranked = sorted((c for c in fits if c.arm >= 0), key=lambda c: (c.step_seconds, c.peak_inflight_bytes))
    starts: list[Candidate] = []
    for c in ranked:
        if len(starts) < space.per_bucket_candidates and all(s.arm != c.arm for s in starts):
            starts.append(c)
    for c in ranked:
        if len(starts) >= space.per_bucket_candidates:
            break
        if c not in starts:
            starts.append(c)
    out: list[Candidate] = []
    for k, start in enumerate(starts):
        out += _refine(arms[start.arm], start, space, budget)
        report("per-bucket", k + 1, len(starts), _best([*fits, *out], budget))
    return out


def _refine(arm: Arm, start: Candidate, space: TuneSpace, budget: int | None) -> list[Candidate]:
    index = {name: i for i, name in enumerate(arm.names)}
    graphs = {g.profile.name: g for g in arm.grouped.graphs}
    knobs, best = start.knobs, start.score
    tried: list[Candidate] = []
    for _ in range(space.per_bucket_rounds):
        stalls: list[Stall] = []
        arm.score(knobs, stalls=stalls)
        moves: dict[tuple[int, str, int], None] = {}
        for stall in stalls:
            bucket = index[stall.bucket]
            name = depth_field(stall.graph, stall.kind)
            if name is None:
                continue
            if stall.kind == "all_gather":
                order = [s.bucket for s in graphs[stall.graph].all_gathers]
                j = order.index(bucket)
                sources = order[max(0, j - LOOKBACK):j]
            else:
                sources = [bucket]
            values = knobs.values(name, len(arm.names))
            for b in sources:
                for v in (values[b] + 1, values[b] + 2):
                    if v <= space.max_depth:
                        moves[(b, name, v)] = None
        found = None
        for b, name, v in moves:
            trial = knobs.with_bucket(b, name, v)
            s = arm.score(trial)
            tried.append(Candidate(describe(arm.grouping, trial, _cap_text(trial.max_inflight_bytes)), start.arm,
                                   trial, s))
            if (budget is None or s.peak_inflight_bytes <= budget) and s.step_seconds < best.step_seconds - 1e-12 \
                    and (found is None or s.step_seconds < found[1].step_seconds):
                found = (trial, s)
        if found is None:
            break
        knobs, best = found
    return tried


def _result(step: CapturedStep, profile: Profile, arms: list[Arm], winner: Candidate, everything: list[Candidate],
            presets: list[Candidate], rivals: list[Candidate], skipped: tuple[str, ...], space: TuneSpace,
            budget: int | None, as_dtype: torch.dtype | None, verify: bool, started: float,
            report: _Reporter, *, competitor_seconds: float) -> TuneResult:
    def full(c: Candidate) -> Candidate:
        """With its config and the memory replay (the bulk scores skip both)."""
        if c.arm < 0:
            return c
        arm = arms[c.arm]
        return Candidate(c.name, c.arm, c.knobs, arm.score(c.knobs, memory=True), arm.config(c.knobs))

    best = full(winner)
    assert best.config is not None
    fastest = full(min((c for c in everything if budget is None or c.peak_inflight_bytes <= budget),
                       key=lambda c: (c.step_seconds, c.peak_inflight_bytes)))
    stalls: list[Stall] = []
    if best.arm >= 0:
        arms[best.arm].score(best.knobs, stalls=stalls)
        _check_config(best, arms[best.arm], step, profile)
    elif best.arm == -1:  # a preset won: replay it through its own resolution for the stalls
        cfg = best.config
        score_config(best.name, cfg, resolve_config(cfg, step.facts), profile, stalls)
    ranked = sorted(everything, key=lambda c: (c.step_seconds, c.peak_inflight_bytes, len(c.knobs.per_bucket)))
    unique = list({(c.name, c.knobs): c for c in ranked}.values())
    # For the tables, one candidate per outcome: a per-bucket value that changes nothing is not a new candidate.
    distinct = list({(c.step_seconds, c.peak_inflight_bytes): c for c in reversed(unique)}.values())[::-1]
    fitting = [c for c in distinct if budget is None or c.peak_inflight_bytes <= budget]
    top = [full(c) for c in fitting[:10]]
    front = tuple(full(c) for c in pareto(distinct))
    verification = None
    if verify:
        report("verify", 0, 1, best.step_seconds)
        verification = _verify(step, best, profile)
    report("done", 1, 1, best.step_seconds)
    return TuneResult(
        config=best.config, best=best, fastest=fastest, tie_tolerance=TIE_TOLERANCE, top=tuple(top), pareto=front,
        presets=tuple(presets), competitors=tuple(rivals), lower_bound_seconds=lower_bound(profile), skipped=skipped,
        candidates=tuple(unique), verification=verification, stalls=tuple(stalls), hardware=profile.hardware.name,
        world_size=profile.world_size, memory_budget=budget, as_dtype=as_dtype, space=space,
        evaluated=len(everything), profile_seconds=profile.seconds, competitor_seconds=competitor_seconds,
        seconds=time.perf_counter() - started,
        arms=len(arms), facts=profile.plan.facts if profile.plan is not None else StepFacts(),
        peak_flops=profile.hardware.dense_peak(profile.plan.facts.dtype if profile.plan is not None else "float32"),
        pricing=profile.pricing.model_copy(update={"fusion": profile.plan.fusion}).model_dump(mode="json")
        if profile.pricing is not None and profile.plan is not None else None)


def _check_config(best: Candidate, arm: Arm, step: CapturedStep, profile: Profile) -> None:
    """The emitted config, resolved on its own, must be the candidate (same buckets, same depths, same score)."""
    assert best.config is not None
    cfg = best.config
    resolved = resolve_config(cfg, step.facts)
    again = score_config(best.name, cfg, resolved, profile)
    if abs(again.step_seconds - best.step_seconds) > 1e-9 * best.step_seconds:
        raise AssertionError(f"tune: the emitted config scores {again.step_seconds}, the candidate "
                             f"{best.step_seconds}: the overrides do not say what the search chose")


def _verify(step: CapturedStep, best: Candidate, profile: Profile) -> Verification:
    """A real apply (with the verifier) and simulate of the winner, against its quick score."""
    assert best.config is not None
    started = time.perf_counter()
    config = best.config if best.config.verify else best.config.model_copy(update={"verify": True})
    explained = explain(step, config)
    row = compare_reports(step, [explained], hardware=profile.hardware, names=["tuned"], world_size=profile.world_size,
                          as_dtype=profile.as_dtype, node_costs=profile.node_costs, pricing=profile.pricing).rows[0]
    sim = row.simulation
    agreement = abs(best.step_seconds - sim.step_seconds) / sim.step_seconds if sim.step_seconds else 0.0
    if agreement > AGREEMENT:
        log.warning("tune: the quick model predicts %s for the winner, the full simulation %s (%.2f%% apart, more "
                    "than %.0f%%): the profile does not describe this graph well; trust the full number",
                    fmt_seconds(best.step_seconds), fmt_seconds(sim.step_seconds), 100 * agreement, 100 * AGREEMENT)
    return Verification(simulation=sim, agreement=agreement, seconds=time.perf_counter() - started,
                        report=row.report)

"""``overlapcfg.tuning.step_cache``: what the tuner keeps per traced step across searches is what an uncached search
would make, and it is made again when the step it depends on changes.

Fast tier: trace-free synthetic steps (``tests/support/synthetic.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

import overlapcfg
from overlapcfg.tuning import step_cache, tune
from overlapcfg.tuning.step_cache import cached, step_fingerprint
from tests.support.synthetic import captured_step

LAYERS = [[2, 1], [1], [1, 2]]
SPACE = {"split_blocks": [False], "block_parts": [], "layers_per_bucket": [1, 2], "forward_prefetch": [1, 2],
         "backward_prefetch": [1, 2], "reduce_scatter_delay": [1], "unmerged": [[], ["all_gather"]],
         "per_bucket_rounds": 1}


def _outcome(r: overlapcfg.TuneResult) -> dict[str, Any]:
    """Everything a search decides and predicts (its timings left out)."""
    out = r.to_dict()
    for key in ("seconds", "profile_seconds", "competitor_seconds"):
        out.pop(key)
    if out["verification"] is not None:
        out["verification"].pop("seconds")
    return out


def _search(step: Any, **kwargs: Any) -> overlapcfg.TuneResult:
    return tune(step, hardware="h100_nvlink", world_size=8, space=SPACE, **kwargs)


def test_a_search_reusing_the_steps_cache_equals_one_on_a_fresh_step_and_applies_nothing_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second search on one step reads the unit graphs, the competitors, the plans and the presets from the
    cache (the unit plan and each competitor applied once, their pricing plans made once; the winner is verified,
    and its new graph planned, by each search); every number and decision equals that of a search on a step never
    seen, which applies and plans them all anew."""
    from overlapcfg.cost import pricing_plan
    from overlapcfg.tuning import competitors, profile, search

    calls: list[str] = []
    real_apply, real_explain = profile.apply_step, competitors.explain

    def apply_step(step: Any, cfg: Any) -> Any:
        calls.append("units")
        return real_apply(step, cfg)

    def explain(step: Any, cfg: Any) -> Any:
        calls.append(cfg.strategy)
        return real_explain(step, cfg)

    def verified(step: Any, cfg: Any) -> Any:
        calls.append("winner")
        return real_explain(step, cfg)

    real_shape = pricing_plan.recompute_shape

    def recompute_shape(*args: Any, **kwargs: Any) -> Any:  # called once per pricing plan made
        calls.append("plan")
        return real_shape(*args, **kwargs)

    monkeypatch.setattr(profile, "apply_step", apply_step)
    monkeypatch.setattr(pricing_plan, "recompute_shape", recompute_shape)
    monkeypatch.setattr(competitors, "explain", explain)
    monkeypatch.setattr(search, "explain", verified)
    once = ["auto", "auto", "none", "units", *["plan"] * 4]  # applied and planned once: the units, 3 competitors
    each = ["winner", "plan"]  # by every search
    step = captured_step(LAYERS)
    first, again = _search(step), _search(step)
    assert sorted(calls) == sorted([*once, *each, *each])
    fresh = _search(captured_step(LAYERS))
    assert sorted(calls) == sorted([*once, *once, *each, *each, *each])
    assert _outcome(again) == _outcome(first) == _outcome(fresh)
    assert again.to_yaml() == fresh.to_yaml()


def test_a_step_edited_in_place_misses_the_cache() -> None:
    """The fingerprint covers both graphs' nodes and the step's facts: an edit in place, or another step around the
    same forward graph with other facts, makes the value again instead of reading a stale one."""
    step = captured_step(LAYERS)
    made: list[int] = []

    def make() -> int:
        made.append(1)
        return len(made)

    assert cached(step, "k", make) == 1
    assert cached(step, "k", make) == 1  # the same step, unchanged: kept
    assert cached(step, "other key", make) == 2
    before = step_fingerprint(step)
    mm = next(n for n in step.backward.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
    mm.args = tuple(reversed(mm.args))  # an edit in place of the backward graph
    assert step_fingerprint(step) != before
    assert cached(step, "k", make) == 3
    import dataclasses

    other = dataclasses.replace(step, param_owners=step.param_owners[:-1])  # same graphs, other facts
    assert step_fingerprint(other) != step_fingerprint(step)
    assert cached(other, "k", make) == 4


def test_an_unfingerprintable_step_is_never_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_cache, "graph_fingerprint", lambda gm: None)
    step = captured_step(LAYERS)
    counter = iter(range(10))
    assert step_fingerprint(step) is None
    assert cached(step, "k", lambda: next(counter)) == 0
    assert cached(step, "k", lambda: next(counter)) == 1


def test_a_search_fingerprints_its_step_once_and_any_other_step_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``fingerprinted(step)`` the cache compares the fingerprint taken as the block opened (a search asks
    it some fifty times); another step asked inside the block is fingerprinted at each call as outside."""
    taken: list[object] = []
    real = step_cache.graph_fingerprint

    def counting(gm: Any) -> int | None:
        taken.append(gm)
        return real(gm)

    monkeypatch.setattr(step_cache, "graph_fingerprint", counting)
    step, other = captured_step(LAYERS), captured_step(LAYERS)
    with step_cache.fingerprinted(step):
        for key in range(5):
            cached(step, key, lambda: None)
        assert len(taken) == 2  # forward and backward, once
        cached(other, "k", lambda: None)
        cached(other, "k", lambda: None)
    assert len(taken) == 6
    cached(step, 0, lambda: None)
    assert len(taken) == 8

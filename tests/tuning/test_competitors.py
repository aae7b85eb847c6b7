"""The tuner never loses to what a user could pick instead: torch's ``auto`` (with and without its bucketing) and
``none`` are applied, simulated and chosen from; a tie never goes to a step slower than one of them or a preset; the
printed lower bound is below every config the search printed; unmerged kinds are searched and emitted as configs
that apply to what was scored.

Fast tier: synthetic steps (``tests.support.synthetic``), no tracing.
"""

from __future__ import annotations

import pytest

import overlapcfg
from overlapcfg.config.depths import Depths
from overlapcfg.report.compare import compare
from overlapcfg.tuning import TuneSpace, tune
from overlapcfg.tuning.candidates import Candidate, Knobs, choose
from overlapcfg.tuning.competitors import COMPETITORS
from overlapcfg.tuning.quick import Score
from tests.support.synthetic import captured_step

LAYERS = [[2, 1], [1], [3, 2], [1, 1], [2], [1, 3]]
SPACE = TuneSpace(layers_per_bucket=(1, 2), merge_first=(False,), merge_last=(False,), forward_prefetch=(0, 1, 2),
                  backward_prefetch=(0, 1, 2), reduce_scatter_delay=(0, 1), per_bucket_rounds=1)


@pytest.fixture(scope="module")
def results() -> dict[str, overlapcfg.TuneResult]:
    step = captured_step(LAYERS)
    return {hw: tune(step, hardware=hw, world_size=8, memory_budget=None, space=SPACE)
            for hw in ("cpu_gloo", "h100_nvlink")}


@pytest.mark.parametrize("hw", ["cpu_gloo", "h100_nvlink"])
def test_the_tuned_step_is_no_slower_than_any_competitor_or_preset(results, hw: str) -> None:
    r = results[hw]
    assert [c.name for c in r.competitors] == list(COMPETITORS)
    tuned = r.verification.simulation.step_seconds  # type: ignore[union-attr]
    for c in (*r.competitors, *r.presets):
        assert tuned <= c.step_seconds * (1 + 1e-9), c.name
    assert r.best_competitor is not None and r.score.step_seconds <= r.best_competitor.step_seconds


@pytest.mark.parametrize("hw", ["cpu_gloo", "h100_nvlink"])
def test_the_lower_bound_is_below_every_config_printed(results, hw: str) -> None:
    r = results[hw]
    printed = [*r.candidates, *r.presets, *r.competitors, *r.top, *r.pareto, r.best, r.fastest]
    assert all(r.lower_bound_seconds <= c.step_seconds * (1 + 1e-12) for c in printed)
    assert r.lower_bound_seconds <= r.verification.simulation.step_seconds  # type: ignore[union-attr]
    assert f"{r.lower_bound_seconds}" in r.to_json()


def test_competitors_are_full_simulations_of_what_the_strategy_does(results) -> None:
    r = results["h100_nvlink"]
    rows = compare(captured_step(LAYERS), [dict(c) for c in COMPETITORS.values()], hardware="h100_nvlink",
                   world_size=8).rows
    for c, row in zip(r.competitors, rows, strict=True):
        assert c.step_seconds == row.simulation.step_seconds and c.config is not None
        assert c.config.strategy == row.strategy


def test_unmerged_groupings_are_searched_and_their_configs_say_so(results) -> None:
    r = results["h100_nvlink"]
    labels = {c.name for c in r.candidates}
    for words in ("RS unmerged", "AG unmerged", "AG+RS unmerged"):
        assert any(words in name for name in labels), words
    unmerged = [c for c in r.top if c.config is not None and "unmerged" in c.name]
    for c in unmerged:
        assert c.config.policy.unmerged  # type: ignore[union-attr]


def _c(name: str, step: float, inflight: int, arm: int = 0) -> Candidate:
    score = Score(step, 0.0, step, 0.0, inflight, inflight, step, step)
    return Candidate(name, arm, Knobs(Depths(), "gather_first", None), score)


def test_a_tie_never_goes_to_a_step_slower_than_what_the_user_could_pick() -> None:
    """Within the tie tolerance the winner is the lightest, unless that is slower than a competitor: the
    fastest of the search is 100, the lightest 100.05 (a tie), and ``auto`` does 100.02."""
    fast, light, auto = _c("fast", 100.0, 10), _c("light", 100.05, 1), _c("auto", 100.02, 5, arm=-2)
    assert choose([fast, light, auto]).name == "light"
    assert choose([fast, light, auto], ceiling=auto.step_seconds).name == "auto"  # lighter than fast, as fast
    assert choose([fast, light], ceiling=99.0).name == "fast"  # a ceiling below the fastest: the fastest


def test_a_competitor_torchs_own_pass_fails_on_is_left_out_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.12.1's ``auto`` fails on a transposed gradient it reduce-scatters (its copy-in views it): a competitor
    nobody can run is no competitor. It is left out with torch's reason in ``skipped``; the search goes on."""
    from overlapcfg import compat

    def fails_as_torch_212(gm: object, **knobs: object) -> None:
        raise ValueError("Cannot view a tensor with shape torch.Size([4, 4]) and strides (1, 4) as a tensor with "
                         "shape (16,)!")

    monkeypatch.setattr(compat, "schedule_overlap_bucketing", fails_as_torch_212)
    r = tune(captured_step(LAYERS), hardware="h100_nvlink", world_size=8, memory_budget=None, space=SPACE)
    assert [c.name for c in r.competitors] == ["none (as traced)"]
    left_out = [s for s in r.skipped if s.startswith("auto")]
    assert [s.split(":", 1)[0] for s in left_out] == ["auto (torch's scheduler)", "auto + collective_bucketing"]
    assert all("own pass failed on this graph" in s and "Cannot view a tensor" in s for s in left_out), left_out
    assert r.verification is not None


def test_an_error_of_torchs_own_pass_is_an_upstream_pass_error_and_the_graph_is_left_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from overlapcfg import compat
    from overlapcfg.passes import apply
    from tests.support.synthetic import backward_graph

    def fails(gm: object, **knobs: object) -> None:
        raise ValueError("Cannot view a tensor")

    monkeypatch.setattr(compat, "schedule_overlap_bucketing", fails)
    syn = backward_graph(LAYERS)
    before = [n.format_node() for n in syn.gm.graph.nodes]
    with compat.fake_process_group(2, 0), pytest.raises(overlapcfg.UpstreamPassError) as caught:
        apply(syn.gm, overlapcfg.load_config({"strategy": "auto"}), module_fqns=syn.module_fqns,
              graph_kind="backward")
    assert f"strategy 'auto': torch {torch.__version__}'s own pass failed" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError) and isinstance(caught.value, RuntimeError)
    assert [n.format_node() for n in syn.gm.graph.nodes] == before

"""Plan resolution stays about linear in plan + model: asserted on the matcher's work counter, not on timings
(one generous wall-clock check is marked slow). Also unique bucket names and odd module names."""

from __future__ import annotations

import pytest

from overlapcfg.config import BucketPlan, ModuleOverride
from overlapcfg.errors import OverlapConfigError, natural_key
from overlapcfg.resolve import resolve_plan


def llama_fqns(n_layers: int) -> list[str]:
    names = ["", "tok_embeddings", "layers"]
    for i in range(n_layers):
        p = f"layers.{i}"
        names += [p, f"{p}.attention", *(f"{p}.attention.w{x}" for x in "qkvo"), f"{p}.attention_norm",
                  f"{p}.feed_forward", *(f"{p}.feed_forward.w{x}" for x in "123"), f"{p}.ffn_norm"]
    return [*names, "norm", "output"]


@pytest.fixture
def indexes(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every ModuleIndex that resolve_plan builds, to read its ``visited`` counter afterwards."""
    import overlapcfg.resolve.plan_resolution as plan_module
    from overlapcfg.config.module_index import ModuleIndex

    made: list[ModuleIndex] = []

    class Recording(ModuleIndex):
        def __init__(self, fqns: object) -> None:
            super().__init__(fqns)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(plan_module, "ModuleIndex", Recording)
    return made  # type: ignore[return-value]


def test_literal_patterns_cost_one_candidate_each(indexes: list) -> None:
    fqns = ["", "blocks", *(f"blocks.{i}" for i in range(10_000))]
    result = resolve_plan(BucketPlan(buckets=tuple(fqns[2:])), fqns)
    assert len(result.buckets) == 10_000
    assert indexes[0].visited == 10_000


def test_range_and_suffix_patterns_visit_only_what_they_can_match() -> None:
    from overlapcfg.config.module_index import ModuleIndex

    index = ModuleIndex(llama_fqns(200))
    assert len(index.match("layers.20:40")) == 20 and index.visited == 20
    index.visited = 0
    assert len(index.match("**.wq")) == 200 and index.visited == 200
    index.visited = 0
    assert index.match("layers.*.attention.nope") == [] and index.visited == 0


def test_overrides_do_not_scan_every_bucket_for_every_override(indexes: list) -> None:
    fqns = ["", "layers", *(f"layers.{i}" for i in range(2_000))]
    overrides = [ModuleOverride(match=f"layers.{k * 20}:{k * 20 + 20}", forward_prefetch=2) for k in range(100)]
    result = resolve_plan(BucketPlan(buckets=("layers.*",)), fqns, overrides=overrides)
    assert all(b.forward_prefetch == 2 and len(b.overridden_by) == 1 for b in result.buckets)
    assert indexes[0].visited == 2_000 + 2_000  # the plan entry, then each override's 20 layers


def test_pathological_pattern_is_rejected_without_walking_the_model(indexes: list) -> None:
    pattern = ".".join(["**", "a"] * 100 + ["c"])
    fqns = [*llama_fqns(8), *(f"layers.{i}.a.a.b" for i in range(8))]
    with pytest.raises(OverlapConfigError, match="matches no module"):
        resolve_plan(BucketPlan(buckets=(pattern,)), fqns)
    assert indexes[0].visited == 0


def test_suggestion_work_per_unmatched_pattern_is_capped(indexes: list) -> None:
    from overlapcfg.config.module_index import SUGGEST_EDITS

    fqns = [""] + [f"blocks.{j}" + ".a" * d for j in range(20) for d in range(40)]
    pattern = ".".join(["**", "a"] * 30 + ["c"])
    with pytest.raises(OverlapConfigError):
        resolve_plan(BucketPlan(buckets=(pattern,)), fqns)
    assert indexes[0].visited <= (SUGGEST_EDITS + 2) * len(fqns)


def test_only_the_first_unmatched_patterns_get_suggestions_but_all_are_reported() -> None:
    from overlapcfg.resolve.matcher import SUGGESTED_PATTERNS

    fqns = llama_fqns(212)
    plan = BucketPlan(buckets=tuple(f"layers.{i}.atention" for i in range(200)))
    with pytest.raises(OverlapConfigError) as info:
        resolve_plan(plan, fqns)
    faults = info.value.faults
    assert len(faults) == 200
    assert "did you mean 'layers.0.attention'" in faults[0].message
    assert all("did you mean" in f.message for f in faults[:SUGGESTED_PATTERNS])
    assert not any("did you mean" in f.message for f in faults[SUGGESTED_PATTERNS:])
    assert str(info.value).rstrip().endswith("more")


def test_bucket_names_are_unique_even_when_a_module_spells_a_suffix() -> None:
    fqns = ["", "a", "b", "a+b", "a+b#2"]
    result = resolve_plan(BucketPlan(buckets=(("a", "b"), "a+b", "a+b#2")), fqns)
    names = [b.name for b in result.buckets]
    assert len(set(names)) == len(names) == 3, names
    assert names[0] == "a+b" and names[2] == "a+b#2"


def test_superscript_digits_in_module_names_do_not_break_suggestions() -> None:
    # '²'.isdigit() is true but int('²') fails; '2²' splits into the number 2 and the text '²'.
    assert sorted(["l.10", "l.2²", "l.2"], key=natural_key) == ["l.2", "l.2²", "l.10"]
    with pytest.raises(OverlapConfigError, match="matches no module"):
        resolve_plan(BucketPlan(buckets=("layer.x",)), ["", "layer", "layer.2²", "layer.2", "layers"])


@pytest.mark.slow
@pytest.mark.timeout(120)  # a hang guard, not a speed bound: quadratic matching took about 240 s, indexed 0.3 s
def test_ten_thousand_literals_resolve_in_seconds() -> None:
    fqns = ["", "blocks", *(f"blocks.{i}" for i in range(10_000))]
    result = resolve_plan(BucketPlan(buckets=tuple(fqns[2:])), fqns)
    assert len(result.buckets) == 10_000

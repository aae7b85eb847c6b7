"""Plan resolution against a realistic module tree: entry forms, names, depths, coverage and every fault."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlapcfg.config import Bucket, BucketPlan, ModuleOverride, OverlapPolicy
from overlapcfg.errors import OverlapConfigError
from overlapcfg.resolve import ResolvedPlan, bucket_name, resolve_plan

REPO = Path(__file__).resolve().parents[2]


def llama_fqns(n_layers: int = 4, prefix: str = "") -> list[str]:
    """``named_modules()`` order of the demo Llama; ``prefix`` simulates a wrapper such as ``_orig_mod.``."""
    names = ["", "tok_embeddings", "layers"]
    for i in range(n_layers):
        layer = f"layers.{i}"
        names += [layer, f"{layer}.attention", *(f"{layer}.attention.w{x}" for x in "qkvo")]
        names += [f"{layer}.feed_forward", *(f"{layer}.feed_forward.w{j}" for j in (1, 2, 3))]
        names += [f"{layer}.attention_norm", f"{layer}.ffn_norm"]
    names += ["norm", "output"]
    if prefix:
        names = [""] + [prefix.rstrip(".")] + [prefix + n for n in names[1:]]
    return names


def owners_of(fqns: list[str]) -> list[str]:
    """Modules holding parameters directly: the leaves of the Llama tree."""
    return [f for f in fqns if f and not any(g.startswith(f + ".") for g in fqns)]


FQNS = llama_fqns()
OWNERS = owners_of(FQNS)
LLAMA_LAYERS = BucketPlan(buckets=("tok_embeddings", "layers.*", ("norm", "output")))


def plan(*entries: object, **kwargs: object) -> BucketPlan:
    return BucketPlan.model_validate({"buckets": list(entries), **kwargs})


def faults_of(bad: BucketPlan, fqns: list[str] = FQNS, **kwargs: object) -> list[str]:
    with pytest.raises(OverlapConfigError) as info:
        resolve_plan(bad, fqns, **kwargs)  # type: ignore[arg-type]
    return [str(f) for f in info.value.faults]


# --- entry forms -------------------------------------------------------------------------------------------


def test_string_entry_gives_one_bucket_per_matched_module() -> None:
    result = resolve_plan(LLAMA_LAYERS, FQNS, OWNERS)
    assert [b.name for b in result.buckets] == [
        "tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm+output",
    ]  # fmt: skip
    assert result.buckets[1].modules == ("layers.0",)
    assert [b.entry_index for b in result.buckets] == [0, 1, 1, 1, 1, 2]
    assert result.uncovered == ()


def test_list_entry_gives_one_bucket_with_readable_source() -> None:
    bucket = resolve_plan(LLAMA_LAYERS, FQNS).buckets[-1]
    assert bucket.modules == ("norm", "output")
    assert bucket.entry_text == "[norm, output]"


def test_per_gives_each_layer_its_attention_and_norm_in_model_order() -> None:
    entry = {"modules": ["layers.*.attention_norm", "layers.*.attention"], "per": "layers.*"}
    result = resolve_plan(plan(entry), FQNS)
    assert [b.modules for b in result.buckets] == [
        (f"layers.{i}.attention", f"layers.{i}.attention_norm") for i in range(4)
    ]
    assert result.buckets[0].name == "layers.0.attention+layers.0.attention_norm"
    text = "{modules: [layers.*.attention_norm, layers.*.attention], per: layers.*}"
    assert result.buckets[0].entry_text == text


def test_per_with_group_size_splits_inside_each_per_module() -> None:
    entry = {"modules": ["layers.0:2.attention.*"], "per": "layers.0:2", "group_size": 3}
    result = resolve_plan(plan(entry), FQNS)
    assert [b.modules for b in result.buckets] == [
        ("layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv"),
        ("layers.0.attention.wo",),
        ("layers.1.attention.wq", "layers.1.attention.wk", "layers.1.attention.wv"),
        ("layers.1.attention.wo",),
    ]


@pytest.mark.parametrize(
    ("group_size", "names"),
    [
        (1, ["layers.0", "layers.1", "layers.2", "layers.3"]),
        (2, ["layers.0-1", "layers.2-3"]),
        (3, ["layers.0-2", "layers.3"]),
        (None, ["layers.0-3"]),
    ],
)
def test_group_size_chunks_consecutive_matches(group_size: int | None, names: list[str]) -> None:
    result = resolve_plan(plan({"modules": ["layers.*"], "group_size": group_size}), FQNS)
    assert [b.name for b in result.buckets] == names
    assert sum(len(b.modules) for b in result.buckets) == 4


def test_nested_match_collapses_into_outer_match_of_same_entry() -> None:
    result = resolve_plan(plan(["layers.0.attention", "layers.0", "layers.0.**", "norm"]), FQNS)
    assert [b.modules for b in result.buckets] == [("layers.0", "norm")]


def test_string_entry_with_double_star_collapses_to_subtree_root() -> None:
    result = resolve_plan(plan("layers.**", "tok_embeddings"), FQNS)
    assert [b.modules for b in result.buckets] == [("layers",), ("tok_embeddings",)]


def test_whole_model_pattern_is_one_root_bucket() -> None:
    result = resolve_plan(plan("**"), FQNS, OWNERS)
    assert [(b.name, b.modules) for b in result.buckets] == [("<root>", ("",))]
    assert result.uncovered == ()


def test_wrapper_segments_are_stripped_from_bucket_modules() -> None:
    fqns = llama_fqns(2, prefix="_orig_mod.")
    result = resolve_plan(LLAMA_LAYERS, fqns, owners_of(fqns))
    assert [b.modules for b in result.buckets] == [
        ("tok_embeddings",),
        ("layers.0",),
        ("layers.1",),
        ("norm", "output"),
    ]
    assert result.bucket_of("_orig_mod.layers.1.attention.wq") is result.buckets[2]


def test_empty_plan_resolves_to_no_buckets_and_lists_every_owner() -> None:
    result = resolve_plan(BucketPlan(), FQNS, OWNERS)
    assert result.buckets == ()
    assert result.uncovered == tuple(OWNERS)


# --- lookups and names -------------------------------------------------------------------------------------


def test_bucket_of_compares_whole_segments() -> None:
    fqns = llama_fqns(12)
    result = resolve_plan(plan("layers.1", "layers.10"), fqns)
    assert result.bucket_of("layers.1.attention.wq").name == "layers.1"  # type: ignore[union-attr]
    assert result.bucket_of("layers.10.attention").name == "layers.10"  # type: ignore[union-attr]
    assert result.bucket_of("layers.11") is None
    assert result.bucket_of("layers") is None
    assert result.bucket_index("layers.10") == 1


def test_by_name_suggests_closest_bucket() -> None:
    result = resolve_plan(LLAMA_LAYERS, FQNS)
    assert result.by_name("norm+output").modules == ("norm", "output")
    with pytest.raises(KeyError, match="'norm\\+output'"):
        result.by_name("norm+outptu")


def test_module_lists_feed_torch_manual_bucketing() -> None:
    assert resolve_plan(LLAMA_LAYERS, FQNS).module_lists()[-2:] == [["layers.3"], ["norm", "output"]]


@pytest.mark.parametrize(
    ("modules", "name"),
    [
        (["layers.3"], "layers.3"),
        ([""], "<root>"),
        (["norm", "output"], "norm+output"),
        (["layers.0", "layers.1", "layers.2", "norm"], "layers.0-2+norm"),
        (["layers.0", "layers.2"], "layers.0+layers.2"),
        (["a", "b", "c", "d", "e"], "a+...+e"),
        (["0", "1"], "0-1"),
    ],
)
def test_bucket_name_scheme(modules: list[str], name: str) -> None:
    assert bucket_name(modules) == name


def test_bucket_names_are_unique_across_a_mixed_plan() -> None:
    mixed = plan(
        "tok_embeddings",
        {"modules": ["layers.*.attention"], "group_size": 2},
        {"modules": ["layers.*.feed_forward", "layers.*.ffn_norm"], "per": "layers.*"},
        ["layers.*.attention_norm"],
        ["norm", "output"],
    )
    names = [b.name for b in resolve_plan(mixed, FQNS, OWNERS).buckets]
    assert len(names) == len(set(names)) == 9


def test_resolution_is_deterministic_across_hash_seeds() -> None:
    script = (
        "from overlapcfg.resolve import resolve_plan\n"
        "from tests.resolve.test_resolve import FQNS, OWNERS, LLAMA_LAYERS\n"
        "print(repr(resolve_plan(LLAMA_LAYERS, FQNS, OWNERS)))\n"
    )
    # One fresh interpreter with a seed other than this process's (an unset PYTHONHASHSEED here is a random one, 0 no
    # randomization), compared with this process's own resolution: two seeds, one interpreter start fewer.
    seed = "12345" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    here = repr(resolve_plan(LLAMA_LAYERS, FQNS, OWNERS)) + "\n"
    assert run.stdout == here
    assert "layers.3" in here


# --- depths: policy <- entry <- overrides ------------------------------------------------------------------


def test_depths_default_to_the_policy() -> None:
    result = resolve_plan(LLAMA_LAYERS, FQNS, policy=OverlapPolicy(forward_prefetch=2, reduce_scatter_delay=0))
    bucket = result.buckets[0]
    assert (bucket.forward_prefetch, bucket.backward_prefetch, bucket.reduce_scatter_delay) == (2, 1, 0)
    assert bucket.origin("forward_prefetch") == "policy"
    assert bucket.overridden_by == ()


def test_entry_values_beat_policy_and_overrides_beat_entry_later_ones_winning() -> None:
    entry = {"modules": ["layers.*"], "group_size": 2, "forward_prefetch": 3, "backward_prefetch": 0}
    overrides = [
        ModuleOverride(match="layers.0", forward_prefetch=5),
        ModuleOverride(match="layers.0:2", forward_prefetch=4, reduce_scatter_delay=2),
    ]
    first, second = resolve_plan(plan(entry), FQNS, overrides=overrides, policy=OverlapPolicy()).buckets
    assert (first.forward_prefetch, first.backward_prefetch, first.reduce_scatter_delay) == (4, 0, 2)
    assert first.overridden_by == ("overrides[0]", "overrides[1]")
    assert first.origin("forward_prefetch") == "overrides[1]"
    assert first.origin("backward_prefetch") == "plan.buckets[0]"
    assert (second.forward_prefetch, second.backward_prefetch, second.reduce_scatter_delay) == (3, 0, 1)
    assert second.origin("reduce_scatter_delay") == "policy"


def test_override_on_a_submodule_applies_to_its_enclosing_bucket() -> None:
    overrides = [ModuleOverride(match="**.feed_forward.w2", backward_prefetch=2)]
    result = resolve_plan(LLAMA_LAYERS, FQNS, overrides=overrides)
    assert [b.backward_prefetch for b in result.buckets] == [1, 2, 2, 2, 2, 1]


def test_unknown_depth_field_origin_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="forward_prefetch"):
        resolve_plan(LLAMA_LAYERS, FQNS).buckets[0].origin("depth")


# --- coverage ----------------------------------------------------------------------------------------------


def test_uncovered_owners_are_listed_in_model_order() -> None:
    result = resolve_plan(plan("layers.1:3"), FQNS, list(reversed(OWNERS)))
    assert result.uncovered[:2] == ("tok_embeddings", "layers.0.attention.wq")
    assert result.uncovered[-2:] == ("norm", "output")
    assert not any(u.startswith(("layers.1.", "layers.2.")) for u in result.uncovered)


def test_require_full_coverage_lists_uncovered_owners() -> None:
    faults = faults_of(plan("tok_embeddings", "layers.*", require_full_coverage=True), owners=OWNERS)
    assert faults == [
        "plan.require_full_coverage: 2 module(s) owning FSDP parameters are in no bucket: 'norm', 'output' "
        "(add entries for them, or set require_full_coverage: false)"
    ]


def test_require_full_coverage_without_owners_is_api_misuse() -> None:
    with pytest.raises(TypeError, match="owners"):
        resolve_plan(plan("**", require_full_coverage=True), FQNS)


def test_owners_unknown_means_nothing_listed() -> None:
    assert resolve_plan(plan("norm"), FQNS).uncovered == ()


# --- faults ------------------------------------------------------------------------------------------------


def test_unknown_pattern_suggests_closest_fqn() -> None:
    [fault] = faults_of(plan("tok_embeddings", "layer.*"))
    assert fault.startswith("plan.buckets[1]: pattern 'layer.*' matches no module; did you mean 'layers.*'?")
    assert "closest modules: 'layers." in fault


def test_unmatched_pattern_in_list_names_its_entry_and_position() -> None:
    [fault] = faults_of(plan(["norm", "ouptut"]))
    assert fault.startswith("plan.buckets[0][1]: pattern 'ouptut' (in entry [norm, ouptut]) matches no module")
    assert "did you mean 'output'?" in fault


def test_unmatched_pattern_without_close_names_lists_top_level_modules() -> None:
    [fault] = faults_of(plan("zzz"))
    assert "top-level modules: 'tok_embeddings', 'layers', 'norm', 'output'" in fault


def test_too_shallow_star_suggests_double_star() -> None:
    [fault] = faults_of(plan("*.wq"))
    assert "did you mean '**.wq'?" in fault


def test_unmatched_mapping_patterns_are_located_by_field() -> None:
    faults = faults_of(plan({"modules": ["layers.*.attn"], "per": "layer.*"}))
    assert faults[0].startswith("plan.buckets[0].modules[0]: pattern 'layers.*.attn' (in entry {modules: ")
    assert "did you mean 'layers.*.attention'" in faults[0]
    assert faults[1].startswith("plan.buckets[0].per: pattern 'layer.*'")


def test_module_claimed_by_two_entries_names_both() -> None:
    [fault] = faults_of(plan("layers.*", ["layers.1", "norm"]))
    assert fault == (
        "plan.buckets[1]: entry 1 ([layers.1, norm]) and entry 0 (layers.*) both claim 'layers.1'; "
        "a module belongs to one bucket only"
    )


def test_module_nested_in_another_entry_names_both_either_order() -> None:
    later_inner = faults_of(plan("layers.*", "layers.0.attention"))
    earlier_inner = faults_of(plan("layers.0.attention", "layers.*"))
    assert later_inner == [
        "plan.buckets[1]: entry 1 (layers.0.attention) and entry 0 (layers.*) both claim "
        "'layers.0.attention' inside 'layers.0'; a module belongs to one bucket only"
    ]
    assert earlier_inner[0].startswith("plan.buckets[1]: entry 1 (layers.*) and entry 0 (layers.0.attention)")


def test_root_bucket_clashes_with_everything_and_truncates_the_list() -> None:
    [fault] = faults_of(plan("layers.*", "**"))
    assert "entry 1 (**) and entry 0 (layers.*) both claim 'layers.0' inside <root>" in fault
    assert "(4 in all)" not in fault
    [fault] = faults_of(plan("layers.*", "**"), fqns=llama_fqns(6))
    assert "... (6 in all)" in fault


def test_group_size_below_one_is_rejected_even_if_schema_was_bypassed() -> None:
    bad = BucketPlan.model_construct(buckets=(Bucket.model_construct(modules=("layers.*",), group_size=0),))
    assert faults_of(bad) == ["plan.buckets[0].group_size: group_size must be an integer >= 1, got 0"]


def test_per_module_without_matches_is_an_error() -> None:
    [fault] = faults_of(plan({"modules": ["layers.0:2.attention"], "per": "layers.*"}))
    assert fault.startswith(
        "plan.buckets[0].per: per module(s) 'layers.2', 'layers.3' hold no match of modules [layers.0:2.attention]"
    )
    assert "narrow 'per'" in fault


def test_long_fqn_lists_in_messages_are_truncated_with_a_count() -> None:
    [fault] = faults_of(plan({"modules": ["layers.*.attention.*"], "per": "layers.0"}))
    assert "'layers.2.attention.wk' ... (12 in all) lie outside every 'per' module ('layers.0')" in fault


def test_matches_outside_every_per_module_are_an_error() -> None:
    [fault] = faults_of(plan({"modules": ["layers.*.attention", "norm"], "per": "layers.*"}))
    assert fault == (
        "plan.buckets[0].modules: matches 'norm' lie outside every 'per' module ('layers.*'); "
        "move them to an entry of their own"
    )


def test_override_matching_no_module_suggests_closest() -> None:
    [fault] = faults_of(LLAMA_LAYERS, overrides=[ModuleOverride(match="lyers.0", forward_prefetch=2)])
    assert fault.startswith("overrides[0].match: pattern 'lyers.0' matches no module; did you mean 'layers.0'?")


def test_override_is_matched_against_modules_not_bucket_names() -> None:
    [fault] = faults_of(LLAMA_LAYERS, overrides=[ModuleOverride(match="norm+output", forward_prefetch=2)])
    assert fault.startswith("overrides[0].match: pattern 'norm+output' matches no module")


def test_override_matching_modules_outside_every_bucket_points_inside() -> None:
    faults = faults_of(LLAMA_LAYERS, overrides=[ModuleOverride(match="layers", forward_prefetch=2)])
    assert faults == [
        "overrides[0].match: override 'layers' matches 'layers', which belong to no bucket; "
        "buckets inside them: 'layers.0', 'layers.1', 'layers.2', 'layers.3' "
        "(write layers.** to reach them)"
    ]


def test_bad_syntax_that_bypassed_the_schema_is_reported_with_its_path() -> None:
    bad = BucketPlan.model_construct(buckets=("layers.[0-3]",))
    [fault] = faults_of(bad)
    assert fault.startswith("plan.buckets[0]: bad pattern 'layers.[0-3]'")
    assert "use layers.0:4" in fault


def test_all_faults_are_reported_at_once_under_the_mount_path() -> None:
    bad = plan("layer.*", "tok_embeddings", "tok_embeddings", {"modules": ["nrm"]})
    faults = faults_of(
        bad,
        overrides=[ModuleOverride(match="outptu", forward_prefetch=0)],
        path="trainer.plan",
        overrides_path="trainer.overrides",
    )
    assert [f.split(":")[0] for f in faults] == [
        "trainer.plan.buckets[0]",
        "trainer.plan.buckets[3].modules[0]",
        "trainer.plan.buckets[2]",
        "trainer.overrides[0].match",
    ]


def test_error_message_has_a_header_and_one_line_per_fault() -> None:
    with pytest.raises(OverlapConfigError) as info:
        resolve_plan(plan("layer.*", "nrm"), FQNS)
    lines = str(info.value).splitlines()
    assert lines[0] == "the bucket plan does not fit the model (2 faults):"
    assert len(lines) == 3


def test_result_is_frozen() -> None:
    result = resolve_plan(LLAMA_LAYERS, FQNS)
    assert isinstance(result, ResolvedPlan)
    with pytest.raises((AttributeError, ValueError)):  # a frozen pydantic model raises ValidationError
        result.buckets[0].name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(("entry", "fix"), [
    ("layers.0:8", "write 'layers.0:4' or 'layers.*'"),
    ("layers.2:8", "write 'layers.2:4'"),
    ("layers.3:5", "write 'layers.3'"),
])
def test_a_range_reaching_past_the_model_is_an_error_naming_the_fit(entry: str, fix: str) -> None:
    """The trial: ``layers.0:8`` on a 4-layer model was accepted without a word. Indices 4-7 match nothing, like
    an unmatched pattern: the config was written for another model, and "the first 8" now means all of them."""
    (fault,) = faults_of(plan("tok_embeddings", entry, ["norm", "output"]))
    assert fault.startswith(f"plan.buckets[1]: pattern {entry!r} reaches past the model: 'layers' has indices up "
                            "to 3") and fault.endswith(fix)
    (override,) = faults_of(LLAMA_LAYERS, overrides=(ModuleOverride(match="layers.0:6.**", forward_prefetch=0),))
    assert "pattern 'layers.0:6.**' reaches past the model" in override
    resolve_plan(plan("tok_embeddings", "layers.0:2", "layers.2:4", ["norm", "output"]), FQNS, OWNERS)  # to the end

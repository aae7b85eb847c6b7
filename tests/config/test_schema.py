"""Schema validation: every fault names its dotted path, the value given and what was expected."""

from __future__ import annotations

import textwrap

import pytest
from omegaconf import OmegaConf

import overlapcfg
from overlapcfg import (
    AutoPolicy,
    Bucket,
    BucketPlan,
    ModuleOverride,
    OverlapConfig,
    OverlapConfigError,
    OverlapPolicy,
    TorchManualPolicy,
    load_config,
)


def faults(src, **kw) -> list[str]:
    with pytest.raises(OverlapConfigError) as info:
        load_config(src, **kw)
    assert isinstance(info.value, ValueError)
    return [str(f) for f in info.value.faults]


def only_fault(src, **kw) -> str:
    found = faults(src, **kw)
    assert len(found) == 1, found
    return found[0]


def test_bad_depth_names_path_value_and_expectation():
    msg = only_fault({"plan": "llama_layers", "policy": {"forward_prefetch": "abc"}})
    assert msg == "overlap.policy.forward_prefetch: expected an integer >= 0, got 'abc'"


@pytest.mark.parametrize("value", [-1, 1.5, True, None, "2"])
def test_depth_rejects_non_natural_numbers(value):
    msg = only_fault({"plan": "llama_layers", "policy": {"backward_prefetch": value}})
    assert msg.startswith("overlap.policy.backward_prefetch: expected an integer >= 0, got ")


def test_every_fault_is_reported_at_once():
    found = faults(
        {
            "plan": {"buckets": ["layers.[0-15]", ["norm", 3], {"modules": [], "group_size": 0}, 5]},
            "policy": {"forward_prefetch": -1, "reduce_scatter_delay": "x"},
        }
    )
    paths = [f.split(":")[0] for f in found]
    assert paths == [
        "overlap.plan.buckets[0]",
        "overlap.plan.buckets[1][1]",
        "overlap.plan.buckets[2].modules",
        "overlap.plan.buckets[2].group_size",
        "overlap.plan.buckets[3]",
        "overlap.policy.forward_prefetch",
        "overlap.policy.reduce_scatter_delay",
    ]
    assert "use layers.0:16" in found[0]
    assert "got an integer 3; module names are strings: quote it ('3')" in found[1]
    assert "expected at least 1 item(s), got 0" in found[2]
    assert "expected a value >= 1, got 0" in found[3]
    assert "a list of patterns" in found[4]


def test_union_tags_never_leak_into_paths():
    msg = only_fault({"plan": {"buckets": [{"modules": ["layers.*"], "per": "layers.[0-1]"}]}})
    assert msg.startswith("overlap.plan.buckets[0].per: ")
    assert "<" not in msg.split(":")[0]


def test_unknown_field_suggests_closest():
    msg = only_fault({"plan": "llama_layers", "policy": {"forward_prefetc": 2}})
    assert msg.startswith("overlap.policy.forward_prefetc: unknown field (did you mean 'forward_prefetch'?)")
    assert "valid fields: all_reduce_delay, backward_prefetch" in msg


def test_unknown_top_level_field_suggests_closest():
    msg = only_fault({"plan": "llama_layers", "polcy": {}})
    assert msg.startswith("overlap.polcy: unknown field (did you mean 'policy'?)")


def test_unknown_field_is_reported_with_the_other_faults_of_its_model():
    found = faults({"plan": "llama_layers", "policy": {"forward_prefetch": "x", "foo": 1}})
    assert found[0] == "overlap.policy.forward_prefetch: expected an integer >= 0, got 'x'"
    assert found[1].startswith("overlap.policy.foo: unknown field; valid fields: all_reduce_delay, backward_prefetch")


def test_unknown_preset_lists_available_closest_first():
    msg = only_fault({"plan": "llama_layer"})
    assert msg.startswith("overlap.plan: unknown plan preset 'llama_layer'; available (closest first): llama_layers, ")
    assert "(7 in all)" in msg  # the five closest, then the count: one line
    assert "(did you mean 'llama_layers'" in msg


def test_unknown_strategy_lists_registered_names():
    msg = only_fault({"strategy": "manul", "plan": "llama_layers"})
    assert msg.startswith("overlap.strategy: unknown strategy 'manul'; available (closest first): manual, ")
    for name in ("auto", "none", "torch_manual"):
        assert name in msg
    assert "did you mean 'manual'" in msg


def test_bad_literal_suggests_closest_choice():
    msg = only_fault({"plan": "llama_layers", "policy": {"bucket_mode": "custom_op"}})
    assert msg.startswith("overlap.policy.bucket_mode: expected 'default', 'custom_ops'")
    assert "got 'custom_op'" in msg and "did you mean 'custom_ops'" in msg


def test_plan_is_required_by_plan_based_strategies_only():
    msg = only_fault({"strategy": "manual"})
    assert msg.startswith("overlap.plan: strategy 'manual' needs a plan: a preset name (hf_decoder_layers, "
                          "llama_layers")
    assert load_config({"strategy": "none"}).plan is None
    assert load_config({"strategy": "auto"}).plan is None


@pytest.mark.parametrize("where", [{"policy": {"_target_": "os.system"}},
                                   {"plan": {"buckets": [{"modules": ["x"], "_target_": "a.b"}]}},
                                   {"_target_": "overlapcfg.OverlapConfig"}])
def test_target_keys_are_rejected_anywhere(where):
    msg = only_fault({"plan": "llama_layers", **where})
    assert "'_target_' is not allowed: configs select registered names only" in msg
    assert "._target_:" in msg


def test_target_is_rejected_by_the_models_themselves():
    with pytest.raises(ValueError, match="configs select registered names only"):
        OverlapPolicy.model_validate({"_target_": "os.system"})


def test_empty_override_is_rejected():
    msg = only_fault({"plan": "llama_layers", "overrides": [{"match": "layers.0"}]})
    assert msg.startswith("overlap.overrides[0]: an override must set at least one of")


def test_override_pattern_syntax_is_checked_on_load():
    msg = only_fault({"plan": "llama_layers", "overrides": [{"match": "layers.[0-3]", "forward_prefetch": 0}]})
    assert msg.startswith("overlap.overrides[0].match: ") and "use layers.0:4" in msg


def test_policy_is_validated_against_the_strategy_policy_model():
    cfg = load_config({"strategy": "auto", "policy": {"max_in_flight_gb": 2}})
    assert type(cfg.policy) is AutoPolicy and cfg.policy.max_in_flight_gb == 2
    assert type(load_config({"plan": "llama_layers"}).policy) is OverlapPolicy
    msg = only_fault({"strategy": "auto", "policy": {"forward_prefetch": 2}})
    assert msg.startswith("overlap.policy.forward_prefetch: unknown field") and "max_in_flight_gb" in msg


def test_torch_manual_rejects_settings_upstream_would_ignore():
    found = faults({"strategy": "torch_manual", "plan": "llama_layers",
                    "policy": {"forward_prefetch": 2, "max_inflight_bytes": "1GiB"}})
    assert found == [
        "overlap.policy.forward_prefetch: torch_manual has a fixed depth of 1 (upstream manual_overlap_bucketing),"
        " got 2; use strategy 'manual' for other depths",
        "overlap.policy.max_inflight_bytes: torch_manual has no in-flight cap (upstream manual_overlap_bucketing),"
        " got '1GiB'; use strategy 'manual' for a cap",
    ]
    assert type(load_config({"strategy": "torch_manual", "plan": "llama_layers"}).policy) is TorchManualPolicy


def test_policy_instance_of_other_strategy_is_revalidated():
    cfg = OverlapConfig(strategy="torch_manual", plan="llama_layers", policy=OverlapPolicy(insert_overlap_deps=True))
    assert type(cfg.policy) is TorchManualPolicy and cfg.policy.insert_overlap_deps


@pytest.mark.parametrize(("given", "expected"), [
    (1024, 1024), ("4GiB", 4 * 2**30), ("512 MB", 512 * 10**6), (1e9, 10**9), ("1.5KiB", 1536), ("7", 7),
])
def test_byte_counts_accept_units(given, expected):
    cfg = load_config({"plan": "llama_layers", "policy": {"max_inflight_bytes": given}})
    assert cfg.policy.max_inflight_bytes == expected


@pytest.mark.parametrize("given", [0, -5, "4 GiBs", "lots", True, 1.5])
def test_byte_counts_reject_nonsense(given):
    msg = only_fault({"plan": "llama_layers", "policy": {"max_inflight_bytes": given}})
    assert msg.startswith("overlap.policy.max_inflight_bytes: expected a positive byte count")


def test_fault_paths_use_the_given_root():
    msg = only_fault({"plan": "llama_layers", "policy": {"forward_prefetch": -1}}, root="trainer.overlap")
    assert msg.startswith("trainer.overlap.policy.forward_prefetch: ")


def test_models_are_frozen():
    cfg = load_config({"plan": "llama_layers"})
    with pytest.raises(ValueError, match="frozen"):
        cfg.strategy = "none"  # type: ignore[misc]
    hash(cfg)


def test_string_plan_resolves_to_the_shipped_preset():
    cfg = load_config({"plan": "llama_layers"})
    assert cfg.plan == BucketPlan(buckets=("tok_embeddings", "layers.*", ("norm", "output")), name="llama_layers",
                                  require_full_coverage=True)


def test_entry_forms_are_normalised():
    plan = BucketPlan.model_validate(
        {"buckets": ["a", ["b", "c"], {"modules": ["layers.*"], "group_size": 2, "forward_prefetch": 0}]}
    )
    assert plan.buckets[0] == "a"
    assert plan.buckets[1] == ("b", "c")
    assert plan.buckets[2] == Bucket(modules=("layers.*",), group_size=2, forward_prefetch=0)


ROUND_TRIP = [
    {"plan": "llama_layers"},
    {"plan": "two_layers_per_bucket", "policy": {"max_inflight_bytes": "4GiB", "forward_prefetch": 3},
     "overrides": [{"match": "layers.0", "forward_prefetch": 0}, {"match": "**.output", "reduce_scatter_delay": 2}]},
    {"plan": {"buckets": [{"modules": ["layers.*.attention", "layers.*.attention_norm"], "per": "layers.*"},
                          "**.feed_forward"], "require_full_coverage": True}},
    {"strategy": "auto", "policy": {"collective_bucketing": True, "max_memory_increase_gb": None}},
    {"strategy": "torch_manual", "plan": "single_bucket", "policy": {"insert_overlap_deps": True}},
    {"strategy": "none"},
]


@pytest.mark.parametrize("src", ROUND_TRIP)
def test_configs_round_trip_through_dump_and_yaml(src):
    cfg = load_config(src)
    assert load_config(cfg.model_dump()) == cfg
    assert load_config(cfg.to_yaml()) == cfg
    assert load_config(OmegaConf.create(cfg.model_dump(mode="json"))) == cfg


def test_yaml_text_file_and_dictconfig_load_the_same(tmp_path):
    text = textwrap.dedent("""\
        strategy: manual
        plan: llama_layers
        policy:
          forward_prefetch: 2
          max_inflight_bytes: ${size}
        size: 1GiB
    """)
    # `size` is not a field: interpolation is resolved first, then the unknown key is reported.
    assert only_fault(text).startswith("overlap.size: unknown field")
    text = text.replace("${size}", "1GiB").replace("size: 1GiB\n", "")
    path = tmp_path / "overlap.yaml"
    path.write_text(text)
    from_text, from_file = load_config(text), load_config(path)
    assert from_text == from_file == load_config(OmegaConf.create(text))
    assert "pass pathlib.Path(" in only_fault(str(path))  # a str is YAML text, never a file name
    assert from_file.policy.forward_prefetch == 2 and from_file.policy.max_inflight_bytes == 2**30


def test_interpolations_are_resolved_in_dictconfig():
    node = OmegaConf.create({"depth": 3, "overlap": {"plan": "llama_layers",
                                                     "policy": {"forward_prefetch": "${depth}"}}})
    assert load_config(node.overlap).policy.forward_prefetch == 3


def test_missing_value_is_a_located_fault():
    node = OmegaConf.create({"plan": "???"})
    msg = only_fault(node)
    assert msg.startswith("overlap.plan: required value is missing") and "full_key" not in msg


def test_whole_recipe_with_overlap_key_is_unwrapped():
    assert load_config({"overlap": {"plan": "llama_layers"}}).plan.name == "llama_layers"


def test_missing_file_and_non_mapping_are_reported():
    from pathlib import Path

    assert only_fault(Path("does/not/exist.yaml")) == "overlap: config file 'does/not/exist.yaml' does not exist"
    assert "pass pathlib.Path('does/not/exist.yaml')" in only_fault("does/not/exist.yaml")
    assert only_fault("- a\n- b\n").startswith("overlap: expected a mapping")
    with pytest.raises(TypeError, match="load_config expects"):
        load_config(42)  # type: ignore[arg-type]


def test_from_hydra_uses_the_mount_path():
    root = OmegaConf.create({"trainer": {"overlap": {"plan": "llama_layers", "policy": {"forward_prefetch": -2}}}})
    with pytest.raises(OverlapConfigError) as info:
        overlapcfg.from_hydra(root.trainer.overlap)
    assert str(info.value.faults[0]).startswith("trainer.overlap.policy.forward_prefetch: expected an integer >= 0")


def test_error_message_fits_one_screen():
    with pytest.raises(OverlapConfigError) as info:
        load_config({"plan": "llama_layer", "policy": {"forward_prefetch": "x", "bogus": 1}})
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid overlap config (3 faults):"
    assert len(lines) == 4 and all(len(line) < 240 for line in lines)


def test_module_override_model():
    o = ModuleOverride(match="layers.0:2", backward_prefetch=2)
    assert (o.forward_prefetch, o.backward_prefetch, o.reduce_scatter_delay) == (None, 2, None)


@pytest.mark.parametrize(("text", "where"), [("plan: [a, b\n", "line 2, column 1"), ("a: b: c\n", "line 1, column 5")])
def test_yaml_syntax_errors_are_config_errors_with_a_location(text, where):
    msg = only_fault(text)
    assert msg.startswith("overlap: could not parse YAML: ") and where in msg


def test_settings_lists_each_written_value_where_the_config_writes_it():
    """The one walk over the policy, plan entries written as mappings, and overrides (in the order written); unset
    values and sites without the field write nothing."""
    cfg = load_config({"plan": {"buckets": ["norm", {"modules": ["layers.*"], "reduce_scatter_delay": 2,
                                                     "reshard_after_forward": False}]},
                       "policy": {"reduce_scatter_delay": 0},
                       "overrides": [{"match": "layers.0", "forward_prefetch": 3},
                                     {"match": "layers.1", "reduce_scatter_delay": 1}]}, root="trainer.overlap")
    found = [(s.path("trainer.overlap"), s.value)
             for s in cfg.settings("reduce_scatter_delay", "reshard_after_forward")]
    assert found == [("trainer.overlap.policy.reduce_scatter_delay", 0),
                     ("trainer.overlap.plan.buckets[1].reduce_scatter_delay", 2),
                     ("trainer.overlap.plan.buckets[1].reshard_after_forward", False),
                     ("trainer.overlap.overrides[1].reduce_scatter_delay", 1)]
    assert [s.loc for s in cfg.settings("forward_prefetch", sites=("plan", "overrides"))] == [
        ("overrides", 0, "forward_prefetch")]

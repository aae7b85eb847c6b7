"""Where a config came from is said in one place (``overlapcfg.config.boundary``): the code below the entry points
reports a config's faults relative to it, and the entry point names them where the user put the config."""

from __future__ import annotations

from pathlib import Path

import pytest

import overlapcfg
from overlapcfg.config.boundary import Mount, RelativeConfigError, SettingNote, user_paths
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.module_paths import ModelFacts
from overlapcfg.resolve import resolve_config

FACTS = ModelFacts(("tok_embeddings", "layers", "layers.0", "layers.1", "norm", "output"),
                   ("tok_embeddings", "layers.0", "layers.1", "norm", "output"))


def test_resolution_reports_faults_relative_to_the_config_and_the_boundary_names_the_mount() -> None:
    cfg = overlapcfg.load_config({"plan": {"buckets": ["tok_embeddings", "layer.*"]}}, root="trainer.overlap")
    with pytest.raises(RelativeConfigError) as core:
        resolve_config(cfg, FACTS)
    assert [f.path for f in core.value.faults] == ["plan.buckets[1]"]
    with pytest.raises(OverlapConfigError) as err, user_paths(cfg.mount):
        resolve_config(cfg, FACTS)
    assert type(err.value) is OverlapConfigError  # the user never sees the relative one
    assert [f.path for f in err.value.faults] == ["trainer.overlap.plan.buckets[1]"]
    assert err.value.faults[0].message == core.value.faults[0].message
    assert err.value.header == core.value.header


def test_origins_in_a_resolved_plan_are_relative_to_the_config_wherever_it_is_mounted() -> None:
    data = {"plan": {"buckets": ["layers.*", {"modules": ["norm", "output"], "forward_prefetch": 2}]},
            "overrides": [{"match": "layers.1", "backward_prefetch": 0}]}
    plans = [resolve_config(overlapcfg.load_config(data, root=mount), FACTS) for mount in ("overlap", "a.b")]
    assert plans[0] == plans[1]
    origins = {b.name: dict(b.origins) for b in plans[0].buckets}
    assert origins["layers.1"]["backward_prefetch"] == "overrides[0]"
    assert origins["norm+output"]["forward_prefetch"] == "plan.buckets[1]"
    assert origins["layers.0"]["forward_prefetch"] == "policy"


@pytest.mark.parametrize(("mount", "relative", "shown"), [
    ("overlap", "plan.buckets[1]", "overlap.plan.buckets[1]"),
    ("trainer.overlap", "", "trainer.overlap"),
    ("", "policy.forward_prefetch", "policy.forward_prefetch"),
    ("compare.fast", "[0]", "compare.fast[0]"),
])
def test_a_relative_path_is_shown_below_the_mount(mount: str, relative: str, shown: str) -> None:
    assert Mount(mount).show(relative) == shown


def test_notes_about_settings_are_worded_at_the_users_path_and_other_notes_stay() -> None:
    notes = Mount("trainer.overlap").notes([SettingNote("plan", " is ignored: why"), "bucket 'x': said as is"])
    assert notes == ("trainer.overlap.plan is ignored: why", "bucket 'x': said as is")


def test_errors_that_are_not_relative_pass_through_unchanged() -> None:
    given = OverlapConfigError([Fault("world_size", "expected a number of ranks")])
    with pytest.raises(OverlapConfigError) as err, user_paths(Mount("trainer.overlap")):
        raise given
    assert err.value is given


def test_an_inner_entry_points_translation_is_not_translated_again() -> None:
    """``compare`` applies several configs, each from its own place, inside whatever called it."""
    with pytest.raises(OverlapConfigError) as err, user_paths(Mount("outer")), user_paths(Mount("compare.fast")):
        raise RelativeConfigError([Fault("plan.buckets[0]", "no module")])
    assert [f.path for f in err.value.faults] == ["compare.fast.plan.buckets[0]"]


def test_the_translation_keeps_the_cause() -> None:
    cause = RuntimeError("torch said no")
    with pytest.raises(OverlapConfigError) as err, user_paths(Mount()):
        raise RelativeConfigError([Fault("policy.bucket_mode", "needs torch >= 2.12")]) from cause
    assert err.value.__cause__ is cause and str(err.value) == "overlap.policy.bucket_mode: needs torch >= 2.12"


def test_a_config_read_from_a_file_names_the_file_in_faults_found_later(tmp_path: Path) -> None:
    path = tmp_path / "overlap.yaml"
    path.write_text("plan:\n  buckets: ['layer.*']\n")
    cfg = overlapcfg.load_config(path, root="trainer.overlap")
    assert cfg.mount == Mount("trainer.overlap", str(path)) and cfg.config_root == "trainer.overlap"
    with pytest.raises(OverlapConfigError) as err, user_paths(cfg.mount):
        resolve_config(cfg, FACTS)
    assert f"(config file {path})" in str(err.value).splitlines()[0]
    assert [f.path for f in err.value.faults] == ["trainer.overlap.plan.buckets[0]"]


def test_where_a_config_came_from_is_not_part_of_its_value(tmp_path: Path) -> None:
    path = tmp_path / "overlap.yaml"
    path.write_text("plan: llama_layers\n")
    from_file = overlapcfg.load_config(path)
    from_dict = overlapcfg.load_config({"plan": "llama_layers"}, root="trainer.overlap")
    assert from_file == from_dict and hash(from_file) == hash(from_dict)
    assert from_file.mount != from_dict.mount
    assert overlapcfg.load_config(from_file, root="elsewhere").mount == Mount("elsewhere", str(path))

"""A preset chosen by name (``overlap.policy=aggressive``) is the config the group option
(``overlap/policy=aggressive``) is, fields set on top included: in the ``overlapcfg`` command, in a user's own
``@hydra.main`` app wherever it mounts the group, and through the compose API; never a silently dropped preset.

Every case composes through real Hydra (the compose API in-process, ``@hydra.main`` apps and the console script in
subprocesses) and is held against the group-option spelling of the same command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from overlapcfg import OverlapConfig, from_hydra, load_config
from overlapcfg.config.command_line import hydra_overrides, preset_overrides
from overlapcfg.config.presets import command_conf_dir

MINE = "# a user's own plan preset, without a name of its own\nbuckets:\n  - tok_embeddings\n  - layers.*\n" \
       "  - [norm, output]\n"

# (by-name command line, the same config written with group options), at the mount "overlap"
CASES = {
    "policy then field": (["overlap.policy=aggressive", "overlap.policy.forward_prefetch=4"],
                          ["overlap/policy=aggressive", "overlap.policy.forward_prefetch=4"]),
    "plan then field": (["overlap.plan=per_block_split", "overlap.plan.require_full_coverage=false"],
                        ["overlap/plan=per_block_split", "overlap.plan.require_full_coverage=false"]),
    "Hydra's '+' hint": (["overlap.policy=aggressive", "+overlap.policy.forward_prefetch=4"],
                         ["overlap/policy=aggressive", "overlap.policy.forward_prefetch=4"]),
    "field before the name": (["overlap.policy.forward_prefetch=4", "overlap.policy=aggressive"],
                              ["overlap/policy=aggressive", "overlap.policy.forward_prefetch=4"]),
    "both groups": (["overlap.plan=two_layers_per_bucket", "overlap.policy=memory_saving",
                     "overlap.policy.backward_prefetch=3", "overlap.plan.require_full_coverage=false"],
                    ["overlap/plan=two_layers_per_bucket", "overlap/policy=memory_saving",
                     "overlap.policy.backward_prefetch=3", "overlap.plan.require_full_coverage=false"]),
}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


def _command(overrides: list[str]) -> OverlapConfig:
    """The command's own config, composed from what its ``main`` hands Hydra (``preset_overrides``)."""
    with initialize_config_dir(str(command_conf_dir()), version_base="1.3"):
        return from_hydra(compose("overlapcfg", overrides=preset_overrides(overrides)).overlap)


def _at(mount: str, overrides: list[str]) -> list[str]:
    """``overrides`` written for the group mounted at ``mount`` instead of ``overlap``."""
    out = []
    for o in overrides:
        if o.startswith("overlap/"):
            key, value = o.split("=", 1)
            out.append(f"{key}@{mount}.{key.split('/')[1]}={value}" if mount != "overlap" else o)
        else:
            prefix = o[: len(o) - len(o.lstrip("+"))]
            out.append(prefix + mount + o.lstrip("+").removeprefix("overlap"))
    return out


def _app_conf(tmp_path: Path, mount: str) -> Path:
    conf = tmp_path / "conf"
    (conf / "overlap" / "plan").mkdir(parents=True, exist_ok=True)
    (conf / "overlap" / "plan" / "mine.yaml").write_text(MINE)
    entry = "overlap: default" if mount == "overlap" else f"overlap@{mount}: default"
    (conf / "train.yaml").write_text(f"defaults:\n  - {entry}\n  - _self_\nlr: 0.1\n")
    return conf


def _user(tmp_path: Path, mount: str, overrides: list[str], *, hydra_config: bool = False) -> OverlapConfig:
    with initialize_config_dir(str(_app_conf(tmp_path, mount)), version_base="1.3"):  # the app's presets: inside
        cfg = compose("train", overrides=overrides, return_hydra_config=hydra_config)
        node = cfg
        for part in mount.split("."):
            node = node[part]
        assert isinstance(node, DictConfig)
        return from_hydra(node)


@pytest.mark.parametrize("case", CASES)
def test_the_command_reads_a_preset_by_name_then_its_fields_as_the_group_option(case: str) -> None:
    """The trial: ``overlapcfg overlap.policy=aggressive overlap.policy.forward_prefetch=4`` failed with Hydra's
    "Key 'forward_prefetch' is not in struct"; with Hydra's '+' the preset's depths fell back to 1 silently."""
    by_name, grouped = CASES[case]
    assert _command(by_name) == _command(grouped)


def test_the_command_keeps_the_presets_other_fields() -> None:
    cfg = _command(["overlap.policy=aggressive", "+overlap.policy.forward_prefetch=4"])
    assert (cfg.policy.forward_prefetch, cfg.policy.backward_prefetch, cfg.policy.reduce_scatter_delay) == (4, 2, 2)
    plan = _command(["overlap.plan=per_block_split", "overlap.plan.require_full_coverage=false"]).plan
    assert (plan.name, plan.require_full_coverage, len(plan.buckets)) == ("per_block_split", False, 4)


@pytest.mark.parametrize("mount", ["overlap", "trainer.overlap"])
@pytest.mark.parametrize("case", CASES)
def test_a_user_app_through_the_compose_api_gets_the_group_options_config(tmp_path: Path, mount: str,
                                                                           case: str) -> None:
    by_name, grouped = (_at(mount, c) for c in CASES[case])
    expected = _user(tmp_path, mount, grouped)
    assert _user(tmp_path, mount, hydra_overrides(by_name, mounts=[mount])) == expected
    if any(o.startswith("+") for o in by_name) or case == "field before the name":
        # no helper: Hydra composes (its '+' hint, a field the name then replaced), and from_hydra reads the
        # command line Hydra recorded: the preset with the field on top, not one of them dropped
        assert _user(tmp_path, mount, by_name, hydra_config=True) == expected


@pytest.mark.parametrize("mount", ["overlap", "trainer.overlap"])
def test_a_user_preset_records_its_name_in_both_spellings(tmp_path: Path, mount: str) -> None:
    """The trial: ``overlap/plan=mine`` recorded ``plan.name=None``, ``overlap.plan=mine`` recorded ``mine``."""
    grouped = _user(tmp_path, mount, _at(mount, ["overlap/plan=mine"]), hydra_config=True)
    by_name = _user(tmp_path, mount, [f"{mount}.plan=mine"])
    rewritten = _user(tmp_path, mount, hydra_overrides([f"{mount}.plan=mine"], mounts=[mount]), hydra_config=True)
    assert grouped.plan.name == by_name.plan.name == rewritten.plan.name == "mine"
    assert grouped == by_name == rewritten
    changed = _user(tmp_path, mount, _at(mount, ["overlap/plan=mine", "overlap.plan.buckets=[layers.*]"]),
                    hydra_config=True)
    assert changed.plan.name is None  # no longer the preset: not titled as it


def test_a_field_no_strategy_has_is_refused_before_hydra_with_the_closest_ones() -> None:
    """The trial: a typo inside ``overlap`` in a user's app got Hydra's bare "Key ... is not in struct"."""
    from overlapcfg import OverlapConfigError

    with pytest.raises(OverlapConfigError) as err:
        hydra_overrides(["trainer.overlap.policy=aggressive", "trainer.overlap.policy.forward_prefetc=4",
                         "trainer.overlap.plan.bucket=[x]", "+trainer.overlap.stict=true", "trainer.lr=2"],
                        mounts=["trainer.overlap"])
    lines = str(err.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == [
        "trainer.overlap.policy.forward_prefetc", "trainer.overlap.plan.bucket", "trainer.overlap.stict"]
    assert "did you mean 'forward_prefetch'" in lines[0] and "; manual: " in lines[0] and "; torch_manual: " in lines[0]
    assert "did you mean 'buckets'" in lines[1] and "did you mean 'strict'" in lines[2]
    # fields of another strategy's policy pass (the app's YAML may choose that strategy), set whether the composed
    # preset lists them or not; from_hydra then holds them to the composed strategy's policy
    assert hydra_overrides(["overlap.policy.max_in_flight_gb=2"]) == ["++overlap.policy.max_in_flight_gb=2"]


@pytest.mark.parametrize("group", ["plan", "policy"])
def test_every_shipped_preset_lists_every_field_so_the_command_line_can_set_it(group: str) -> None:
    """Hydra changes only keys that exist: a field a shipped preset leaves out could not be set after choosing it
    (``overlap/policy=auto overlap.policy.bucket_mode=...``), in either spelling."""
    from overlapcfg.config.contracts import contract_of
    from overlapcfg.config.plan import BucketPlan
    from overlapcfg.config.presets import load_preset, preset_names

    for name in preset_names(group):
        data = load_preset(group, name)
        fields = BucketPlan.model_fields if group == "plan" else \
            contract_of(data.get("strategy", "manual")).policy.model_fields
        assert set(fields) <= set(data), (name, sorted(set(fields) - set(data)))


def test_only_plain_names_become_group_options() -> None:
    args = ["overlap.plan=null", "overlap.policy={forward_prefetch:2}", "overlap.plan=choice(a,b)",
            "overlap.policy=True", "other.plan=mine", "~overlap.policy", "--cfg", "job"]
    assert preset_overrides(args) == args
    assert preset_overrides(["overlap.plan=none", "-m", "overlap.policy=default,aggressive",
                             "++trainer.overlap.plan=mine"], mounts=["overlap", "trainer.overlap"]) == [
        "overlap/plan=none", "-m", "overlap/policy=default,aggressive", "overlap/plan@trainer.overlap.plan=mine"]


USER_APP = '''
import sys

import hydra

import overlapcfg


def task(cfg):
    policy = overlapcfg.from_hydra(cfg.trainer.overlap).policy
    plan = overlapcfg.from_hydra(cfg.trainer.overlap).plan
    print("RESULT", plan.name, plan.require_full_coverage, policy.forward_prefetch, policy.backward_prefetch,
          policy.reduce_scatter_delay)


main = hydra.main(config_path="conf", config_name="train", version_base="1.3")(task)
if sys.argv.pop(1) == "helper":
    main = overlapcfg.with_hydra_overrides(mounts=["trainer.overlap"])(main)
main()
'''


def _run_app(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    _app_conf(tmp_path, "trainer.overlap")
    (tmp_path / "app.py").write_text(textwrap.dedent(USER_APP))
    return subprocess.run([sys.executable, "app.py", *args, f"hydra.run.dir={tmp_path / 'run'}"], check=False,
                          cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=120)


def _result(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, out.stderr
    return next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))


@pytest.mark.slow  # five runs of the app, each a process
def test_a_user_hydra_main_app_with_the_decorator_takes_fields_on_a_preset_by_name(tmp_path: Path) -> None:
    """The user's ``mine`` lists ``buckets`` only: with the decorator a field lands whether a preset lists it or
    not, in both spellings."""
    grouped = _result(_run_app(tmp_path, "helper", "overlap/policy@trainer.overlap.policy=aggressive",
                               "trainer.overlap.policy.forward_prefetch=4", "overlap/plan@trainer.overlap.plan=mine",
                               "trainer.overlap.plan.require_full_coverage=true"))
    assert grouped == "RESULT mine True 4 2 2"
    by_name = ["trainer.overlap.policy=aggressive", "trainer.overlap.policy.forward_prefetch=4",
               "trainer.overlap.plan=mine", "trainer.overlap.plan.require_full_coverage=true"]
    assert _result(_run_app(tmp_path, "helper", *by_name)) == grouped
    plain = _run_app(tmp_path, "plain", *by_name)  # Hydra alone cannot: it says so, and suggests '+'
    assert plain.returncode == 1 and "not in struct" in plain.stderr
    hinted = ["trainer.overlap.policy=aggressive", "+trainer.overlap.policy.forward_prefetch=4",
              "trainer.overlap.plan=mine", "+trainer.overlap.plan.require_full_coverage=true"]
    assert _result(_run_app(tmp_path, "plain", *hinted)) == grouped  # Hydra's '+', no decorator: the preset stays
    assert _result(_run_app(tmp_path, "helper", *hinted)) == grouped


def test_a_user_hydra_main_app_with_the_decorator_names_a_misspelled_field(tmp_path: Path) -> None:
    out = _run_app(tmp_path, "helper", "trainer.overlap.policy.forwad_prefetch=4")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "trainer.overlap.policy.forwad_prefetch: unknown field of any strategy's policy (did you mean " \
           "'forward_prefetch'" in out.stderr


@pytest.mark.slow
def test_the_command_runs_a_preset_by_name_with_a_field_as_the_group_option(tmp_path: Path) -> None:
    """The console script end to end: the report's config is the group option's with the field on top."""
    from tests.demo.test_cli import run_cli

    out = run_cli(tmp_path, "model.n_layers=2", "overlap.policy=aggressive", "overlap.policy.forward_prefetch=4",
                  "overlap.plan=per_block_split", "+overlap.plan.require_full_coverage=false",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    expected = load_config({"plan": {**_preset("plan", "per_block_split"), "require_full_coverage": False},
                            "policy": {**_preset("policy", "aggressive"), "forward_prefetch": 4}})
    assert load_config(report["config"]) == expected and report["plan_name"] == "per_block_split"
    assert report["config"]["policy"]["backward_prefetch"] == 2


def _preset(group: str, name: str) -> dict:
    from overlapcfg.config.presets import load_preset

    return load_preset(group, name)

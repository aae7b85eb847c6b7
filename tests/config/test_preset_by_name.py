"""A preset chosen by name (``overlap.policy=aggressive``) is the config the group option
(``overlap/policy=aggressive``) is, fields set on top included: in the ``overlapcfg`` command, in a user's own
``@hydra.main`` app wherever it mounts the group (``overlapcfg.hydra_main`` or ``with_hydra_overrides``), and
through the compose API (``hydra_overrides``); one mechanism, before composing. ``from_hydra`` is a function of the
node alone: what the process ran before never changes the config it gives.

Every case composes through real Hydra (the compose API in-process, ``@hydra.main`` apps and the console script in
subprocesses) and is held against the group-option spelling of the same command line.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from overlapcfg import OverlapConfig, OverlapConfigError, from_hydra, load_config
from overlapcfg.config.command_line import hydra_overrides
from overlapcfg.config.presets import command_conf_dir
from tests.support.hydra_memo import memoized_config_files
from tests.support.warm_cli import WarmCli, shared


@pytest.fixture(autouse=True, scope="module")
def _each_config_file_parsed_once() -> Iterator[None]:
    """Hydra re-parses every file of a composition on each ``compose``; here each distinct text is parsed once
    (``tests/support/hydra_memo.py``): the same compositions, a quarter less work each."""
    with memoized_config_files():
        yield

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
    """The command's own config, composed from what its ``main`` hands Hydra (``hydra_overrides``, strategy
    ``manual`` as ``conf/overlapcfg.yaml`` composes it)."""
    return _composed_once(tuple(overrides))


@functools.cache
def _composed_once(overrides: tuple[str, ...]) -> OverlapConfig:
    """``_command``, composed once per command line: several cases share their group-option spelling, and a
    composition is a function of the command line and the (unchanging) shipped files; the result is frozen."""
    with initialize_config_dir(str(command_conf_dir()), version_base="1.3"):
        return from_hydra(compose("overlapcfg", overrides=hydra_overrides(list(overrides), strategy="manual")).overlap)


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


def _user(tmp_path: Path, mount: str, overrides: list[str], *, helper: bool = False) -> OverlapConfig:
    """``from_hydra`` of the app's node composed with ``overrides``, through ``hydra_overrides`` with ``helper``
    (called inside the compose context, as users do: it sees the app's search path)."""
    with initialize_config_dir(str(_app_conf(tmp_path, mount)), version_base="1.3"):  # the app's presets: inside
        if helper:
            overrides = hydra_overrides(overrides, mounts=[mount])
        cfg = compose("train", overrides=overrides)
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
    assert _user(tmp_path, mount, by_name, helper=True) == expected


@pytest.mark.parametrize("hydra_config", [False, True])
def test_from_hydra_is_a_function_of_the_node_alone(tmp_path: Path, hydra_config: bool) -> None:
    """Issue 38: ``from_hydra`` rebuilt a node from the command line Hydra recorded (the node's own ``hydra`` node,
    else the running job's ``HydraConfig``), so the same node gave the aggressive preset with the field on top in
    one process state and the field alone in another. Now the node decides, whatever Hydra recorded or the process
    ran before; the by-name spelling with fields on top goes through ``hydra_overrides`` (above)."""
    from hydra.core.hydra_config import HydraConfig

    hinted = ["overlap.policy=aggressive", "+overlap.policy.forward_prefetch=4"]  # Hydra's own '+' hint, alone
    with initialize_config_dir(str(_app_conf(tmp_path, "overlap")), version_base="1.3"):
        node = compose("train", overrides=hinted, return_hydra_config=hydra_config).overlap
        recorded = compose("train", overrides=hinted, return_hydra_config=True)
    alone = from_hydra(node)
    assert alone == load_config({"policy": {"forward_prefetch": 4}, "plan": "llama_layers"}) and \
        alone.policy.backward_prefetch == 1  # what Hydra composed: the '+' replaced the name (documented limit)
    HydraConfig.instance().set_config(recorded)  # as inside a @hydra.main job that ran this command line
    try:
        with initialize_config_dir(str(_app_conf(tmp_path, "overlap")), version_base="1.3"):
            plain = compose("train").overlap
        assert from_hydra(node) == alone and from_hydra(plain) == load_config({"plan": "llama_layers"})
    finally:
        HydraConfig.instance().cfg = None  # no job left behind for other tests


@pytest.mark.parametrize("mount", ["overlap", "trainer.overlap"])
def test_a_user_preset_records_its_name_in_both_spellings(tmp_path: Path, mount: str) -> None:
    """The trial: ``overlap/plan=mine`` recorded ``plan.name=None``, ``overlap.plan=mine`` recorded ``mine``. Both
    go through ``hydra_overrides``, which names a plan option without a name of its own after the option."""
    grouped = _user(tmp_path, mount, _at(mount, ["overlap/plan=mine"]), helper=True)
    by_name = _user(tmp_path, mount, [f"{mount}.plan=mine"], helper=True)
    assert grouped.plan.name == by_name.plan.name == "mine"
    assert grouped == by_name
    changed = _user(tmp_path, mount, _at(mount, ["overlap/plan=mine", "overlap.plan.buckets=[layers.*]"]), helper=True)
    assert changed.plan.name is None  # no longer the preset: not titled as it


def test_a_user_preset_inherits_the_shipped_plans_coverage_rule(tmp_path: Path) -> None:
    """Issue 39: a plan of the user's own without ``require_full_coverage`` got the schema's False, while every
    shipped plan sets true. The shipped group's base (``presets/overlap/default.yaml``) gives it what the shipped
    ones have, in both spellings; a plan that says false keeps false."""
    assert "require_full_coverage" not in MINE
    assert _user(tmp_path, "overlap", ["overlap/plan=mine"]).plan.require_full_coverage is True
    assert _user(tmp_path, "overlap", ["overlap.plan=mine"], helper=True).plan.require_full_coverage is True
    assert _user(tmp_path, "overlap", ["overlap/plan=none"]).plan.require_full_coverage is False


def test_a_user_policy_preset_inherits_the_shipped_defaults() -> None:
    """A policy preset of the user's own that lists a few fields gets the others from the schema, whose defaults
    are the shipped ``default`` (and ``auto``) presets' values."""
    from overlapcfg.config.policy import AutoPolicy, OverlapPolicy
    from overlapcfg.config.presets import load_preset

    assert OverlapPolicy() == OverlapPolicy.model_validate(load_preset("policy", "default"))
    auto = load_preset("policy", "auto")
    auto.pop("strategy")
    assert AutoPolicy() == AutoPolicy.model_validate(auto)


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
    args = ["overlap.policy={forward_prefetch:2}", "overlap.plan=[a,b]", "overlap.plan=range(1,3)", "other.plan=mine",
            "~overlap.policy", "overlap.plan=null", "--cfg", "job"]
    assert hydra_overrides(args) == args
    assert hydra_overrides(["overlap.plan=none", "-m", "overlap.policy=default,aggressive",
                            "++trainer.overlap.plan=mine", "overlap.policy=choice(default,aggressive)"],
                           mounts=["overlap", "trainer.overlap"]) == [
        "overlap/plan=none", "-m", "overlap/policy=default,aggressive", "overlap/plan@trainer.overlap.plan=mine",
        "overlap/policy=choice(default,aggressive)"]


def test_a_name_hydra_reads_as_a_number_or_a_boolean_is_looked_up_as_a_name() -> None:
    """Issue 39: a preset or profile named ``nan``, ``inf``, ``true`` or ``1`` got Hydra's "Config group override
    must be a string or a list. Got float". The name is quoted, so the option of that name is what Hydra reads."""
    assert hydra_overrides(["overlap.policy=nan", "overlap/plan=1", "-m", "overlap.policy=inf,default"]) == [
        "overlap/policy='nan'", "overlap/plan='1'", "-m", "overlap/policy='inf',default"]


@pytest.mark.parametrize("mount", ["overlap", "trainer.overlap"])
def test_a_null_policy_is_refused_with_what_to_write(tmp_path: Path, mount: str) -> None:
    """Issue 39: ``overlap.policy=null`` ran the strategy's default policy without a word. Refused before Hydra on
    every route through ``hydra_overrides``, and by ``from_hydra`` in a node Hydra composed alone."""
    option = "overlap/policy" if mount == "overlap" else f"overlap/policy@{mount}.policy"
    with pytest.raises(OverlapConfigError) as before:
        hydra_overrides([f"{mount}.policy=null"], mounts=[mount])
    with initialize_config_dir(str(_app_conf(tmp_path, mount)), version_base="1.3"):
        cfg = compose("train", overrides=[f"{mount}.policy=null"])
    node = cfg.overlap if mount == "overlap" else cfg.trainer.overlap
    with pytest.raises(OverlapConfigError) as after:
        from_hydra(node)
    for err in (before, after):
        assert f"{mount}.policy: null: a policy cannot be unset" in str(err.value)
        assert f"write {option}=default" in str(err.value) and f"{mount}.strategy=none" in str(err.value)


USER_APP = '''
import sys

import hydra

import overlapcfg


def task(cfg):
    policy = overlapcfg.from_hydra(cfg.trainer.overlap).policy
    plan = overlapcfg.from_hydra(cfg.trainer.overlap).plan
    print("RESULT", plan.name, plan.require_full_coverage, policy.forward_prefetch, policy.backward_prefetch,
          policy.reduce_scatter_delay)
    print("ARGV", sys.argv[1:])


how = sys.argv.pop(1)
if how == "main":  # overlapcfg.hydra_main in place of @hydra.main
    main = overlapcfg.hydra_main(config_path="conf", config_name="train", version_base="1.3",
                                 mounts=["trainer.overlap"])(task)
else:
    main = hydra.main(config_path="conf", config_name="train", version_base="1.3")(task)
    if how == "helper":  # with_hydra_overrides above an unchanged @hydra.main line
        main = overlapcfg.with_hydra_overrides(mounts=["trainer.overlap"])(main)
main()
'''


@pytest.fixture
def warm() -> WarmCli:
    """Runs of the app forked from this process's warm server (``tests/support/warm_cli.py``: each still a process
    of its own), for the test that runs it seven times."""
    return shared()


def _run_app(tmp_path: Path, *args: str, warm: WarmCli | None = None) -> subprocess.CompletedProcess[str]:
    _app_conf(tmp_path, "trainer.overlap")
    (tmp_path / "app.py").write_text(textwrap.dedent(USER_APP))
    argv = [sys.executable, "app.py", *args, f"hydra.run.dir={tmp_path / 'run'}"]
    if warm is not None:
        return warm.run(argv, cwd=tmp_path, env=_env(), timeout=120)
    return subprocess.run(argv, check=False, cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=120)


def _result(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, out.stderr
    return next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))


@pytest.mark.slow  # seven runs of the app, each a process
def test_a_user_hydra_main_app_with_the_decorator_takes_fields_on_a_preset_by_name(tmp_path: Path,
                                                                                   warm: WarmCli) -> None:
    """The user's ``mine`` lists ``buckets`` only: with either decorator a field lands whether a preset lists it or
    not, in both spellings, Hydra's '+' hint included; the app's ``sys.argv`` is the command line as written (issue
    38: ``with_hydra_overrides`` rewrote it)."""
    grouped = _result(_run_app(tmp_path, "main", "overlap/policy@trainer.overlap.policy=aggressive",
                               "trainer.overlap.policy.forward_prefetch=4", "overlap/plan@trainer.overlap.plan=mine",
                               "trainer.overlap.plan.require_full_coverage=true", warm=warm))
    assert grouped == "RESULT mine True 4 2 2"
    by_name = ["trainer.overlap.policy=aggressive", "trainer.overlap.policy.forward_prefetch=4",
               "trainer.overlap.plan=mine", "trainer.overlap.plan.require_full_coverage=true"]
    hinted = ["trainer.overlap.policy=aggressive", "+trainer.overlap.policy.forward_prefetch=4",
              "trainer.overlap.plan=mine", "+trainer.overlap.plan.require_full_coverage=true"]
    for how in ("main", "helper"):
        for args in (by_name, hinted):
            out = _run_app(tmp_path, how, *args, warm=warm)
            assert _result(out) == grouped, (how, args)
            written = [*args, f"hydra.run.dir={tmp_path / 'run'}"]
            assert f"ARGV {written}" in out.stdout
    plain = _run_app(tmp_path, "plain", *by_name, warm=warm)  # Hydra alone cannot: it says so, and suggests '+'
    assert plain.returncode == 1 and "not in struct" in plain.stderr
    # ... and composes its '+' as the whole policy (OmegaConf.update replaces the name by a new mapping): the
    # documented limit of an app without the decorator, which from_hydra, a function of the node, cannot undo
    alone = _result(_run_app(tmp_path, "plain", "trainer.overlap.policy=aggressive",
                             "+trainer.overlap.policy.forward_prefetch=4", warm=warm))
    assert alone == "RESULT llama_layers True 4 1 1"


def test_a_user_hydra_main_app_with_the_decorator_names_a_misspelled_field(tmp_path: Path) -> None:
    out = _run_app(tmp_path, "helper", "trainer.overlap.policy.forwad_prefetch=4")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "trainer.overlap.policy.forwad_prefetch: unknown field of any strategy's policy (did you mean " \
           "'forward_prefetch'" in out.stderr


@pytest.mark.slow
def test_the_command_runs_a_preset_by_name_with_a_field_as_the_group_option(tmp_path: Path) -> None:
    """The console script end to end: the report's config is the group option's with the field on top."""
    from tests.demo.test_cli import run_cli

    # one layer: what is checked is the report's config, which the model's size does not touch
    out = run_cli(tmp_path, "model.n_layers=1", "overlap.policy=aggressive", "overlap.policy.forward_prefetch=4",
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

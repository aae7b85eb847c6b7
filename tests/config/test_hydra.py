"""The shipped Hydra config tree and its search-path plugin: composition, both override spellings, mounting,
every preset validating, and discovery from a user's own app in another directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from overlapcfg import OverlapConfig, OverlapConfigError, from_hydra
from overlapcfg.config.presets import command_conf_dir, conf_dir
from tests.support.hydra_memo import memoized_config_files


@pytest.fixture(autouse=True, scope="module")
def _each_config_file_parsed_once() -> Iterator[None]:
    """Hydra re-parses every file of a composition on each ``compose``; here each distinct text is parsed once
    (``tests/support/hydra_memo.py``): the same compositions, a quarter less work each."""
    with memoized_config_files():
        yield


CONF = conf_dir()
COMMAND_CONF = command_conf_dir()
PLANS = sorted(p.stem for p in (CONF / "overlap" / "plan").glob("*.yaml"))
POLICIES = sorted(p.stem for p in (CONF / "overlap" / "policy").glob("*.yaml"))
YAMLS = sorted([*CONF.rglob("*.yaml"), *COMMAND_CONF.rglob("*.yaml")])


def _compose(overrides: list[str] = (), config: str = "overlapcfg") -> DictConfig:
    """The ``overlapcfg`` command's config (its own ``conf/``; ``overlap`` comes through the plugin, as there)."""
    with initialize_config_dir(str(COMMAND_CONF), version_base="1.3"):
        return compose(config, overrides=list(overrides))


def _overlap(overrides: list[str] = ()) -> OverlapConfig:
    return from_hydra(_compose(overrides).overlap)


@pytest.fixture(scope="module")
def app_conf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A user app's primary config that holds only the ``overlap`` group (found via the plugin): where a test is
    about the group's options alone, composing this instead of the command's config (hardware, tune space, the
    command's own keys) gives the same ``overlap`` node for about half the work of a compose."""
    conf = tmp_path_factory.mktemp("app") / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text("defaults:\n  - overlap: default\n  - _self_\n")
    return str(conf)


def _group(conf: str, overrides: list[str]) -> OverlapConfig:
    """``overlap`` as a user app composes it from ``conf`` (``app_conf``)."""
    with initialize_config_dir(conf, version_base="1.3"):
        return from_hydra(compose("config", overrides=list(overrides)).overlap)


def _mounted(tmp_path: Path, overrides: list[str] = ()) -> DictConfig:
    """A user's primary config (in tmp_path) mounting the group at ``trainer.overlap``; found via the plugin."""
    (tmp_path / "conf").mkdir(exist_ok=True)
    (tmp_path / "conf" / "config.yaml").write_text(
        "defaults:\n  - overlap@trainer.overlap: default\n  - _self_\ntrainer:\n  lr: 0.1\n")
    with initialize_config_dir(str(tmp_path / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_required_presets_are_shipped():
    assert {"llama_layers", "single_bucket", "two_layers_per_bucket", "per_block_split", "none"} <= set(PLANS)
    assert {"default", "aggressive", "memory_saving", "auto"} <= set(POLICIES)


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(CONF.parent)))
def test_every_yaml_opens_with_a_comment_saying_what_it_is(path):
    lines = [line for line in path.read_text().splitlines() if not line.startswith("# @package")]
    assert lines[0].startswith("# ") and len(lines[0]) > 20, path


def test_default_composes_manual_llama_layers_depth_one():
    cfg = _overlap()
    assert (cfg.strategy, cfg.plan.name) == ("manual", "llama_layers")
    assert (cfg.policy.forward_prefetch, cfg.policy.backward_prefetch, cfg.policy.reduce_scatter_delay) == (1, 1, 1)


@pytest.mark.parametrize("plan", PLANS)
def test_group_switch_and_preset_name_give_equal_configs(app_conf, plan):
    assert _group(app_conf, [f"overlap/plan={plan}"]) == _group(app_conf, [f"overlap.plan={plan}"])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_and_policy_preset_validates(app_conf, plan, policy):
    cfg = _group(app_conf, [f"overlap/plan={plan}", f"overlap/policy={policy}"])
    assert cfg.plan.name == plan
    assert cfg.strategy == ("auto" if policy == "auto" else "manual")


def test_auto_policy_switches_strategy_and_keeps_the_plan_valid():
    cfg = _overlap(["overlap/policy=auto"])
    assert cfg.strategy == "auto"
    assert type(cfg.policy).__name__ == "AutoPolicy"
    assert cfg.plan.name == "llama_layers"  # allowed for auto: validated, not used


def test_memory_saving_caps_in_flight_bytes():
    assert _overlap(["overlap/policy=memory_saving"]).policy.max_inflight_bytes == 512 * 2**20


def test_field_overrides_reach_the_config():
    cfg = _overlap(["overlap.policy.forward_prefetch=2",
                    "overlap.plan.buckets=[tok_embeddings,layers.*,[norm,output]]"])
    assert cfg.policy.forward_prefetch == 2
    assert cfg.plan.buckets == ("tok_embeddings", "layers.*", ("norm", "output"))


def test_bad_value_fault_names_the_override_path():
    with pytest.raises(OverlapConfigError) as err:
        _overlap(["overlap.policy.forward_prefetch=abc"])
    assert [f.path for f in err.value.faults] == ["overlap.policy.forward_prefetch"]


def test_per_block_split_separates_attention_and_feed_forward():
    from overlapcfg.demo import Llama, LlamaConfig
    from overlapcfg.resolve import resolve_plan

    model = Llama(LlamaConfig(n_layers=2), device="meta")
    fqns = [n for n, _ in model.named_modules() if n]
    owners = list(dict.fromkeys(p.rpartition(".")[0] for p, _ in model.named_parameters()))
    resolved = resolve_plan(_overlap(["overlap/plan=per_block_split"]).plan, fqns, owners)
    modules = [tuple(b.modules) for b in resolved.buckets]
    assert ("layers.0.attention_norm", "layers.0.attention") in modules
    assert ("layers.1.ffn_norm", "layers.1.feed_forward") in modules
    assert len(modules) == 2 + 2 * 2 and not resolved.uncovered


@pytest.mark.parametrize("switch", ["overlap/plan@trainer.overlap.plan=single_bucket",
                                    "trainer.overlap.plan=single_bucket"])
def test_mounted_elsewhere_composes_and_validates(tmp_path, switch):
    # Hydra keys a mounted group's option by group@package; the preset-name spelling needs only the node path.
    cfg = _mounted(tmp_path, [switch, "trainer.overlap.policy.forward_prefetch=2"])
    overlap = from_hydra(cfg.trainer.overlap)
    assert (overlap.plan.name, overlap.policy.forward_prefetch, cfg.trainer.lr) == ("single_bucket", 2, 0.1)
    assert "overlap" not in cfg


def test_mounted_fault_paths_start_at_the_mount_point(tmp_path):
    cfg = _mounted(tmp_path, ["trainer.overlap.policy.forward_prefetch=-1"])
    with pytest.raises(OverlapConfigError) as err:
        from_hydra(cfg.trainer.overlap)
    assert [f.path for f in err.value.faults] == ["trainer.overlap.policy.forward_prefetch"]


@pytest.mark.parametrize("switch", ["overlap/policy@trainer.overlap.policy=auto", "trainer.overlap.policy=auto"])
def test_mounted_auto_policy_selects_the_auto_strategy(tmp_path, switch):
    # The trial: the group option wrote at the absolute package `overlap`, left the mount's policy `???`, and the
    # error read `trainer.overlap.trainer.overlap.policy: MissingMandatoryValue: ... object_type=dict`.
    cfg = _mounted(tmp_path, [switch])
    overlap = from_hydra(cfg.trainer.overlap)
    assert overlap.strategy == "auto" and type(overlap.policy).__name__ == "AutoPolicy"
    assert "overlap" not in cfg  # nothing lands outside the mount
    fixed = _mounted(tmp_path, ["trainer.overlap.strategy=auto", "~trainer.overlap.policy"])
    assert from_hydra(fixed.trainer.overlap).strategy == "auto"


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_group_switch_and_preset_name_give_equal_configs(app_conf, policy):
    assert _group(app_conf, [f"overlap/policy={policy}"]) == _group(app_conf, [f"overlap.policy={policy}"])


def test_a_missing_value_is_named_once_from_the_mount_point():
    cfg = OmegaConf.create({"trainer": {"overlap": {"strategy": "manual", "plan": "llama_layers", "policy": "???"}}})
    with pytest.raises(OverlapConfigError) as err:
        from_hydra(cfg.trainer.overlap)
    (fault,) = err.value.faults
    assert fault.path == "trainer.overlap.policy"
    assert fault.message.startswith("required value is missing") and "full_key" not in fault.message


def test_a_user_apps_own_hardware_group_and_overlapcfg_yaml_do_not_collide_with_ours(tmp_path):
    """Issue 11: the plugin put the whole conf/ tree on every app's search path, so the command's ``hardware``
    group mixed into a user's own and ``overlapcfg.yaml`` was composable. Only the ``overlap`` groups are shared."""
    from hydra.errors import MissingConfigException

    from overlapcfg.compat.omegaconf import hydra_group_options

    conf = tmp_path / "conf"
    (conf / "hardware").mkdir(parents=True)
    (conf / "hardware" / "mine.yaml").write_text("gpus: 8\n")
    (conf / "config.yaml").write_text("defaults:\n  - overlap: default\n  - hardware: mine\n  - _self_\n")
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("config")
        assert hydra_group_options("hardware") == ("mine",)
        assert set(hydra_group_options("overlap/plan")) == set(PLANS)
        with pytest.raises(MissingConfigException) as err:
            compose("config", overrides=["hardware=h100_nvlink"])
        assert list(err.value.options) == ["mine"]
        with pytest.raises(MissingConfigException):
            compose("overlapcfg")
    assert dict(cfg.hardware) == {"gpus": 8}
    assert from_hydra(cfg.overlap).plan.name == "llama_layers"


def test_a_config_file_changed_between_composes_is_read_again(tmp_path):
    """The memo of parsed files (``_each_config_file_parsed_once``) is keyed by the file's text: an edited preset is
    composed as it reads now, and the edit back gives the first config again."""
    (tmp_path / "conf" / "overlap" / "policy").mkdir(parents=True)
    policy = tmp_path / "conf" / "overlap" / "policy" / "mine.yaml"
    (tmp_path / "conf" / "config.yaml").write_text(
        "defaults:\n  - overlap: default\n  - override overlap/policy: mine\n  - _self_\n")
    depths = []
    for depth in (2, 3, 2):
        policy.write_text(f"forward_prefetch: {depth}\n")
        with initialize_config_dir(str(tmp_path / "conf"), version_base="1.3"):
            depths.append(from_hydra(compose("config").overlap).policy.forward_prefetch)
    assert depths == [2, 3, 2]


def test_the_command_keeps_its_hardware_group_and_primary_config():
    cfg = _compose(["hardware=h100_nvlink"])
    assert cfg.hardware.name == "h100_nvlink" and cfg.mode == "run"
    assert "hardware" not in {p.name for p in CONF.iterdir()} and not (CONF / "overlapcfg.yaml").exists()


def _plugin_module():
    import importlib

    return importlib.import_module("hydra_plugins.overlapcfg_searchpath.overlapcfg_searchpath")


def test_plugin_finds_the_same_tree_as_the_package():
    assert _plugin_module().overlapcfg_conf_dir() == CONF


def test_installed_plugin_is_not_a_stale_copy_of_the_source():
    # hatchling copies force-included files into site-packages even for editable installs: after editing the
    # plugin, run `pip install -e .` again. This test says so instead of letting Hydra run the old copy.
    source = Path(__file__).resolve().parents[2] / "overlapcfg" / "_hydra_plugin" / "hydra_plugins"
    source = source / "overlapcfg_searchpath" / "overlapcfg_searchpath.py"
    if not source.is_file():
        pytest.skip("not a source checkout")
    installed = Path(_plugin_module().__file__)
    assert installed.read_text() == source.read_text(), f"{installed} is stale: reinstall (pip install -e .)"


def test_plugin_is_registered_with_hydra():
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    names = [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]
    assert "OverlapcfgSearchPathPlugin" in names


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


USER_APP = '''
import hydra
from omegaconf import OmegaConf

@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    import overlapcfg
    top = overlapcfg.from_hydra(cfg.overlap)
    mounted = overlapcfg.from_hydra(cfg.trainer.overlap)
    print("RESULT", top.plan.name, top.policy.forward_prefetch, mounted.plan.name, mounted.policy.forward_prefetch)

main()
'''


def test_user_app_in_another_directory_discovers_the_group(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(textwrap.dedent("""\
        defaults:
          - overlap: default
          - overlap@trainer.overlap: default
          - _self_
        """))
    (tmp_path / "app.py").write_text(USER_APP)
    out = subprocess.run(
        [sys.executable, "app.py", "overlap/plan=per_block_split", "trainer.overlap.policy.forward_prefetch=3",
         f"hydra.run.dir={tmp_path / 'run'}"],
        check=False, cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RESULT per_block_split 1 llama_layers 3" in out.stdout


def test_the_same_schedule_check_is_switched_and_bounded_from_the_command_line() -> None:
    """The default group carries both fields, so a plain override (no ``+``) reaches them; the timeout is validated
    at its path."""
    cfg = _overlap(["overlap.check_same_schedule=false", "overlap.same_schedule_timeout_s=600"])
    assert (cfg.check_same_schedule, cfg.same_schedule_timeout_s) == (False, 600.0)
    assert _overlap().check_same_schedule is True
    with pytest.raises(OverlapConfigError, match=r"overlap.same_schedule_timeout_s: expected seconds"):
        _overlap(["overlap.same_schedule_timeout_s=0"])

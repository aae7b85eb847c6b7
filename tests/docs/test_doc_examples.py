"""The examples the pages show do what the pages say: the example config applies to the demo model as written,
the torchtitan page's config file and config module are what torchtitan reads, and the Hydra page's app takes a
preset by name and its fields."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from overlapcfg import load_config
from overlapcfg.passes import apply_step
from tests.support.doc_blocks import block_after, torchtitan_command_args
from tests.support.warm_cli import shared


@pytest.mark.slow
def test_the_example_config_applies_to_the_demo_model(traced_2l_reshard):
    cfg = load_config(block_after("## A config", "yaml"))
    step = traced_2l_reshard
    for applied in apply_step(step, cfg).graphs:
        buckets = {b.name: b for b in applied.record.buckets}
        assert buckets["layers.0.attention_norm+layers.0.attention"].forward_prefetch == 0
        assert buckets["layers.1.ffn_norm+layers.1.feed_forward"].forward_prefetch == 0
        assert buckets["norm+output"].forward_prefetch == 2


def test_the_torchtitan_keep_unsharded_example_config_loads():
    cfg = load_config(block_after("## Keeping a bucket unsharded from forward to backward", "yaml"))
    kept = [b for b in cfg.plan.buckets if not isinstance(b, (str, tuple))]
    assert [(b.modules, b.reshard_after_forward) for b in kept] == [(("layers.31",), False)]
    assert cfg.policy.forward_prefetch == 2


@pytest.mark.slow  # two runs of the app, each a process
def test_the_hydra_app_example_takes_a_preset_by_name_and_its_fields(tmp_path):
    """The Hydra page's ``train.py`` as a user's app, the group mounted at ``trainer.overlap``: a preset by name,
    then a field, is the preset with the field on top; a typo under the mount is named with the closest field."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.yaml").write_text("defaults:\n  - overlap@trainer.overlap: default\n  - _self_\n")
    (tmp_path / "train.py").write_text(block_after("## A preset by name, then its fields", "python"))
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:  # a process of its own, forked warm (warm_cli.py)
        return shared().run([sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                            env=env, timeout=120)

    out = run("trainer.overlap.policy=aggressive", "trainer.overlap.policy.forward_prefetch=4")
    assert out.returncode == 0, out.stderr
    assert "forward_prefetch=4 backward_prefetch=2 reduce_scatter_delay=2" in out.stdout
    typo = run("trainer.overlap.policy.forwad_prefetch=4")
    assert typo.returncode == 1 and "did you mean 'forward_prefetch'" in typo.stderr


@pytest.mark.slow
def test_the_torchtitan_config_module_example_selects_the_pipeline(tmp_path, monkeypatch):
    """The graph trainer page's ``my_configs.py``, imported by torchtitan's ``ConfigManager`` as ``--module
    my_configs``."""
    from tests.thirdparty import graph_trainer as G

    recipe = block_after("## `--compile.pass_pipeline overlapcfg` alone does nothing", "python")
    (tmp_path / "my_configs.py").write_text(recipe)
    monkeypatch.syspath_prepend(str(tmp_path))
    with G.graph_trainer_stubs():
        from torchtitan.config import ConfigManager
        from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

        config = ConfigManager().parse_args(["--module", "my_configs", "--config", "llama3_8b_overlapcfg"])
    assert config.compile.pass_pipeline == "overlapcfg"
    assert PASS_PIPELINE_REGISTRY["overlapcfg"].__module__ == "overlapcfg.integrations.torchtitan.graph_trainer"
    assert torchtitan_command_args()[:4] == ["--module", "graph_trainer.llama3", "--config",
                                             "graph_trainer_llama3_8b"]

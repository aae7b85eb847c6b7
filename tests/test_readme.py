"""README's promises: the example config is valid and applies to the demo model as written."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from overlapcfg import compat, load_config
from overlapcfg.passes import apply

README = Path(__file__).resolve().parents[1] / "README.md"


def _block_after(heading: str, lang: str) -> str:
    text = README.read_text()
    section = text.split(heading, 1)[1]
    match = re.search(rf"```{lang}\n(.*?)```", section, flags=re.S)
    assert match, f"no ```{lang} block after {heading!r}"
    return match.group(1)


@pytest.mark.slow
def test_the_example_config_applies_to_the_demo_model(traced_2l_reshard):
    cfg = load_config(_block_after("## A config", "yaml"))
    step = traced_2l_reshard
    with compat.fake_process_group(step.world_size, step.rank):
        for name in ("forward", "backward"):
            gm = apply(copy.deepcopy(step.graph(name)), cfg, module_fqn_fn=step.module_fqn_fn(name),
                       module_fqns=step.module_fqns, graph_kind=name)
            buckets = {b.name: b for b in gm.meta["overlapcfg"].buckets}
            assert buckets["layers.0.attention_norm+layers.0.attention"].forward_prefetch == 0
            assert buckets["layers.1.ffn_norm+layers.1.feed_forward"].forward_prefetch == 0
            assert buckets["norm+output"].forward_prefetch == 2


def test_setup_commands_are_the_first_block():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1).strip().splitlines()
    assert len(first) == 2
    assert "torch==2.13.0" in first[0] and first[0].rstrip().endswith(".venv/bin/overlapcfg")
    assert first[1].startswith(".venv/bin/python -m pytest")


def test_the_torchtitan_keep_unsharded_example_config_loads():
    cfg = load_config(_block_after("**Keeping a bucket unsharded", "yaml"))
    kept = [b for b in cfg.plan.buckets if not isinstance(b, (str, tuple))]
    assert [(b.modules, b.reshard_after_forward) for b in kept] == [(("layers.31",), False)]
    assert cfg.policy.forward_prefetch == 2


def readme_torchtitan_args() -> list[str]:
    """The torchtitan arguments of README's ``torchrun ... -m overlapcfg.integrations.torchtitan ...`` line."""
    import shlex

    words = shlex.split(_block_after("## torchtitan graph trainer", "bash").replace("\\\n", " "))
    return words[words.index("overlapcfg.integrations.torchtitan") + 1:]


@pytest.mark.slow
def test_the_torchtitan_config_module_example_selects_the_pipeline(tmp_path, monkeypatch):
    """README's ``my_configs.py``, imported by torchtitan's ``ConfigManager`` as ``--module my_configs``."""
    from thirdparty import graph_trainer as G

    (tmp_path / "my_configs.py").write_text(_block_after("register the pipeline from your own config module", "python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with G.graph_trainer_stubs():
        from torchtitan.config import ConfigManager
        from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

        config = ConfigManager().parse_args(["--module", "my_configs", "--config", "llama3_8b_overlapcfg"])
    assert config.compile.pass_pipeline == "overlapcfg"
    assert PASS_PIPELINE_REGISTRY["overlapcfg"].__module__ == "overlapcfg.integrations.torchtitan.pipeline"
    assert readme_torchtitan_args()[:4] == ["--module", "graph_trainer.llama3", "--config", "graph_trainer_llama3_8b"]

"""torchtitan's pipeline can neither be silently skipped nor fail on a missing import without saying what to do.

- ``torchrun -m torchtitan.train ... --compile.pass_pipeline overlapcfg`` with nothing importing the integration runs
  torchtitan's default passes without a word (its registry looks names up with a default). A config module selects
  the pipeline with ``select_pipeline``, which it cannot call without importing (registering) it, and which fails
  when the name does not reach overlapcfg's pipeline.
- ``python -m overlapcfg.integrations.torchtitan --help`` on a CPU-only machine ended in torchtitan's own
  ``ModuleNotFoundError`` (tensorboard, then triton). It now prints its usage, what to install
  (``overlapcfg[torchtitan]``) and what runs without a GPU; ``--check`` validates ``OVERLAPCFG_CONFIG`` anywhere.

The subprocess tests fix what is importable with a ``sitecustomize`` (a module blocked, or stubbed as the suite's
graph-trainer fixtures stub it), so they say the same on any machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.paths import README

ROOT = README.parent

SITE = '''
import sys, types

BLOCKED = {blocked!r}
STUBBED = {stubbed!r}


class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
for name, attrs in STUBBED.items():  # importable, as tests/thirdparty/graph_trainer.py stubs them; never called
    module = types.ModuleType(name)
    for attr in attrs:
        setattr(module, attr, lambda *a, **k: None)
    sys.modules[name] = module
'''


def _entry(tmp_path: Path, *args: str, blocked: tuple[str, ...], stubbed: dict[str, tuple[str, ...]] | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITE.format(blocked=blocked, stubbed=stubbed or {})))
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "overlapcfg.integrations.torchtitan", *args], cwd=tmp_path,
                          env=environ, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow  # spawns processes that import torch and torchtitan (seconds each)
def test_help_without_tensorboard_says_what_to_install(tmp_path: Path) -> None:
    out = _entry(tmp_path, "--help", blocked=("tensorboard",))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith("usage: [OVERLAPCFG_CONFIG=")
    assert "imports tensorboard, which is not installed: pip install 'overlapcfg[torchtitan]'" in out.stdout
    assert "Without a GPU:" in out.stdout and "--check" in out.stdout


@pytest.mark.slow
def test_help_on_a_cpu_only_torch_says_the_trainer_needs_a_gpu_and_what_runs_without_one(tmp_path: Path) -> None:
    """tensorboard and datasets present (stubbed), no triton: torchtitan's next missing import."""
    out = _entry(tmp_path, "--help", blocked=("triton",),
                 stubbed={"torch.utils.tensorboard": ("SummaryWriter",), "datasets": ("Dataset", "load_dataset"),
                          "datasets.distributed": ("split_dataset_by_node",)})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    text = " ".join(out.stdout.split())
    assert "imports triton" in text and "comes with a CUDA build of torch" in text
    assert "does not start on a CPU-only machine. What runs there: --check" in text


@pytest.mark.slow
def test_a_run_that_cannot_import_the_trainer_exits_1_with_the_reason_not_a_traceback(tmp_path: Path) -> None:
    out = _entry(tmp_path, "--module", "graph_trainer.llama3", "--config", "graph_trainer_llama3_debugmodel",
                 blocked=("tensorboard",))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "imports tensorboard, which is not installed: pip install 'overlapcfg[torchtitan]'" in out.stderr
    assert "usage:" in out.stderr


@pytest.mark.slow
def test_check_validates_the_config_on_a_machine_where_the_trainer_cannot_start(tmp_path: Path) -> None:
    ok = _entry(tmp_path, "--check", blocked=("tensorboard", "triton"), env={"OVERLAPCFG_CONFIG": "aggressive"})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OVERLAPCFG_CONFIG=aggressive: policy preset 'aggressive'")
    bad = _entry(tmp_path, "--check", blocked=("tensorboard", "triton"), env={"OVERLAPCFG_CONFIG": "agressive"})
    assert bad.returncode == 1 and "did you mean 'aggressive'" in bad.stderr and "Traceback" not in bad.stderr


def test_check_names_what_each_kind_of_value_selects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from overlapcfg.integrations.torchtitan.source import describe_config

    assert describe_config({}).startswith("OVERLAPCFG_CONFIG unset: torchtitan's own buckets")
    (tmp_path / "overlap.yaml").write_text("plan:\n  buckets: [tok_embeddings, layers.*, [norm, lm_head]]\n"
                                           "policy: aggressive\n")
    line = describe_config({"OVERLAPCFG_CONFIG": str(tmp_path / "overlap.yaml")})
    assert "a valid config, strategy manual, plan (unnamed) with 3 entries, forward_prefetch 2" in line
    from overlapcfg import OverlapConfigError

    (tmp_path / "bad.yaml").write_text("plan:\n  buckets: ['layers.[0-3]']\n")
    with pytest.raises(OverlapConfigError, match=r"layers\.0:4"):
        describe_config({"OVERLAPCFG_CONFIG": str(tmp_path / "bad.yaml")})


def _graph_trainer_config() -> object:
    from tests.thirdparty import graph_trainer as G

    with G.graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer.llama3.config_registry import graph_trainer_llama3_debugmodel

        return graph_trainer_llama3_debugmodel()


def test_select_pipeline_sets_the_name_only_where_it_reaches_overlapcfgs_pipeline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.thirdparty import graph_trainer as G

    with G.graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer import registry

        from overlapcfg.integrations.torchtitan import select_pipeline

    config = _graph_trainer_config()
    assert config.compile.pass_pipeline == "default"
    assert select_pipeline(config) is config and config.compile.pass_pipeline == "overlapcfg"
    monkeypatch.delitem(registry.PASS_PIPELINE_REGISTRY, "overlapcfg")  # what torchtitan sees when nothing imported
    fresh = _graph_trainer_config()
    with pytest.raises(RuntimeError, match="torchtitan would run its default passes without a word"):
        select_pipeline(fresh)
    assert fresh.compile.pass_pipeline == "default"  # nothing half-applied
    with pytest.raises(TypeError, match="graph trainer config"):
        select_pipeline(object())


@pytest.mark.slow
def test_the_docs_config_module_fails_loudly_when_the_pipeline_is_not_registered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' ``my_configs.py`` (docs/torchtitan-graph-trainer.md) through torchtitan's ``ConfigManager``
    (``--module my_configs``), with the registry entry gone: an error at config time, not a run on torchtitan's
    default passes."""
    from tests.support.doc_blocks import block_after
    from tests.thirdparty import graph_trainer as G

    recipe = block_after("## `--compile.pass_pipeline overlapcfg` alone does nothing", "python")
    (tmp_path / "my_configs.py").write_text(recipe)
    monkeypatch.syspath_prepend(str(tmp_path))
    with G.graph_trainer_stubs():
        from torchtitan.config import ConfigManager
        from torchtitan.experiments.graph_trainer import registry

        import overlapcfg.integrations.torchtitan  # noqa: F401

        monkeypatch.delitem(registry.PASS_PIPELINE_REGISTRY, "overlapcfg")
        with pytest.raises(RuntimeError, match="does not reach overlapcfg's pipeline"):
            ConfigManager().parse_args(["--module", "my_configs", "--config", "llama3_8b_overlapcfg"])


def test_the_torchtitan_extra_pins_what_the_suite_runs_and_no_torch() -> None:
    """``overlapcfg[torchtitan]``: the versions the conformance suite runs (tests/thirdparty/requirements.txt), plus
    what torchtitan's trainer imports at start; never torch."""
    block = re.search(r"^torchtitan = \[\n(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert block is not None
    extra = re.findall(r'^\s+"([^"]+)",', block.group(1), re.M)
    pins = dict(re.fullmatch(r"([\w.-]+)==([\w.]+)", spec).groups() for spec in extra)  # type: ignore[union-attr]
    assert not any(name.lower() == "torch" for name in pins)
    suite = dict(line.split("==") for line in (ROOT / "tests" / "thirdparty" / "requirements.txt").read_text()
                 .splitlines() if "==" in line and not line.startswith("#"))
    for name in ("torchtitan", "spmd_types", "torchdata", "tyro", "docstring_parser", "typeguard"):
        assert pins[name] == suite[name], name
    assert {"tensorboard", "datasets"} <= set(pins)

"""torchtitan's main trainer (eager FSDP2, ``use_overlapcfg``) says the truth on every machine.

Found by a new user: the example's docstring suggested ``OVERLAPCFG_CONFIG=aggressive`` and README called presets
valid "as for the graph trainer", while the FSDP2 driver refuses ``aggressive``; without a GPU, importing
``examples/torchtitan/overlap_configs.py`` died on ``ModuleNotFoundError: triton``; and this path had no
``--check``. Now the example imports without triton, ``python -m overlapcfg.integrations.torchtitan --check
--module M --config C`` checks a config against the config function's model (built on the meta device) as the
trainer will, every ``OVERLAPCFG_CONFIG=...`` the example and README suggest for this path passes it, a refused
preset names the nearest one the driver runs, and the presets it runs are listed wherever presets are.

The subprocesses run with triton blocked (a CPU-only machine) and tensorboard and datasets stubbed (installed by
``overlapcfg[torchtitan]``, not by README's test environment), as ``test_torchtitan_entry_point.py`` does. The
``--check`` runs on that set-up are forked from one server (``tests/support/warm_cli.py``) started with it, which has
imported torch and overlapcfg's torchtitan integration first (about four of each run's eight seconds); the two runs
about what is importable at all start fresh interpreters of their own.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from overlapcfg import OverlapConfigError
from tests.support.paths import README
from tests.support.warm_cli import WarmCli

ROOT = README.parent
EXAMPLE = ROOT / "examples" / "torchtitan" / "overlap_configs.py"
SECTION = "## torchtitan's main trainer (eager FSDP2)"
TRAINERS_PAGE = ROOT / "docs" / "trainers.md"
HYDRA_PAGE = ROOT / "docs" / "hydra.md"

SITE = '''
import sys, types

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
for name, attrs in {stubbed!r}.items():  # importable, as tests/thirdparty/graph_trainer.py stubs them; never called
    module = types.ModuleType(name)
    for attr in attrs:
        setattr(module, attr, lambda *a, **k: None)
    sys.modules[name] = module
'''
INSTALLED = {"torch.utils.tensorboard": ("SummaryWriter",), "datasets": ("Dataset", "load_dataset"),
             "datasets.distributed": ("split_dataset_by_node",)}
"""What ``overlapcfg[torchtitan]`` installs and torchtitan's config registry imports, stubbed."""


def _site(where: Path, blocked: tuple[str, ...], stubbed: dict[str, tuple[str, ...]] | None) -> Path:
    site = where / "site"
    site.mkdir(exist_ok=True)
    stubs = INSTALLED if stubbed is None else stubbed
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITE.format(blocked=blocked, stubbed=stubs)))
    return site


def _environ(site: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join([str(site), str(ROOT), str(EXAMPLE.parent)])
    environ = {k: v for k, v in os.environ.items() if k != "OVERLAPCFG_CONFIG"}
    environ.update({"PYTHONPATH": path, **(env or {})})
    return environ


def _run(tmp_path: Path, args: list[str], *, env: dict[str, str] | None = None, blocked: tuple[str, ...] = ("triton",),
         stubbed: dict[str, tuple[str, ...]] | None = None) -> subprocess.CompletedProcess[str]:
    environ = _environ(_site(tmp_path, blocked, stubbed), env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=300, check=False)


RUN_AS_MAIN = "import runpy, sys; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
"""``python -m MODULE ARGS`` as ``python -c`` runs it (``alter_sys``: ``sys.argv[0]`` becomes the module's file)."""


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """``check(config, env=...)``: ``python -m overlapcfg.integrations.torchtitan --check --module overlap_configs
    --config CONFIG`` with triton blocked and the trainer's packages stubbed (``_run``'s defaults), each run a
    process of its own forked from a server started with the same ``sitecustomize``, ``PYTHONPATH`` and environment
    (``OVERLAPCFG_CONFIG`` is read when the check runs, not at import)."""
    site = _site(tmp_path_factory.mktemp("check"), ("triton",), None)
    # Not torchtitan's model registry: the check imports it inside ``without_triton``, as it must be.
    with WarmCli(preload=("torch", "overlapcfg.integrations.torchtitan"), env=_environ(site)) as server:

        def run(config: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
            argv = [sys.executable, "-c", RUN_AS_MAIN, "overlapcfg.integrations.torchtitan", "--check", "--module",
                    "overlap_configs", "--config", config]
            return server.run(argv, cwd=ROOT, env=_environ(site, env), timeout=300)

        yield run


def _docstrings() -> str:
    """The module and function docstrings of the torchtitan examples."""
    texts = []
    for path in sorted(EXAMPLE.parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        texts += [ast.get_docstring(n) or "" for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.FunctionDef)]
    return "\n".join(texts)


def _readme_section() -> str:
    text = TRAINERS_PAGE.read_text().split(SECTION, 1)[1]
    return text.split("\n## ", 1)[0]


def suggested_values() -> list[str]:
    """Every ``OVERLAPCFG_CONFIG=<value>`` the examples' docstrings and the main-trainer section of
    docs/trainers.md suggest (placeholders such as ``<its path>`` and ``...`` left out)."""
    found = re.findall(r"OVERLAPCFG_CONFIG=([^\s`'\"<>;,)]+)", _docstrings() + "\n" + _readme_section())
    return sorted({v for v in found if v not in ("...",)})


# --- every machine --------------------------------------------------------------------------------------------------

@pytest.mark.slow  # a process importing torch and overlapcfg's integration
def test_the_example_imports_without_triton_or_torchtitans_trainer_packages(tmp_path: Path) -> None:
    out = _run(tmp_path, ["-c", "import overlap_configs; print(sorted(n for n in dir(overlap_configs) "
                                "if n.startswith('llama3')))"],
               blocked=("triton", "tensorboard", "datasets"), stubbed={})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['llama3_8b_overlapcfg', 'llama3_debugmodel_overlapcfg']"


def test_the_examples_and_readme_suggest_values_for_this_path() -> None:
    values = suggested_values()
    assert "examples/torchtitan/overlap.yaml" in values and "memory_saving" in values
    assert "aggressive" not in values and "auto" not in values


@pytest.mark.slow  # one process per value (forked from the warm server), each building the 8B model on the meta device
@pytest.mark.parametrize("value", suggested_values())
def test_every_suggested_value_passes_check_against_the_model_without_a_gpu(
        check: Callable[..., subprocess.CompletedProcess[str]], value: str) -> None:
    out = check("llama3_8b_overlapcfg", env={"OVERLAPCFG_CONFIG": value})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith(f"OVERLAPCFG_CONFIG={value}: fits Llama3Model (34 FSDP2 groups: tok_embeddings,")


@pytest.mark.slow
def test_check_refuses_aggressive_naming_the_nearest_preset_and_the_file_that_keeps_its_depth(
        check: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    out = check("llama3_debugmodel_overlapcfg", env={"OVERLAPCFG_CONFIG": "aggressive"})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    text = " ".join(out.stderr.split())
    assert "OVERLAPCFG_CONFIG=aggressive.policy.reduce_scatter_delay: FSDP2 has no per-bucket reduce-scatter" in text
    assert ("'aggressive' is a policy preset the FSDP2 driver cannot run (above); the presets it runs: default, "
            "memory_saving; nearest: OVERLAPCFG_CONFIG=default") in text
    assert "policy: {forward_prefetch: 2, backward_prefetch: 2, reduce_scatter_delay: 1}" in text


@pytest.mark.slow
def test_check_without_the_trainers_packages_says_what_to_install(tmp_path: Path) -> None:
    out = _run(tmp_path, ["-m", "overlapcfg.integrations.torchtitan", "--check", "--module", "overlap_configs",
                          "--config", "llama3_8b_overlapcfg"], blocked=("triton", "tensorboard"), stubbed={})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "imports tensorboard (through torchtitan), which is not installed: pip install 'overlapcfg[torchtitan]'" \
        in out.stderr


# --- in process, a torchtitan-shaped stand-in ------------------------------------------------------------------------

class _Decoder(nn.Module):
    """torchtitan's decoder layout: ``tok_embeddings``, ``layers`` (a ModuleDict), ``norm``, ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 4)
        self.layers = nn.ModuleDict({"0": nn.Linear(4, 4), "1": nn.Linear(4, 4)})
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 8)


def apply_fsdp_to_decoder(*args: Any, **kwargs: Any) -> None:
    """Named as torchtitan's FSDP step (``_parallelize`` has the shape of its ``parallelize_*``)."""
    raise AssertionError("--check never runs the trainer's parallelize")


def _parallelize(model: nn.Module, **kwargs: Any) -> nn.Module:
    apply_fsdp_to_decoder(model)
    return model


def _trainer_config(parallelize: Any) -> Any:
    """What a config function returns, as far as ``check_trainer_config`` reads it."""
    parallelism = types.SimpleNamespace(pipeline_parallel_degree=1, expert_parallel_degree=1,
                                        fsdp_reshard_after_forward="default")
    spec = types.SimpleNamespace(parallelize_fn=parallelize, model=types.SimpleNamespace(build=_Decoder))
    return types.SimpleNamespace(model_spec=spec, parallelism=parallelism)


def test_the_presets_the_fsdp2_driver_runs_are_listed_wherever_presets_are() -> None:
    from overlapcfg.integrations.torchtitan.__main__ import USAGE
    from overlapcfg.integrations.torchtitan.fsdp2 import fsdp2_presets

    assert fsdp2_presets() == ("default", "memory_saving")
    listed = "`, `".join(fsdp2_presets())
    assert f"Policy presets the FSDP2 driver runs: `{listed}`." in " ".join(_readme_section().split())
    hydra = " ".join(HYDRA_PAGE.read_text().split())
    assert f"Policy presets the FSDP2 driver runs (`fully_shard`, the trainer integrations): `{listed}`." in hydra
    assert f"Presets the FSDP2 driver runs: {', '.join(fsdp2_presets())}." in " ".join(USAGE.split())
    docstring = " ".join(_docstrings().split())
    assert "a policy preset the FSDP2 driver runs on the same grouping" in docstring
    for name in fsdp2_presets():
        assert f"``{name}``" in docstring or f"OVERLAPCFG_CONFIG={name}" in docstring, name
    assert "``aggressive`` and ``auto`` are refused on this path" in docstring


@pytest.mark.parametrize(("value", "nearest"), [("aggressive", "default"), ("auto", "default")])
def test_a_refused_preset_names_the_nearest_one_the_driver_runs(monkeypatch: pytest.MonkeyPatch, value: str,
                                                                nearest: str) -> None:
    from overlapcfg.integrations.torchtitan.fsdp2 import check_trainer_config, parallelize_fn

    monkeypatch.setenv("OVERLAPCFG_CONFIG", value)
    with pytest.raises(OverlapConfigError) as err:
        check_trainer_config(_trainer_config(parallelize_fn(_parallelize)))
    text = str(err.value)
    assert f"OVERLAPCFG_CONFIG='{value}' does not fit the model" in text
    assert f"the presets it runs: default, memory_saving; nearest: OVERLAPCFG_CONFIG={nearest}" in text


def test_check_describes_what_the_trainer_will_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlapcfg.integrations.torchtitan.fsdp2 import check_trainer_config, parallelize_fn

    monkeypatch.setenv("OVERLAPCFG_CONFIG", "memory_saving")
    line = check_trainer_config(_trainer_config(parallelize_fn(_parallelize)))
    assert line.startswith("OVERLAPCFG_CONFIG=memory_saving: fits _Decoder (4 FSDP2 groups: tok_embeddings, "
                           "layers.0, layers.1, norm+lm_head)"), line  # in the order the model runs them
    assert "forward_prefetch 1, backward_prefetch 1, reduce_scatter_delay 1" in line


def test_check_of_a_config_overlapcfg_does_not_shard_says_so() -> None:
    from overlapcfg.errors import OverlapUsageError
    from overlapcfg.integrations.torchtitan.fsdp2 import check_trainer_config

    with pytest.raises(OverlapUsageError, match="not overlapcfg's: this config does not shard with overlapcfg"):
        check_trainer_config(_trainer_config(_parallelize))

"""README's promises: the example config is valid and applies to the demo model as written, and every Python
block runs as it stands (pasted into a fresh file: no name from elsewhere), under ``torchrun`` where it says so.

A block's first line says how it runs: ``# torchrun --nproc-per-node 2 <file>.py`` (a job only), or ``# python
<file>.py   (or, as a 2-rank job: torchrun --nproc-per-node 2 <file>.py)`` (both), else a single process. Single
processes run in this one (a fresh namespace, a scratch working directory: imports are shared, names are not);
jobs run as ``torchrun --standalone --nproc-per-node 2`` on gloo (``--standalone``: a free port, so runs in parallel
do not collide).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overlapcfg import load_config
from overlapcfg.passes import apply_step
from tests.support.exit_watch import finalized_under_gloo
from tests.support.paths import EXAMPLES, README
from tests.support.readme import block_after, readme_torchtitan_args

TORCHRUN = Path(sys.executable).with_name("torchrun")
EXIT_WATCH = Path(__file__).resolve().parents[1] / "support" / "exit_watch.py"
JOB = "torchrun --nproc-per-node 2"


def _python_blocks() -> list[tuple[str, str]]:
    """``(section heading, code)`` of every ```python block, in README order."""
    out = []
    for section in README.read_text().split("\n## ")[1:]:
        heading = section.splitlines()[0]
        out += [(heading, code) for code in re.findall(r"```python\n(.*?)```", section, flags=re.S)]
    return out


BLOCKS = _python_blocks()


MODULE_BLOCK = re.compile(r"^# (\w+)\.py$")
"""A block whose first line names a module file (``# my_configs.py``) is a module another program imports, not a
script: it is run by the test written for that program (torchtitan's ``ConfigManager`` below)."""
MODULE_BLOCK_TESTS = {"my_configs": "test_the_torchtitan_config_module_example_selects_the_pipeline",
                      "train": "test_the_hydra_app_example_takes_a_preset_by_name_and_its_fields"}


EXAMPLE_TESTS = {"measure_steps/measure_steps.py": ("multiprocess/test_calibrate_measure_command.py",
                                                    "test_the_measure_example_runs_under_torchrun")}
"""A block that is an example file word for word (README says so and how to run it) is run by that example's
test, under the launcher the example names; here it is only checked to be the file."""


def _example_of(code: str) -> str | None:
    return next((name for name in EXAMPLE_TESTS if (EXAMPLES / name).read_text() == code), None)


def _modes(code: str) -> list[str]:
    first = code.splitlines()[0]
    if MODULE_BLOCK.match(first) or _example_of(code) is not None:
        return []
    if first.startswith(f"# {JOB}"):
        return ["job"]
    return ["single", "job"] if JOB in first else ["single"]


RUNS = [pytest.param(heading, code, mode, id=f"{heading.split(':')[0].split('`')[0].strip()}-{mode}")
        for heading, code in BLOCKS for mode in _modes(code)]


def _expect(heading: str, mode: str, out: str) -> None:
    """What a block must have printed, beyond running without an error."""
    if heading == "Your own model":
        ranks = (0, 1) if mode == "job" else (0,)
        for rank in ranks:
            assert re.search(rf"rank {rank} forward: 21 -> [1-4] FSDP collectives", out), out[-2000:]
            assert re.search(rf"rank {rank} backward: 41 -> [2-8] FSDP collectives", out), out[-2000:]
        assert out.count("blocks model.layers.*") == 1  # printed by rank 0 only
        assert "overlapcfg: strategy manual, plan hf_decoder_layers, traced at world size 2" in out
        assert "Prediction: h100_nvlink, world size 64 (traced at 2)" in out  # each figure says its world size
    if heading.startswith("In Python"):
        assert "overlapcfg: strategy manual, plan llama_layers" in out and "Prediction: h100_nvlink" in out


def _check_own_model(names: dict[str, Any]) -> None:
    """The walk-through on a Hugging Face Llama, beyond its printout: what the capture holds, what tune read off the
    module tree, that the winner compiled with every collective bucketed, and that the backend's own capture is the
    same step."""
    import overlapcfg

    step, result, backend = names["step"], names["result"], names["backend"]
    assert (step.world_size, step.rank, len(step.param_fqns)) == (2, 0, 21)
    assert step.param_owners[0] == "model.embed_tokens" and step.param_fqns[-1] == "lm_head.weight"
    assert dict(zip(step.module_fqns, step.module_types, strict=True))["model.layers.1"] == "LlamaDecoderLayer"
    assert len(step.collectives_in("backward", "reduce_scatter")) == 21
    assert result.space.blocks == "model.layers.*"
    assert result.space.block_parts == (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))
    for name in ("forward", "backward"):
        record = backend.graphs[name].meta["overlapcfg"]
        assert not record.uncovered and record.after.total_fsdp < record.before.total_fsdp
    again = backend.step()
    assert (again.param_fqns, again.module_fqns) == (step.param_fqns, step.module_fqns)
    reports = [overlapcfg.explain(s, result.config) for s in (again, step)]
    assert reports[0].buckets == reports[1].buckets
    assert [g.order for g in reports[0].graphs] == [g.order for g in reports[1].graphs]


def _prerequisites(heading: str, code: str, home: Path) -> None:
    """Files a block reads that the commands before it in README write: ``node_costs.json`` (``mode=measure``) and
    the ``my_cluster`` profile (``mode=calibrate``). Made here from the demo step and a shipped profile, so the
    block runs on what it would find, without a cluster."""
    if "node_costs.json" not in code:
        return
    import overlapcfg
    from overlapcfg.cost.node_costs import MEASURABLE_KINDS, NodeCosts, node_signature
    from overlapcfg.cost.price import node_kind
    from overlapcfg.demo import LlamaConfig

    profile = overlapcfg.load_hardware("cpu_gloo").model_copy(update={"name": "my_cluster"})
    overlapcfg.save_hardware(profile)
    step = overlapcfg.trace_train_step(LlamaConfig(n_layers=4, vocab_size=8192), reshard_after_forward=True,
                                       batch=8, seq_len=128)
    graphs = {name: {n.name: (node_signature(n), 1e-5) for n in gm.graph.nodes if node_kind(n) in MEASURABLE_KINDS}
              for name, gm in (("forward", step.forward), ("backward", step.backward))}
    Path("node_costs.json").write_text(NodeCosts(source="README test", graphs=graphs).to_json())
    assert home.joinpath("hardware", "my_cluster.yaml").is_file(), heading


@pytest.mark.slow
@pytest.mark.parametrize("heading, code, mode", RUNS)
def test_every_python_block_runs_as_written(heading: str, code: str, mode: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                            ) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OVERLAPCFG_HOME", str(tmp_path / "home"))
    _prerequisites(heading, code, tmp_path / "home")
    if mode == "single":
        names: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(code, f"README.md ({heading})", "exec"), names)
        out = capsys.readouterr().out
        if heading == "Your own model":
            _check_own_model(names)
    else:
        script = tmp_path / "block.py"
        script.write_text(code)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
        watched = [str(EXIT_WATCH), str(tmp_path / "exit"), str(script)]  # the block as torchrun runs it
        done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *watched], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        assert "unwaited collective" not in done.stderr
        # A rank finalizing Python while gloo's threads run aborts now and then after its last step (exit -6):
        # certain here, where the abort itself is rare. README's FSDP2 block ends with overlapcfg.exit_process.
        assert finalized_under_gloo(tmp_path / "exit") == {}, heading
        out = done.stdout
    _expect(heading, mode, out)


def test_the_python_blocks_are_found_and_each_says_how_it_runs() -> None:
    """A block the runner above does not see is a block nobody checks."""
    headings = [h for h, _ in BLOCKS]
    assert len(BLOCKS) == README.read_text().count("```python")
    assert {"In Python", "Your own model"} <= set(headings)
    assert [m for h, c in BLOCKS if h == "Your own model" for m in _modes(c)] == ["single", "job"]
    assert any(_modes(c) == ["job"] for h, c in BLOCKS if h.startswith("Eager FSDP2"))
    modules = [m.group(1) for _, c in BLOCKS if (m := MODULE_BLOCK.match(c.splitlines()[0]))]
    assert modules and all(MODULE_BLOCK_TESTS.get(name) in globals() for name in modules), modules
    examples = [name for _, c in BLOCKS if (name := _example_of(c)) is not None]
    assert examples == list(EXAMPLE_TESTS), examples
    for name in examples:
        test_file, test = EXAMPLE_TESTS[name]
        text = (README.parent / "tests" / test_file).read_text()
        assert f"def {test}(" in text and name.split("/")[-1] in text, (name, test_file, test)


@pytest.mark.slow
def test_the_example_config_applies_to_the_demo_model(traced_2l_reshard):
    cfg = load_config(block_after("## A config", "yaml"))
    step = traced_2l_reshard
    for applied in apply_step(step, cfg).graphs:
        buckets = {b.name: b for b in applied.record.buckets}
        assert buckets["layers.0.attention_norm+layers.0.attention"].forward_prefetch == 0
        assert buckets["layers.1.ffn_norm+layers.1.feed_forward"].forward_prefetch == 0
        assert buckets["norm+output"].forward_prefetch == 2


def test_setup_commands_are_the_first_block():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1).strip().splitlines()
    assert len(first) == 2
    assert "torch==2.13.0" in first[0] and first[0].rstrip().endswith(".venv/bin/overlapcfg")
    assert first[1].startswith(".venv/bin/python -m pytest")


def test_the_torchtitan_keep_unsharded_example_config_loads():
    cfg = load_config(block_after("**Keeping a bucket unsharded", "yaml"))
    kept = [b for b in cfg.plan.buckets if not isinstance(b, (str, tuple))]
    assert [(b.modules, b.reshard_after_forward) for b in kept] == [(("layers.31",), False)]
    assert cfg.policy.forward_prefetch == 2


@pytest.mark.slow  # two runs of the app, each a process
def test_the_hydra_app_example_takes_a_preset_by_name_and_its_fields(tmp_path):
    """README's ``train.py`` as a user's app, the group mounted at ``trainer.overlap``: a preset by name, then a
    field, is the preset with the field on top; a typo under the mount is named with the closest field."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.yaml").write_text("defaults:\n  - overlap@trainer.overlap: default\n  - _self_\n")
    (tmp_path / "train.py").write_text(block_after("**A preset by name, then its fields.**", "python"))
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120, check=False)

    out = run("trainer.overlap.policy=aggressive", "trainer.overlap.policy.forward_prefetch=4")
    assert out.returncode == 0, out.stderr
    assert "forward_prefetch=4 backward_prefetch=2 reduce_scatter_delay=2" in out.stdout
    typo = run("trainer.overlap.policy.forwad_prefetch=4")
    assert typo.returncode == 1 and "did you mean 'forward_prefetch'" in typo.stderr


@pytest.mark.slow
def test_the_torchtitan_config_module_example_selects_the_pipeline(tmp_path, monkeypatch):
    """README's ``my_configs.py``, imported by torchtitan's ``ConfigManager`` as ``--module my_configs``."""
    from tests.thirdparty import graph_trainer as G

    recipe = block_after("**`--compile.pass_pipeline overlapcfg` alone does nothing.**", "python")
    (tmp_path / "my_configs.py").write_text(recipe)
    monkeypatch.syspath_prepend(str(tmp_path))
    with G.graph_trainer_stubs():
        from torchtitan.config import ConfigManager
        from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

        config = ConfigManager().parse_args(["--module", "my_configs", "--config", "llama3_8b_overlapcfg"])
    assert config.compile.pass_pipeline == "overlapcfg"
    assert PASS_PIPELINE_REGISTRY["overlapcfg"].__module__ == "overlapcfg.integrations.torchtitan.pipeline"
    assert readme_torchtitan_args()[:4] == ["--module", "graph_trainer.llama3", "--config", "graph_trainer_llama3_8b"]

"""Every Python and shell block of README and of the documentation site runs as it stands, or says why not.

The runs are marked ``docs`` (and ``slow``): they take minutes together, so they are a step of their own in
``.ci/run`` (``pytest -m docs tests/docs``) and ``conftest.py`` leaves them out of every run whose ``-m`` does not
name ``docs``. What is not left out of any run is ``test_every_block_is_run_or_says_why_not``: a block that is
neither run here nor marked ``<!-- not run: reason -->`` fails the fast tier.

**Python blocks.** A block's first line says how it runs: ``# torchrun --nproc-per-node 2 <file>.py`` (a job only),
or ``# python <file>.py   (or, as a 2-rank job: torchrun --nproc-per-node 2 <file>.py)`` (both), else a single
process. Single processes run in this one (a fresh namespace, a scratch working directory: imports are shared,
names are not); jobs run as ``torchrun --standalone --nproc-per-node 2`` on gloo (``--standalone``: a free port, so
runs in parallel do not collide). A block whose first line names a module (``# my_configs.py``) is imported by the
test written for the program that imports it, and a block that is an example file word for word is run by that
example's test (both named below, and checked to exist).

**Shell blocks** run with bash (``-euo pipefail``: every command must succeed) in a scratch directory holding links
to the checkout's top-level entries, so ``.venv/bin/overlapcfg`` and ``examples/...`` resolve as in the checkout
while outputs (Hydra run directories, ``tuned.yaml``) land in the scratch directory; ``.venv/bin`` is first on
``PATH``; torchrun gets a free port (``PET_STANDALONE``); profiles go to a scratch ``$OVERLAPCFG_HOME``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.doc_blocks import SHOWN_LANGS, DocBlock, all_blocks
from tests.support.exit_watch import finalized_under_gloo
from tests.support.paths import EXAMPLES, REPO, TESTS

TORCHRUN = Path(sys.executable).with_name("torchrun")
EXIT_WATCH = TESTS / "support" / "exit_watch.py"
JOB = "torchrun --nproc-per-node 2"
SHELL_TIMEOUT_S = 1500
"""A shell block is a list of commands, each tracing or training for tens of seconds on 2 loaded cores."""

MODULE_BLOCK = re.compile(r"^# (\w+)\.py$")
MODULE_BLOCK_TESTS = {
    "my_configs": ("docs/test_doc_examples.py", "test_the_torchtitan_config_module_example_selects_the_pipeline"),
    "train": ("docs/test_doc_examples.py", "test_the_hydra_app_example_takes_a_preset_by_name_and_its_fields"),
}
"""A block whose first line names a module file is a module another program imports, not a script: it is run by
the test written for that program."""
EXAMPLE_TESTS = {"measure_steps/measure_steps.py": ("multiprocess/test_calibrate_measure_command.py",
                                                    "test_the_measure_example_runs_under_torchrun")}
"""A block that is an example file word for word (the page says so and how to run it) is run by that example's
test, under the launcher the example names; here it is only checked to be the file."""


def _example_of(code: str) -> str | None:
    return next((name for name in EXAMPLE_TESTS if (EXAMPLES / name).read_text() == code), None)


def _run_elsewhere(block: DocBlock) -> tuple[str, str] | None:
    """``(test file, test)`` that runs a Python block, where that is not this module."""
    module = MODULE_BLOCK.match(block.code.splitlines()[0])
    if module:
        return MODULE_BLOCK_TESTS.get(module.group(1), ("?", f"a test for {module.group(1)}.py"))
    example = _example_of(block.code)
    return EXAMPLE_TESTS[example] if example else None


def _modes(block: DocBlock) -> list[str]:
    if block.runner == "bash":
        return ["bash"]
    if _run_elsewhere(block) is not None:
        return []
    first = block.code.splitlines()[0]
    if first.startswith(f"# {JOB}"):
        return ["job"]
    return ["single", "job"] if JOB in first else ["single"]


def _params(block: DocBlock) -> list[Any]:
    if block.runner == "bash" and block.each_command:
        return [pytest.param(block, "bash", command, id=f"{block.where}#{k}-bash")
                for k, command in enumerate(block.commands, 1)]
    return [pytest.param(block, mode, block.code if mode == "bash" else None, id=f"{block.where}-{mode}")
            for mode in _modes(block)]


BLOCKS = all_blocks()
RUNS = [param for block in BLOCKS if block.runner and block.not_run is None for param in _params(block)]


def _expect(block: DocBlock, mode: str, out: str) -> None:
    """What a block must have printed, beyond running without an error."""
    if block.path == "docs/own-model.md":
        ranks = (0, 1) if mode == "job" else (0,)
        for rank in ranks:
            assert re.search(rf"rank {rank} forward: 21 -> [1-4] FSDP collectives", out), out[-2000:]
            assert re.search(rf"rank {rank} backward: 41 -> [2-8] FSDP collectives", out), out[-2000:]
        assert out.count("blocks model.layers.*") == 1  # printed by rank 0 only
        assert "overlapcfg: strategy manual, plan hf_decoder_layers, traced at world size 2" in out
        assert "Prediction: h100_nvlink, world size 64 (traced at 2)" in out  # each figure says its world size
    if block.path in ("README.md", "docs/python.md"):
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


def _prerequisites(block: DocBlock, home: Path) -> None:
    """Files a block reads that the commands before it on its page write: ``node_costs.json`` (``mode=measure``)
    and the ``my_cluster`` profile (``mode=calibrate``). Made here from the demo step and a shipped profile, so the
    block runs on what it would find, without a cluster."""
    if "node_costs.json" not in block.code:
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
    Path("node_costs.json").write_text(NodeCosts(source="docs test", graphs=graphs).to_json())
    assert home.joinpath("hardware", "my_cluster.yaml").is_file(), block.where


def _checkout_view(where: Path) -> Path:
    """A scratch directory whose entries link to the checkout's top level (``.venv`` to this interpreter's
    environment), so a block's relative paths resolve while what it writes stays in the scratch directory."""
    where.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".venv", "outputs", "multirun", "site"):
            (where / entry.name).symlink_to(entry)
    (where / ".venv").symlink_to(Path(sys.prefix))
    return where


def _run_shell(block: DocBlock, code: str, tmp_path: Path) -> None:
    work = _checkout_view(tmp_path / "work")
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "COLUMNS", "PYTEST_XDIST_WORKER")}
    env |= {"PATH": f"{work / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}", "PET_STANDALONE": "1",
            "HF_HUB_OFFLINE": "1", "OVERLAPCFG_HOME": str(tmp_path / "home")}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=work, env=env, capture_output=True,
                          text=True, timeout=SHELL_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"{block.where}:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "Traceback (most recent call last)" not in done.stderr, done.stderr[-6000:]


def _run_python(block: DocBlock, mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    _prerequisites(block, tmp_path / "home")
    if mode == "single":
        names: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(block.code, block.where, "exec"), names)
        out = capsys.readouterr().out
        if block.path == "docs/own-model.md":
            _check_own_model(names)
        return out
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    watched = [str(EXIT_WATCH), str(tmp_path / "exit"), str(script)]  # the block as torchrun runs it
    done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *watched], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "unwaited collective" not in done.stderr
    # A rank finalizing Python while gloo's threads run aborts now and then after its last step (exit -6): certain
    # here, where the abort itself is rare. The FSDP2 page's block ends with overlapcfg.exit_process.
    assert finalized_under_gloo(tmp_path / "exit") == {}, block.where
    return done.stdout


@pytest.mark.docs
@pytest.mark.slow
@pytest.mark.timeout(SHELL_TIMEOUT_S + 60)
@pytest.mark.parametrize("block, mode, shell", RUNS)
def test_every_block_runs_as_written(block: DocBlock, mode: str, shell: str | None, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    if shell is not None:
        _run_shell(block, shell, tmp_path)
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OVERLAPCFG_HOME", str(tmp_path / "home"))
    _expect(block, mode, _run_python(block, mode, tmp_path, capsys))


def test_every_block_is_run_or_says_why_not() -> None:
    """No block escapes: each Python or shell block is run above, or by the test named for it, or says why not; any
    other language is one that is only shown. A ``not run`` with no reason is not a reason."""
    faults = []
    for block in BLOCKS:
        if block.runner is None:
            if block.lang not in SHOWN_LANGS:
                faults.append(f"{block.where}: ```{block.lang} is neither run (python, bash) nor shown "
                              f"({', '.join(sorted(SHOWN_LANGS - {''}))})")
            continue
        if block.not_run is not None:
            if len(block.not_run) < 20:
                faults.append(f"{block.where}: 'not run: {block.not_run}' does not say why")
            continue
        if _modes(block):
            continue
        test_file, test = _run_elsewhere(block) or ("?", "?")
        path = TESTS / test_file
        if not (path.is_file() and f"def {test}(" in path.read_text()):
            faults.append(f"{block.where}: said to be run by {test_file}::{test}, which does not exist")
    assert not faults, "\n".join(faults)


def test_the_walkthroughs_are_run_alone_and_as_jobs() -> None:
    """The runner sees the blocks the pages promise are run: the ten-line example, the own-model walk-through alone
    and under torchrun, the FSDP2 job, the module blocks and the measure example."""
    ran = {(block.path, mode) for block, mode, _ in (p.values for p in RUNS)}
    assert {("README.md", "single"), ("docs/python.md", "single"), ("docs/own-model.md", "single"),
            ("docs/own-model.md", "job"), ("docs/fsdp2.md", "job"), ("README.md", "bash")} <= ran
    main_job = next(b for b in BLOCKS if b.path == "README.md" and "mode=compare" in b.code)
    assert main_job.each_command and len([p for p in RUNS if p.values[0] == main_job]) == len(main_job.commands) == 9
    elsewhere = [_run_elsewhere(b) for b in BLOCKS if b.runner == "python" and b.not_run is None]
    assert sorted(x for x in elsewhere if x) == sorted([*MODULE_BLOCK_TESTS.values(), *EXAMPLE_TESTS.values()])

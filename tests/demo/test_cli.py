"""The ``overlapcfg`` console script, run as users run it: in a process of its own, from a scratch directory.

Each command is forked from one server per test process that has imported torch and the command's modules already
(``tests/support/warm_cli.py`` says why that is still the command as users run it): every run here would otherwise
spend seconds importing the same modules before reading its arguments. The test that torch is not imported at all
starts a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.warm_cli import SCRIPT, shared

FAST = ["model.n_layers=2"]  # where a check reads per-layer structure (layers.0 and layers.1, prefetch lists)
ONE_LAYER = ["model.n_layers=1"]
"""Where nothing checked depends on the model's size (sweeps, compare): tracing costs ~2 s per layer on 2 cores,
over ~3.5 s fixed."""


def run_cli(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``overlapcfg ARGS`` in ``tmp_path``, in a process of its own (forked warm), its output captured."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return shared().run([str(SCRIPT), *args], cwd=tmp_path, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmp = tmp_path_factory.mktemp("cli_run")
    out = run_cli(tmp, *FAST, f"hydra.run.dir={tmp / 'run'}")
    return out, tmp / "run"


@pytest.mark.slow
def test_default_run_prints_progress_and_bucket_table(default_run):
    out, _ = default_run
    assert out.returncode == 0, out.stderr
    assert "traced 2-layer demo model" in out.stdout and "applied strategy 'manual'" in out.stdout
    for text in ("layers.0", "layers.1", "tok_embeddings", "norm+output", "forward order:", "backward order:"):
        assert text in out.stdout, text


@pytest.mark.slow
def test_default_run_writes_the_report_json_into_the_run_dir(default_run):
    out, run_dir = default_run
    assert out.returncode == 0, out.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["strategy"] == "manual" and report["plan_name"] == "llama_layers"
    assert [b["name"] for b in report["buckets"]] == ["tok_embeddings", "layers.0", "layers.1", "norm+output"]
    assert (run_dir / "overlapcfg.log").is_file()


BAD_OVERRIDES = {
    "unknown_group_option": (["overlap/plan=llama_layer"], ["no option 'llama_layer' in group overlap/plan",
                                                             "did you mean 'llama_layers'"]),
    "unknown_hardware": (["hardware=h100"], ["no option 'h100' in group hardware", "(did you mean 'h100_nvlink'"]),
    "appended_unknown_key": (["+modle.n_layers=2"], ["unknown top-level key 'modle'", "did you mean", "'model'"]),
    "bad_value": (["overlap.policy.forward_prefetch=abc"], ["overlap.policy.forward_prefetch",
                                                             "expected an integer"]),
    "unmatched_pattern": (["overlap.plan.buckets=[layer.*]"], ["overlap.plan.buckets[0]", "did you mean 'layers.*'"]),
    "unknown_preset_name": (["overlap.plan=llama_layer"], ["overlap.plan=llama_layer: no option 'llama_layer' in "
                                                          "group overlap/plan", "did you mean 'llama_layers'"]),
}


@pytest.mark.parametrize("kind", list(BAD_OVERRIDES))
@pytest.mark.slow  # spawns a process that imports torch (seconds)
def test_bad_override_exits_1_with_a_message_not_a_traceback(tmp_path, kind):
    overrides, expected = BAD_OVERRIDES[kind]
    out = run_cli(tmp_path, *FAST, *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text
    for piece in expected:
        assert piece in text, (piece, text)
    assert len(text.splitlines()) < 30


@pytest.mark.slow
def test_multirun_writes_one_report_per_job(tmp_path):
    out = run_cli(tmp_path, "-m", "overlap.policy.forward_prefetch=0,2", *ONE_LAYER,
                  f"hydra.sweep.dir={tmp_path / 'sw'}")
    assert out.returncode == 0, out.stderr
    depths = {}
    for job in ("0", "1"):
        report = json.loads((tmp_path / "sw" / job / "report.json").read_text())
        depths[job] = report["config"]["policy"]["forward_prefetch"]
    assert depths == {"0": 0, "1": 2}
    assert "(cached)" in out.stdout  # the second job reuses the first job's trace
    # the sweep ends with one summary table across its jobs (issue 11), after both jobs' reports
    summary = out.stdout[out.stdout.index("sweep: 2 jobs (all with model.n_layers=1)"):]
    assert out.stdout.count("report: ") == 2 and "report: " not in summary
    rows = [line for line in summary.splitlines() if "overlap.policy.forward_prefetch=" in line]
    assert [row.split()[:2] for row in rows] == [["0", "overlap.policy.forward_prefetch=0"],
                                                 ["1", "overlap.policy.forward_prefetch=2"]]


@pytest.mark.slow
def test_a_sweep_with_a_failing_job_still_summarizes_the_jobs_that_finished(tmp_path):
    out = run_cli(tmp_path, "-m", "overlap.policy.forward_prefetch=0,-1,2", *ONE_LAYER,
                  f"hydra.sweep.dir={tmp_path / 'sw'}")
    assert out.returncode == 1  # Hydra reports the failed job
    assert "overlap.policy.forward_prefetch: expected an integer >= 0, got -1" in out.stderr + out.stdout
    summary = out.stdout[out.stdout.index("sweep: 2 jobs (all with model.n_layers=1)"):]
    rows = [line.split()[:2] for line in summary.splitlines() if "overlap.policy.forward_prefetch=" in line]
    assert rows[:2] == [["0", "overlap.policy.forward_prefetch=0"], ["2", "overlap.policy.forward_prefetch=2"]]
    assert "failed: 1 of 3 jobs" in summary
    assert ("job 1 (overlap.policy.forward_prefetch=-1 model.n_layers=1): overlap.policy.forward_prefetch: "
            "expected an integer >= 0, got -1") in " ".join(summary.split())


@pytest.mark.slow  # spawns a process that imports torch (seconds)
def test_a_rerun_into_the_same_directory_leaves_no_output_of_the_earlier_run(tmp_path):
    """Hydra rewrites .hydra/ at the start of a run: an earlier tuned.yaml must not stay beside the new config,
    even when the new run stops early."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "tuned.yaml").write_text("overlap:\n  plan: llama_layers\n")
    (run / "report.json").write_text("{}")
    out = run_cli(tmp_path, "mode=tune", "hardware=h100_nvlink", "tune.world_size=0", f"hydra.run.dir={run}")
    assert out.returncode == 1 and "tune.world_size: expected a number of ranks" in out.stderr
    assert "tune.world_size=0" in (run / ".hydra" / "overrides.yaml").read_text()
    assert not (run / "tuned.yaml").exists() and not (run / "report.json").exists()


@pytest.mark.slow
def test_compare_mode_writes_table_json_and_timeline(tmp_path):
    rows = "+compare={none:{strategy:none},deep:{policy:{forward_prefetch:2}}}"
    out = run_cli(tmp_path, "mode=compare", "~compare", rows, "overlap.policy.backward_prefetch=2", *ONE_LAYER,
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "run" / "compare.json").read_text())
    assert [row["name"] for row in data["rows"]] == ["none", "deep"]
    assert (tmp_path / "run" / "timeline.png").is_file() and (tmp_path / "run" / "timeline.json").is_file()
    # `deep` replaces the policy, so the command-line overlap.policy.* does not reach it: the user is told; the
    # row `none` replaces the strategy, which nobody overrode: no note (issue 11).
    assert "rows deep set their own 'policy', so overlap.policy does not apply to them" in out.stdout
    assert "overlap.strategy does not apply" not in out.stdout


@pytest.mark.slow  # spawns a process that imports torch (seconds)
def test_help_lists_the_config_groups(tmp_path):
    out = run_cli(tmp_path, "--help")
    assert out.returncode == 0, out.stderr
    assert "overlap/plan: hf_decoder_layers, llama_layers, none, per_block_split, single_bucket, torchtitan_layers" \
        in out.stdout
    assert "overlap/policy: aggressive, auto, default, memory_saving" in out.stdout


@pytest.mark.slow  # spawns a process that imports torch (seconds)
def test_cfg_job_shows_the_composed_config(tmp_path):
    out = run_cli(tmp_path, "--cfg", "job", "overlap/policy=auto")
    assert out.returncode == 0, out.stderr
    assert "strategy: auto" in out.stdout and "max_in_flight_gb: 5.0" in out.stdout


@pytest.mark.slow  # spawns a process that imports torch (seconds)
def test_search_path_lists_the_config_tree_once(tmp_path):
    out = run_cli(tmp_path, "--info", "searchpath")
    assert out.returncode == 0, out.stderr
    for tree in ("/conf ", "/presets "):  # the command's own tree, and the `overlap` groups from the plugin
        rows = [line for line in out.stdout.splitlines() if tree in line]  # table cells are space-padded
        assert len(rows) == 1, (tree, out.stdout)


@pytest.mark.slow
def test_sharding_fsdp2_shards_the_demo_eagerly_and_writes_the_report(tmp_path):
    out = run_cli(tmp_path, "sharding=fsdp2", *FAST, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    assert "with FSDP2 for 2 ranks (one process, fake process group)" in out.stdout
    assert "traced 2-layer" not in out.stdout  # no trace: the report is what overlapcfg.fully_shard recorded
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["strategy"] == "manual" and report["plan_name"] == "llama_layers"
    buckets = report["buckets"]
    assert [b["name"] for b in buckets] == ["tok_embeddings", "layers.0", "layers.1", "norm+output"]
    assert [b["modules"] for b in buckets] == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]]
    assert [b["param_count"] for b in buckets] == [1, 9, 9, 2]
    assert buckets[1]["unsharded_bytes"] == 2 * buckets[1]["sharded_bytes"] > 0
    decisions = {(d["direction"], d["kind"]): d for d in buckets[-1]["decisions"]}
    assert decisions[("forward", "all_gather")]["effective"] == 0  # the last bucket has nothing left to prefetch
    assert decisions[("forward", "all_gather")]["reason"] == "end of the model"
    assert "layers.0->[layers.1]" in out.stdout  # the prefetch lists handed to FSDP2


@pytest.mark.slow  # spawns a process (no torch: about a second)
def test_a_sharding_typo_exits_1_before_torch_is_imported(tmp_path):
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('TORCH', 'torch' in sys.modules))\n"
        f"sys.argv = ['overlapcfg', 'sharding=fsdp3', 'hydra.run.dir={tmp_path}']\n"
        "from overlapcfg.demo.cli import main\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 1, out.stderr
    assert "sharding: expected 'simple_fsdp' or 'fsdp2', got 'fsdp3' (did you mean 'fsdp2'" in out.stderr
    assert "Traceback" not in out.stderr and "TORCH False" in out.stdout


@pytest.mark.slow  # spawns a process (no torch: about a second)
def test_compare_mode_refuses_fsdp2_with_the_reason(tmp_path):
    out = run_cli(tmp_path, "mode=compare", "sharding=fsdp2", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "sharding: mode=compare predicts step times by replaying traced graphs" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("override", "expected"), [
    ("parallel.dp_shrd=2", "parallel.dp_shrd: unknown field (did you mean 'dp_shard'"),
    ("overlap.policy.all_reduce_dlay=1",
     "overlap.policy.all_reduce_dlay: unknown field of the policy of strategy 'manual' (did you mean "
     "'all_reduce_delay'"),
    ("model.n_layer=2", "model.n_layer: unknown field (did you mean 'n_layers'"),
])
def test_a_misspelled_key_is_named_with_the_closest_fields_before_hydra(override: str, expected: str) -> None:
    """Hydra would answer ``Key 'dp_shrd' is not in struct`` and suggest ``+parallel.dp_shrd=2``."""
    from overlapcfg.demo.cli import unknown_override_keys

    faults = unknown_override_keys([override, "overlap/plan=llama_layers", "+compare.deep={strategy:none}",
                                    "hydra.run.dir=x"])
    assert len(faults) == 1 and faults[0].startswith(expected) and "valid fields:" in faults[0]
    assert unknown_override_keys(["parallel.dp_shard=2", "overlap.policy.all_reduce_delay=1", "mode=tune"]) == []


@pytest.mark.parametrize("override", ["modle.n_layers=2", "+modle.n_layers=2", "++modle.n_layers=2"])
def test_a_misspelled_top_level_key_is_rejected_appended_or_not(override: str) -> None:
    """The trial: ``modle.n_layers=2`` got Hydra's "use +modle.n_layers=2", and that was accepted silently."""
    from overlapcfg.demo.cli import unknown_override_keys

    (fault,) = unknown_override_keys([override])
    assert fault.startswith("modle.n_layers: unknown top-level key 'modle'") and "'model'" in fault
    assert unknown_override_keys(["+compare.deep={strategy:none}", "+model.n_kv_heads=2", "world_size=4",
                                  "~compare.none", "hydra/job_logging=disabled"]) == []


def test_policy_field_suggestions_are_the_active_strategys() -> None:
    """The trial: a typo under overlap.policy listed the fields of every strategy's policy at once."""
    from overlapcfg.demo.cli import unknown_override_keys

    (typo,) = unknown_override_keys(["overlap.policy.forward_prefetc=2"])
    assert "did you mean 'forward_prefetch'" in typo and "max_in_flight_gb" not in typo
    (other,) = unknown_override_keys(["overlap.policy.max_in_flight_gb=2"])
    assert "not a field of the policy of strategy 'manual'" in other and "(overlap/policy=auto)" in other
    for auto in (["overlap/policy=auto"], ["overlap.policy=auto"], ["overlap.strategy=auto"]):
        (fault,) = unknown_override_keys([*auto, "overlap.policy.forward_prefetch=2"])
        assert "strategy 'auto'" in fault and "max_in_flight_gb" in fault and "issue_order" not in fault
        assert unknown_override_keys([*auto, "overlap.policy.max_in_flight_gb=2"]) == []


@pytest.mark.parametrize(("override", "expected"), [
    ("hardware=h100", "hardware=h100: no option 'h100' in group hardware (did you mean 'h100_nvlink', 'a100_ib'?)"),
    ("tune/space=quik", "tune/space=quik: no option 'quik' in group tune/space (did you mean 'quick'?)"),
    ("overlap/policy=agressive", "no option 'agressive' in group overlap/policy (did you mean 'aggressive'?)"),
    ("overlap.policy=agressive", "overlap.policy=agressive: no option 'agressive' in group overlap/policy"),
    ("hardware=h100_nvlink,a10", "no option 'a10' in group hardware"),
])
def test_a_missing_group_option_names_the_closest_first(tmp_path: Path, override: str, expected: str) -> None:
    """The trial: ``hardware=h100`` listed the options with no closest one; issue 39: the command line put
    ``a100_ib`` first and Python ``h100_nvlink`` (one order now: ``errors.closest_first``). A directory the
    command line adds (``hydra.searchpath``, ``--config-dir``) is searched too."""
    from overlapcfg.demo.cli import unknown_override_keys

    (fault,) = unknown_override_keys([override])
    assert expected in fault
    assert unknown_override_keys(["hardware=h100_nvlink,a100_ib", "hardware=null", "tune/space=quick"]) == []
    group, _, option = override.replace(".", "/", 1).partition("=")
    for name in option.split(","):
        (tmp_path / group).mkdir(parents=True, exist_ok=True)
        (tmp_path / group / f"{name}.yaml").write_text("# an option of the user's\n{}\n")
    assert unknown_override_keys([override, f"hydra.searchpath=[file://{tmp_path}]"]) == []
    assert unknown_override_keys([override], extra=[str(tmp_path)]) == []


def test_python_and_the_command_line_order_suggestions_the_same() -> None:
    from overlapcfg import OverlapConfigError, load_hardware
    from overlapcfg.demo.cli import unknown_override_keys

    (fault,) = unknown_override_keys(["hardware=h100"])
    with pytest.raises(OverlapConfigError) as err:
        load_hardware("h100")
    listed = fault.split("options (closest first): ")[1]
    assert str(err.value).split("available (closest first): ")[1].startswith(listed)


def test_the_command_reads_exactly_its_top_level_keys() -> None:
    """The list the override check holds keys against is the composed config's: neither can drift."""
    from hydra import compose, initialize_config_dir

    from overlapcfg.config.presets import command_conf_dir
    from overlapcfg.demo.command_check import top_level_keys

    with initialize_config_dir(str(command_conf_dir()), version_base="1.3"):
        cfg = compose("overlapcfg")
    assert sorted(map(str, cfg)) == sorted(top_level_keys())


def test_the_spinner_says_tracing_while_it_traces_and_traced_once_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: the spinner said "traced ..." while the demo was still being traced."""
    import contextlib
    import io

    from rich.console import Console

    from overlapcfg.demo import job
    from overlapcfg.demo.settings import demo_settings

    console = Console(file=io.StringIO(), width=200)
    shown: list[str] = []
    during: list[list[str]] = []

    def status(text: str, **_: object) -> contextlib.AbstractContextManager[None]:
        shown.append(text)
        return contextlib.nullcontext()

    monkeypatch.setattr(console, "status", status)
    monkeypatch.setattr(job, "traced", lambda spec: during.append(list(shown)) or "a traced step")
    spec = demo_settings({"model": {"n_layers": 2}})
    assert job._trace_stage(job.Progress(console), spec) == "a traced step"
    assert during == [shown] and shown[0].startswith("tracing 2-layer demo model") and "traced" not in shown[0]
    assert console.file.getvalue().startswith("✓ traced 2-layer demo model")


def test_a_null_policy_is_refused_before_hydra_with_what_to_write() -> None:
    from overlapcfg.demo.cli import unknown_override_keys

    (fault,) = unknown_override_keys(["overlap.policy=null"])
    assert fault.startswith("overlap.policy: null: a policy cannot be unset") and "overlap/policy=default" in fault


def test_an_option_missing_from_a_directory_the_command_line_adds_is_still_named(tmp_path: Path) -> None:
    """Before, any ``hydra.searchpath`` or ``--config-dir`` turned the check of group options off ("options we
    cannot see"), so a typo there went to Hydra's bare option list. The directory is searched now."""
    from overlapcfg.demo.cli import unknown_override_keys

    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "mine.yaml").write_text("# a profile of the user's\n{}\n")
    (fault,) = unknown_override_keys(["hardware=mien", f"hydra.searchpath=[file://{tmp_path}]"])
    assert "no option 'mien' in group hardware (did you mean 'mine'?)" in fault

"""What a new user trips over (issue 11): presets and policies by name, state that must not leak."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from overlapcfg import OverlapConfigError, OverlapPolicy, load_config
from tests.support.warm_cli import shared


def test_a_policy_can_be_picked_by_name_like_a_plan() -> None:
    cfg = load_config({"plan": "llama_layers", "policy": "aggressive"})
    assert cfg.policy == OverlapPolicy(forward_prefetch=2, backward_prefetch=2, reduce_scatter_delay=2)
    assert load_config({"strategy": "auto", "policy": "auto"}).policy.max_in_flight_gb == 5.0


def test_an_unknown_policy_name_lists_the_presets_closest_first() -> None:
    with pytest.raises(OverlapConfigError) as info:
        load_config({"plan": "llama_layers", "policy": "agressive"})
    (fault,) = info.value.faults
    assert fault.path == "overlap.policy"
    assert "unknown policy preset 'agressive'" in fault.message and "did you mean 'aggressive'" in fault.message


def test_a_policy_preset_of_another_strategy_selects_it_unless_another_was_chosen() -> None:
    """The trial: ``overlap.policy=auto`` by name failed where ``overlap/policy=auto`` worked. ``manual`` is the
    default (Hydra always writes it), so only another chosen strategy contradicts the policy."""
    assert load_config({"plan": "llama_layers", "policy": "auto"}).strategy == "auto"
    assert load_config({"strategy": "manual", "policy": "auto"}).strategy == "auto"
    assert load_config({"policy": {"strategy": "auto", "max_in_flight_gb": 2}}).policy.max_in_flight_gb == 2
    with pytest.raises(OverlapConfigError) as info:
        load_config({"strategy": "torch_manual", "plan": "llama_layers", "policy": "auto"})
    (fault,) = info.value.faults
    assert fault.path == "overlap.policy"
    assert "policy preset 'auto' is for strategy 'auto', but the strategy is 'torch_manual'" in fault.message


@pytest.mark.slow  # a subprocess importing torch
def test_tracing_leaves_no_rank_prefix_on_later_uncaught_exceptions() -> None:
    """init_process_group installs a '[rank0]:' excepthook; our fake group must put the old one back."""
    code = ("import sys, overlapcfg.compat as c\nhook = sys.excepthook\n"
            "with c.fake_process_group(2):\n    pass\nprint(sys.excepthook is hook)")
    # a process of its own, forked warm (tests/support/warm_cli.py): the server never opened a group either
    out = shared().run([sys.executable, "-c", code], cwd=Path.cwd())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True"


@pytest.mark.slow
def test_the_auto_report_does_not_contradict_itself(traced_2l_reshard) -> None:
    """Issue: 39 -> 1 collectives, yet all 39 listed as uncovered; 0 B of unsharded parameters while 770 KiB
    were in flight; a warning about a plan the user never set."""
    from overlapcfg import explain

    report = explain(traced_2l_reshard, {"strategy": "auto", "policy": {"collective_bucketing": True}},
                     hardware="h100_nvlink")
    assert all(not g.uncovered for g in report.graphs)
    assert not any("plan is ignored" in w for w in report.warnings)  # a note at most, not a warning
    sim = report.simulation
    assert sim is not None and sim.peak_inflight_bytes > 0
    assert sim.peak_unsharded_param_bytes >= sim.peak_inflight_bytes


def test_plan_faults_found_by_the_pass_name_the_mount_point() -> None:
    """Issue: with the group at trainer.overlap, an unmatched pattern was reported as overlap.plan.buckets[0]."""
    from omegaconf import OmegaConf

    from overlapcfg import from_hydra
    from overlapcfg.compat import fake_process_group
    from overlapcfg.passes import apply
    from tests.support.synthetic import forward_graph

    node = OmegaConf.create({"trainer": {"overlap": {"plan": {"buckets": ["layer.*"]}}}}).trainer.overlap
    built = forward_graph([[2], [2]])
    with fake_process_group(2), pytest.raises(OverlapConfigError) as info:
        apply(built.gm, from_hydra(node), module_fqns=built.module_fqns, graph_kind="forward")
    assert info.value.faults[0].path == "trainer.overlap.plan.buckets[0]"


def test_overriding_a_presets_buckets_drops_its_name() -> None:
    """Issue: overlap.plan.buckets=[...] kept name: llama_layers, so reports titled another plan with it."""
    cfg = load_config({"plan": {"name": "llama_layers", "buckets": ["layers.*"]}})
    assert cfg.plan is not None and cfg.plan.name == "llama_layers (modified)"
    assert load_config({"plan": "llama_layers"}).plan.name == "llama_layers"  # type: ignore[union-attr]


def test_from_hydra_on_the_whole_config_points_at_the_overlap_node() -> None:
    from omegaconf import OmegaConf

    from overlapcfg import from_hydra

    root = OmegaConf.create({"model": {"n_layers": 2}, "steps": 3,
                             "trainer": {"overlap": {"strategy": "manual", "plan": "llama_layers"}}})
    with pytest.raises(OverlapConfigError, match=r"from_hydra\(cfg\.trainer\.overlap\)") as info:
        from_hydra(root)
    assert len(info.value.faults) == 1  # not one "unknown field" per key of the root config


def test_a_users_own_preset_chosen_by_name_is_the_group_option(tmp_path) -> None:
    """Issue 30: overlap/plan=mine worked, overlap.plan=mine said "unknown plan preset 'mine'". Issue 38: by name
    it is chosen as the group option before composing (``hydra_overrides``), not looked up afterwards on whatever
    Hydra instance the process holds: the node alone says what it is."""
    from hydra import compose, initialize_config_dir

    from overlapcfg import from_hydra, hydra_overrides

    (tmp_path / "overlap" / "plan").mkdir(parents=True)
    (tmp_path / "overlap" / "plan" / "mine.yaml").write_text("name: mine\nbuckets: [tok_embeddings]\n")
    (tmp_path / "app.yaml").write_text("defaults:\n  - overlap@trainer.overlap: default\n  - _self_\n")
    mounts = ["trainer.overlap"]
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        by_group = compose("app", overrides=["overlap/plan@trainer.overlap.plan=mine"])
        by_name = compose("app", overrides=hydra_overrides(["trainer.overlap.plan=mine"], mounts=mounts))
        assert from_hydra(by_name.trainer.overlap) == from_hydra(by_group.trainer.overlap)
        with pytest.raises(OverlapConfigError, match=r"no option 'mien' in group overlap/plan .*did you mean 'mine'"):
            hydra_overrides(["trainer.overlap.plan=mien"], mounts=mounts)
        bare = compose("app", overrides=["trainer.overlap.plan=mine"])  # Hydra alone: the node holds a name
    with pytest.raises(OverlapConfigError, match=r"choose it as overlap/plan@trainer\.overlap\.plan=mine"):
        from_hydra(bare.trainer.overlap)


@pytest.mark.slow
def test_a_huge_depth_and_an_empty_plan_are_warned_about_not_silently_accepted(traced_2l_reshard) -> None:
    """Issue: forward_prefetch=1000000000 was silently clamped; an empty plan exited 0 with everything uncovered."""
    from overlapcfg import explain

    huge = explain(traced_2l_reshard, {"plan": "llama_layers", "policy": {"forward_prefetch": 10**9}})
    assert any("prefetch depth 1000000000 is more than the 4 buckets" in w for w in huge.warnings)
    empty = explain(traced_2l_reshard, {"plan": "none"})
    assert any("the plan has no buckets" in w and "require_full_coverage" in w for w in empty.warnings)
    long = next(w for w in empty.warnings if "the plan has no buckets" in w)
    assert "owners, all in report.json" in long and len(long) < 400


def test_a_config_typo_on_the_command_line_is_reported_before_torch_is_imported(tmp_path) -> None:
    """Issue: a typo took 5-8 s to report because torch was imported before validation."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('TORCH', 'torch' in sys.modules))\n"
        f"sys.argv = ['overlapcfg', 'overlap.policy.forward_prefetch=abc', 'hydra.run.dir={tmp_path}']\n"
        "from overlapcfg.demo.cli import main\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 1
    assert "overlap.policy.forward_prefetch: expected an integer >= 0, got 'abc'" in out.stderr
    assert "TORCH False" in out.stdout


@pytest.mark.slow
def test_the_checkpoint_notice_is_silenced_for_our_trace_only(capfd: pytest.CaptureFixture[str]) -> None:
    """Issue: torch's 4-line 'context_fn is passed to torch.utils.checkpoint' warning was printed in user apps."""
    import logging

    from overlapcfg.demo import LlamaConfig
    from overlapcfg.demo.tracing import trace_train_step

    logger = logging.getLogger("torch._higher_order_ops.wrap")
    level = logger.level
    trace_train_step(LlamaConfig(n_layers=1), reshard_after_forward=True)
    assert "context_fn" not in capfd.readouterr().err
    assert logger.level == level


def test_faults_sharing_a_message_are_one_line_with_a_count_and_the_first_paths() -> None:
    """Issue: world_size=3 printed 39 near-identical faults, one per parameter."""
    from overlapcfg.errors import Fault

    faults = [Fault(f"layers.{i}.w", "dim 0 has size 64") for i in range(30)] + [Fault("a", "x"), Fault("b", "x")]
    err = OverlapConfigError(faults, header="cannot shard module")
    assert str(err).splitlines() == ["cannot shard module (32 faults):",
                                     "  layers.0.w, layers.1.w, layers.2.w and 27 more: dim 0 has size 64",
                                     "  a, b: x"]
    assert err.faults == tuple(faults)  # every fault stays inspectable


def test_an_indivisible_world_size_is_reported_on_a_few_lines() -> None:
    from overlapcfg.capture.simple_fsdp import shard_module
    from overlapcfg.demo.llama import Llama, LlamaConfig

    with pytest.raises(OverlapConfigError) as info:
        shard_module(Llama(LlamaConfig(n_layers=4), device="meta"), world_size=3, rank=0)
    lines = str(info.value).splitlines()
    assert len(info.value.faults) == 39 and len(lines) == 4, lines
    assert lines[2].startswith("  layers.0.attention_norm.weight, layers.0.attention.wq.weight, "
                               "layers.0.attention.wk.weight and 26 more: dim 0 has size 64")


def _layer_bucket(name: str, entry: int = 1, *, bw_placed: int = 1, fw: int = 1, reason: str | None = None):
    """A report bucket as the pass records it: 9 parameters, fw AG / bw AG / bw RS merged 9 -> 1."""
    from overlapcfg.graph.record import BucketRecord, CollectiveChange, DepthDecision

    kinds = (("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter"))
    return BucketRecord(
        name=name, modules=(name,), entry_index=entry, entry_text="layers.*" if entry == 1 else name,
        forward_prefetch=fw, backward_prefetch=1, reduce_scatter_delay=1, param_count=9, numel=41088,
        unsharded_bytes=164352, sharded_bytes=82176,
        collectives=tuple(CollectiveChange(direction=d, kind=k, before=9, after=1, unsharded_bytes=164352)
                          for d, k in kinds),
        decisions=(DepthDecision(bucket=name, direction="forward", kind="all_gather", position=0, requested=fw,
                                 effective=fw, inflight_bytes=0),
                   DepthDecision(bucket=name, direction="backward", kind="all_gather", position=0, requested=1,
                                 effective=bw_placed, inflight_bytes=0, reason=reason)))


def _render(renderable, width: int = 100) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_identical_layer_rows_collapse_into_a_range_and_the_table_fits_100_columns() -> None:
    """Issue: 32 per-layer rows, each wrapping over five lines at 100 columns."""
    from overlapcfg.report.bucket_table import bucket_rows, bucket_table

    buckets = [_layer_bucket("tok_embeddings", 0),
               _layer_bucket("layers.0", bw_placed=0, reason="end of graph"),
               *(_layer_bucket(f"layers.{i}", fw=2 if i == 5 else 1) for i in range(1, 32)),
               _layer_bucket("norm+output", 2)]
    rows = bucket_rows(buckets)
    assert [(r.label, len(r.buckets)) for r in rows] == [
        ("tok_embeddings", 1), ("layers.0", 1), ("layers.1–4, 6–31", 30), ("layers.5", 1), ("norm+output", 1)]
    text = _render(bucket_table("t", buckets, world_size=2))
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "(30 buckets, identical)" in text and "…" not in text  # nothing cut
    assert "bw AG: end of graph" in text  # the why column names end-of-graph clamps too
    assert "9→1 d1→0" in text and "9→1 d2" in text
    assert "plan entries: [0] tok_embeddings · [1] layers.* · [2] norm+output" in text


def test_the_report_explains_its_abbreviations_and_elides_long_orders() -> None:
    from overlapcfg.report.labels import LEGEND, fmt_order

    legend = "\n".join(LEGEND)
    for term in ("AG all-gather", "RS reduce-scatter", "AR all-reduce", "W[b]", "C×8", "9→1", "d2→1"):
        assert term in legend, term
    assert all(len(line) <= 100 for line in LEGEND)
    order = " ".join(f"AG[layers.{i}] W[layers.{i}] C×8" for i in range(64))
    short = fmt_order(order)
    assert short.startswith("AG[layers.0] W[layers.0] C×8") and short.endswith("AG[layers.63] W[layers.63] C×8")
    assert "(140 more, all in report.json)" in short
    assert fmt_order("AG[a] W[a] C×1") == "AG[a] W[a] C×1"


def test_compare_notes_shadowed_keys_only_for_what_the_user_overrode() -> None:
    """Issue: mode=compare printed notes about rows replacing `policy` although the user set nothing."""
    from omegaconf import OmegaConf

    from overlapcfg.demo.job import shadowed_keys

    cfg = OmegaConf.create({"overlap": {"strategy": "manual", "plan": "llama_layers", "policy": {}},
                            "compare": {"none": {"strategy": "none"}, "d2": {"policy": {"forward_prefetch": 2}}}})
    assert shadowed_keys(cfg) == {}
    assert shadowed_keys(cfg, ["model.n_layers=2", "hardware=h100_nvlink"]) == {}
    assert shadowed_keys(cfg, ["overlap.policy.forward_prefetch=3"]) == {"policy": ["d2"]}
    assert shadowed_keys(cfg, ["overlap/policy=aggressive", "+overlap.strategy=auto"]) == {
        "strategy": ["none"], "policy": ["d2"]}


def test_a_sweep_summary_has_one_row_per_job_and_names_what_varied() -> None:
    from overlapcfg.cost.prediction import Simulation
    from overlapcfg.report import Report
    from overlapcfg.report.sweep import split_overrides, sweep_table

    def report(step: float) -> Report:
        sim = Simulation(hardware="cpu_gloo", world_size=2, step_seconds=step, compute_seconds=1e-3,
                         comm_seconds=1e-3, exposed_comm_seconds=step - 1e-3, overlap_ratio=0.5,
                         lower_bound_seconds=1e-3, peak_inflight_bytes=2**20, peak_unsharded_param_bytes=2**21,
                         peak_activation_bytes=None)
        return Report(strategy="manual", plan_name="llama_layers", config={}, world_size=2, buckets=(), graphs=(),
                      simulation=sim)

    jobs = [(["model.n_layers=2", f"overlap.policy.forward_prefetch={d}"], report(s))
            for d, s in ((0, 3e-3), (2, 2e-3))]
    assert split_overrides([o for o, _ in jobs]) == (["model.n_layers=2"], [["overlap.policy.forward_prefetch=0"],
                                                                             ["overlap.policy.forward_prefetch=2"]])
    text = _render(sweep_table(jobs))
    assert "sweep: 2 jobs (all with model.n_layers=2)" in text
    lines = [line for line in text.splitlines() if "forward_prefetch=" in line]
    assert "3.00 ms" in lines[0] and "2.00 ms" in lines[1]


def test_timeline_bars_are_labelled_with_what_fits() -> None:
    from overlapcfg.report.timeline import bar_label

    assert bar_label("layers.12", 200) == "layers.12"
    assert bar_label("layers.12", 20) == "12"  # the layer index where the name does not fit
    assert bar_label("norm+output", 30) == "nor"
    assert bar_label("layers.12", 5) is None

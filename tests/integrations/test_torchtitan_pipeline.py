"""torchtitan's graph trainer with ``compile.pass_pipeline=overlapcfg`` (``overlapcfg.integrations.torchtitan``).

Fast: where the config comes from (``OVERLAPCFG_CONFIG``: unset, a policy preset, a file; every fault an
``OverlapConfigError`` naming the variable or the file), registration in torchtitan's registries, the checks the
trainer's post-init hook runs, the entry point's arguments, and that ``import overlapcfg`` never imports torchtitan.

Slow: the registered pipeline on torchtitan whole-step graphs captured without overlapcfg
(``tests/thirdparty/graph_trainer.py``, shared per session through the ``whole_step`` fixture): collective counts,
bucket contents and depths measured by the independent checker (``tests/support/checker.py``) against the original
graph's own annotations; and the docs' command line as far as it goes without a GPU: torchtitan's
``ConfigManager`` parses it, and a ``GraphTrainer`` runs one step through the registered pipeline.
"""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from overlapcfg import OverlapConfigError
from overlapcfg.errors import UnsupportedGraphError
from tests.support.torchtitan_pipeline import check_joint, run_registered
from tests.thirdparty import conformance as C

TORCHTITAN_PLAN = ["tok_embeddings", "layers.0", "layers.1", ["norm", "lm_head"]]
"""What the graph trainer's ``compile_time_passes`` gives its bucketing pass for a 2-layer dense model."""


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> Callable[[str | None], None]:
    def set_value(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("OVERLAPCFG_CONFIG", raising=False)
        else:
            monkeypatch.setenv("OVERLAPCFG_CONFIG", value)

    return set_value


# --- where the config comes from --------------------------------------------------------------------------------

def test_unset_config_is_torchtitans_own_buckets_at_depth_one(environ: Callable[[str | None], None]) -> None:
    from overlapcfg.integrations.torchtitan.source import find_config

    environ(None)
    cfg = find_config(TORCHTITAN_PLAN)
    assert cfg.strategy == "manual" and cfg.plan is not None
    assert cfg.plan.name == "torchtitan" and cfg.plan.require_full_coverage
    assert list(cfg.plan.buckets) == ["tok_embeddings", "layers.0", "layers.1", ("norm", "lm_head")]
    assert (cfg.policy.forward_prefetch, cfg.policy.backward_prefetch, cfg.policy.reduce_scatter_delay) == (1, 1, 1)


def test_a_policy_preset_name_keeps_torchtitans_buckets(environ: Callable[[str | None], None]) -> None:
    from overlapcfg.integrations.torchtitan.source import find_config

    environ(" aggressive ")
    cfg = find_config(TORCHTITAN_PLAN)
    assert cfg.plan is not None and cfg.plan.name == "torchtitan"
    assert (cfg.policy.forward_prefetch, cfg.policy.backward_prefetch) == (2, 2)
    environ("auto")  # the automatic scheduler takes no plan: the preset switches the strategy, as it says
    assert find_config(TORCHTITAN_PLAN).strategy == "auto"


def test_a_misspelled_preset_names_the_variable_the_closest_preset_and_the_missing_file(
        environ: Callable[[str | None], None]) -> None:
    from overlapcfg.integrations.torchtitan.source import find_config

    environ("agressive")
    with pytest.raises(OverlapConfigError) as err:
        find_config(TORCHTITAN_PLAN)
    text = str(err.value)
    assert "OVERLAPCFG_CONFIG: 'agressive' is neither a policy preset (did you mean 'aggressive'?)" in text
    assert "nor an existing file" in text and "policy presets: aggressive" in text


def test_a_missing_file_is_a_config_error(environ: Callable[[str | None], None], tmp_path: Path) -> None:
    from overlapcfg.integrations.torchtitan.source import find_config

    environ(str(tmp_path / "overlap.yaml"))
    with pytest.raises(OverlapConfigError, match=r"OVERLAPCFG_CONFIG: .*overlap\.yaml' is neither .* nor an existing "
                                                 r"file"):
        find_config(TORCHTITAN_PLAN)


def test_a_file_is_a_whole_config_and_its_faults_name_the_file(environ: Callable[[str | None], None],
                                                                tmp_path: Path) -> None:
    from overlapcfg.integrations.torchtitan.source import find_config

    good = tmp_path / "overlap.yaml"
    good.write_text("overlap:\n  plan: torchtitan_layers\n  policy: {forward_prefetch: 3}\n")
    environ(str(good))
    cfg = find_config(TORCHTITAN_PLAN)
    assert cfg.plan is not None and cfg.plan.name == "torchtitan_layers" and cfg.policy.forward_prefetch == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("plan: torchtitan_layers\npolicy: {foward_prefetch: 2}\n")
    environ(str(bad))
    with pytest.raises(OverlapConfigError) as err:
        find_config(TORCHTITAN_PLAN)
    text = str(err.value)
    assert f"invalid overlap config in {str(bad)!r} (OVERLAPCFG_CONFIG)" in text
    assert "overlap.policy.foward_prefetch: unknown field (did you mean 'forward_prefetch'?)" in text


def test_a_file_selects_registered_names_only(environ: Callable[[str | None], None], tmp_path: Path) -> None:
    from overlapcfg.integrations.torchtitan.source import find_config

    path = tmp_path / "evil.yaml"
    path.write_text("plan: torchtitan_layers\npolicy: {_target_: os.system}\n")
    environ(str(path))
    with pytest.raises(OverlapConfigError, match="_target_"):
        find_config(TORCHTITAN_PLAN)


# --- registration, pre-trace checks, the entry point ------------------------------------------------------------

def test_importing_the_integration_registers_the_pipeline_and_its_post_init_hook() -> None:
    from torchtitan.experiments.graph_trainer import registry

    import overlapcfg.integrations.torchtitan as integration

    assert registry.PASS_PIPELINE_REGISTRY["overlapcfg"] is integration.overlapcfg_pipeline
    assert registry.POST_INIT_HOOKS["overlapcfg"] is integration.check_trainer
    integration.register()  # again: harmless


def test_a_foreign_pipeline_of_the_same_name_is_not_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.experiments.graph_trainer import registry

    import overlapcfg.integrations.torchtitan as integration

    def someone_elses(traced: Any, config: Any, *, parallel_dims: Any = None) -> list[Any]:
        return []

    monkeypatch.setitem(registry.PASS_PIPELINE_REGISTRY, "overlapcfg", someone_elses)
    with pytest.raises(RuntimeError, match=r"already registered by .*someone_elses"):
        integration.register()
    assert registry.PASS_PIPELINE_REGISTRY["overlapcfg"] is someone_elses


def _trainer(**compile_fields: Any) -> Any:
    fields = {"mode": "aot_fx_trace", "enable_passes": True, "precompile_artifact_dir": "",
              "enable_fsdp_dense_region_overlap": False, **compile_fields}
    return types.SimpleNamespace(config=types.SimpleNamespace(compile=types.SimpleNamespace(**fields)),
                                 parallel_dims=types.SimpleNamespace(pp_enabled=False))


def test_settings_where_the_pipeline_would_not_run_fail_before_tracing(environ: Callable[[str | None], None]) -> None:
    from overlapcfg.integrations.torchtitan import check_trainer

    environ(None)
    check_trainer(_trainer())
    with pytest.raises(OverlapConfigError) as err:
        check_trainer(_trainer(mode="jit", enable_passes=False, enable_fsdp_dense_region_overlap=True))
    text = str(err.value)
    assert "compile.pass_pipeline=overlapcfg cannot run here (3 faults)" in text
    assert "compile.mode: the overlapcfg pipeline runs on the whole-step graph" in text
    assert "compile.enable_passes:" in text and "compile.enable_fsdp_dense_region_overlap:" in text


def test_a_torch_the_graph_trainer_cannot_trace_with_fails_before_tracing(
        environ: Callable[[str | None], None], monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.12: torchtitan 0.3.0's models import, and its graph trainer fails minutes later, mid-trace, on
    ``torch.compiler._patch_engine_backward``. The post-init hook says so first, with what runs instead."""
    from overlapcfg import compat
    from overlapcfg.integrations.torchtitan import check_trainer

    environ(None)
    assert compat.graph_trainer_missing_apis() == ()  # the full suite's torch (2.13) has them
    monkeypatch.setattr(compat, "graph_trainer_missing_apis", lambda: ("torch.compiler._patch_engine_backward",))
    with pytest.raises(OverlapConfigError) as err:
        check_trainer(_trainer())
    text = str(err.value)
    assert "compile.mode: torchtitan's graph trainer traces the step with torch.compiler._patch_engine_backward" \
        in text
    assert f"torch {torch.__version__} does not have" in text and "overlapcfg.integrations.torchtitan.fsdp2" in text


def test_the_post_init_hook_loads_the_config_before_tracing(environ: Callable[[str | None], None]) -> None:
    from overlapcfg.integrations.torchtitan import check_trainer

    environ("no_such_policy")
    with pytest.raises(OverlapConfigError, match="OVERLAPCFG_CONFIG: 'no_such_policy'"):
        check_trainer(_trainer())


def test_a_config_files_plan_is_resolved_against_the_model_before_tracing(
        environ: Callable[[str | None], None], tmp_path: Path) -> None:
    from overlapcfg.integrations.torchtitan import check_trainer

    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(8, 4)
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    model.lm_head = torch.nn.Linear(4, 8)
    trainer = _trainer()
    trainer.model_parts = [model]
    path = tmp_path / "overlap.yaml"
    path.write_text("plan: {buckets: [tok_embeddings, layers.*, lm_head], require_full_coverage: true}\n")
    environ(str(path))
    check_trainer(trainer)
    path.write_text("plan: {buckets: [tok_embeddings, layer.*], require_full_coverage: true}\n")
    with pytest.raises(OverlapConfigError) as err:
        check_trainer(trainer)
    text = str(err.value)
    assert "overlap.plan.buckets[1]: pattern 'layer.*' matches no module" in text and "'layers.*'" in text
    environ("aggressive")  # torchtitan's own plan is built at trace time, for the model being traced
    check_trainer(trainer)


@pytest.mark.slow
def test_the_entry_point_selects_the_pipeline_unless_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.thirdparty import graph_trainer as G

    with G.graph_trainer_stubs():
        import torchtitan.train

    from overlapcfg.integrations.torchtitan import __main__ as entry

    assert entry.with_pipeline(["--module", "m"]) == ["--module", "m", "--compile.pass_pipeline", "overlapcfg"]
    assert entry.with_pipeline(["--compile.pass-pipeline=default"]) == ["--compile.pass-pipeline=default"]
    seen: list[list[str]] = []
    monkeypatch.setattr(torchtitan.train, "main", lambda: seen.append(list(sys.argv[1:])))
    monkeypatch.setattr(sys, "argv", ["prog"])
    entry.main(["--module", "graph_trainer.llama3", "--config", "graph_trainer_llama3_debugmodel"])
    assert seen == [["--module", "graph_trainer.llama3", "--config", "graph_trainer_llama3_debugmodel",
                     "--compile.pass_pipeline", "overlapcfg"]]


def test_importing_overlapcfg_never_imports_torchtitan() -> None:
    code = ("import sys, overlapcfg, overlapcfg.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchtitan'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_pass_list_without_torchtitans_bucketing_pass_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.thirdparty import graph_trainer as G

    with G.graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer import passes as tt_passes

    from overlapcfg.integrations.torchtitan import overlapcfg_pipeline

    def precompiled(traced: Any, config: Any, *, parallel_dims: Any = None) -> list[Any]:
        return [tt_passes.cudagraph_pass] if hasattr(tt_passes, "cudagraph_pass") else []

    monkeypatch.setattr(tt_passes, "construct_default_graph_passes", precompiled)
    with pytest.raises(UnsupportedGraphError, match="replaces exactly one"):
        overlapcfg_pipeline(None, None)


# --- whole-step graphs through the registered pipeline ------------------------------------------------------------

WHOLE_STEPS = [(model, reshard, optimizer) for model in ("llama3", "qwen3_tied") for reshard in ("always", "never")
               for optimizer in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "reshard", "optimizer"), WHOLE_STEPS)
@pytest.mark.parametrize(("setting", "depth"), [(None, 1), ("aggressive", 2)])
def test_registered_pipeline_buckets_every_fsdp_collective_at_the_depths_asked(
        whole_step: Callable[..., Any], environ: Callable[[str | None], None], model: str, reshard: str,
        optimizer: bool, setting: str | None, depth: int) -> None:
    step = whole_step(model, reshard, optimizer)
    environ(setting)
    gm = run_registered(step)
    check_joint(gm, step.gm, depth)
    record = gm.meta["overlapcfg"]
    assert [b.name for b in record.buckets] == ["tok_embeddings", "layers.0", "layers.1", "lm_head+norm"]
    assert not record.uncovered
    params = [p for b in record.buckets for p in b.params]  # named from the tracer's state list, not arg<N>_1
    assert params and set(params) <= set(step.traced.state_fqns), params


def _assert_head_partials_bucketed(record: Any) -> None:
    """torchtitan's chunked loss (8 chunks): ``lm_head``'s 8 per-chunk reduce-scatters are counted as FSDP's and
    merged with ``norm``'s into the head bucket's one reduce-scatter, and the record says what that holds."""
    assert record.before.other == record.after.other == 0 and record.uncovered == ()
    assert record.before.get("backward", "reduce_scatter") == 24  # 16 + 8: before, 16 and 8 "other"
    assert record.after.get("backward", "reduce_scatter") == 4
    head = [b for b in record.buckets if "lm_head" in b.modules]
    assert [b.name for b in head] == ["lm_head+loss+norm"]  # torchtitan: [norm, lm_head, loss] for a chunked loss
    change = head[0].changes("backward", "reduce_scatter")
    assert change is not None and (change.before, change.after) == (9, 1)  # before: 1 -> 1 (norm's alone)
    assert any(n.startswith("bucket 'lm_head+loss+norm': 8 reduce-scatters are partial gradients of one parameter "
                            "of 'lm_head'") for n in record.notes), record.notes


@pytest.mark.slow
@pytest.mark.parametrize("reshard", ["always", "never"])
def test_the_chunked_losss_per_chunk_head_reduce_scatters_are_counted_and_bucketed(
        whole_step: Callable[..., Any], environ: Callable[[str | None], None], reshard: str) -> None:
    """The graph trainer's Llama3 configs (``graph_trainer_llama3_debugmodel``, ``graph_trainer_llama3_8b``) train
    with a chunked loss: traced, ``lm_head``'s weight gradient is reduce-scattered once per chunk. Those 8 were
    filed as "other" with no note, even under ``require_full_coverage`` (torchtitan's plan requires it), and the
    head's bucket said ``bw RS 1 -> 1``. Recognized by dataflow (partials summed in place into one returned
    gradient) and checked by the independent checker against torchtitan's own annotations."""
    step = whole_step("llama3", reshard, False, "chunked")
    partials = [c for c in C.collectives(step.gm) if c.kind == "reduce_scatter" and C.custom_module(c.start)
                == "lm_head"]
    assert len(partials) == 8
    environ(None)
    gm = run_registered(step)
    check_joint(gm, step.gm, 1)
    _assert_head_partials_bucketed(gm.meta["overlapcfg"])


@pytest.mark.slow
def test_a_graph_trainer_step_with_its_default_chunked_loss_runs_through_the_pipeline(
        environ: Callable[[str | None], None]) -> None:
    """A ``GraphTrainer`` set up as the debug config sets it up (``ChunkedLossWrapper``, turned into
    ``ChunkedLossWrapperWithParamGrads`` by ``to_graph_trainer_config``; ``lm_head`` set on the loss and skipped
    by the model) traces its step, runs the registered pipeline and executes the step."""
    from tests.thirdparty import graph_trainer as G
    from tests.thirdparty import models as M

    with G.graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer import registry
        from torchtitan.experiments.graph_trainer.tests._trainer_test_utils import build_minimal_trainer
        from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

        import overlapcfg.integrations.torchtitan  # noqa: F401

    environ(None)
    with M.fake_process_group(2):
        model = G.build_model("llama3")
        trainer = build_minimal_trainer(model, model.config, GraphTrainer, fsdp_reshard_after_forward="always",
                                        compile_disable_passes=["cudagraph_pass"])
        trainer.config.compile.pass_pipeline = "overlapcfg"
        trainer.config.loss = G.loss_config("chunked")
        trainer.loss_fn = G._loss_fn(model, "chunked")
        trainer.device = torch.device("cpu")
        registry.POST_INIT_HOOKS["overlapcfg"](trainer)
        tokens, labels, valid = G.batch()
        with G._cpu_sdpa_saved():
            loss = trainer.forward_backward_step(input_dict={"input": tokens}, labels=labels,
                                                 global_valid_tokens=valid)
    assert torch.isfinite(loss)
    _assert_head_partials_bucketed(trainer._traced_step.gm.meta["overlapcfg"])


@pytest.mark.slow
def test_the_docs_command_line_runs_a_graph_trainer_step_through_the_pipeline(
        environ: Callable[[str | None], None]) -> None:
    """The docs' ``torchrun ... -m overlapcfg.integrations.torchtitan ARGS`` without a GPU: ``ARGS`` as the page writes
    them (plus ``--compile.disable_passes cudagraph_pass``: CPU), completed by the entry point and parsed by
    torchtitan's ``ConfigManager``, select the pipeline; a ``GraphTrainer`` with that compile config (the
    fixture's 2-layer Llama3 in place of the 8B model, a policy preset in place of the page's 32-layer file) traces,
    runs the registered pipeline and executes the step."""
    from overlapcfg.integrations.torchtitan.__main__ import with_pipeline
    from tests.support.doc_blocks import torchtitan_command_args
    from tests.thirdparty import graph_trainer as G
    from tests.thirdparty import models as M

    args = with_pipeline([*torchtitan_command_args(), "--compile.disable_passes", "cudagraph_pass"])
    with G.graph_trainer_stubs():
        from torchtitan.config import ConfigManager
        from torchtitan.experiments.graph_trainer import registry
        from torchtitan.experiments.graph_trainer.tests._trainer_test_utils import build_minimal_trainer
        from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

        import overlapcfg.integrations.torchtitan as integration

        config = ConfigManager().parse_args(args)
    assert config.compile.pass_pipeline == "overlapcfg" and config.compile.mode == "aot_fx_trace"
    environ("aggressive")
    assert registry.PASS_PIPELINE_REGISTRY[config.compile.pass_pipeline] is integration.overlapcfg_pipeline
    with M.fake_process_group(2):
        model = G.build_model("llama3")
        trainer = build_minimal_trainer(model, model.config, GraphTrainer, fsdp_reshard_after_forward="always")
        trainer.config.compile = config.compile
        trainer.device = torch.device("cpu")
        registry.POST_INIT_HOOKS[config.compile.pass_pipeline](trainer)
        tokens, labels, valid = G.batch()
        with G._cpu_sdpa_saved():
            loss = trainer.forward_backward_step(input_dict={"input": tokens}, labels=labels,
                                                 global_valid_tokens=valid)
    assert torch.isfinite(loss)
    record = trainer._traced_step.gm.meta["overlapcfg"]
    assert record.after.fsdp == (("backward", "all_gather", 3), ("backward", "reduce_scatter", 4),
                                 ("forward", "all_gather", 4))
    assert {d.requested for d in record.decisions} == {2}


@pytest.fixture(autouse=True)
def _no_process_group_left_open() -> Iterator[None]:
    yield
    import torch.distributed as dist

    assert not dist.is_initialized()

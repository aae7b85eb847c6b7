"""overlapcfg in the trainers where people run FSDP2: torchtitan's main trainer
(``overlapcfg.integrations.torchtitan.fsdp2``), PyTorch Lightning (``overlapcfg.integrations.lightning``) and
Hugging Face accelerate (``overlapcfg.integrations.accelerate``).

Slow (one gloo run, 2 ranks, all three trainers: ``tests/support/trainer_ranks.py``): each trainer trains
``STEPS`` steps through its own code path twice, with overlapcfg's integration and with its own FSDP2 route and
the same grouping; the losses and final parameter shards are equal bit for bit, the groups and prefetch lists
FSDP2 holds (read from the modules, ``tests/support/fsdp2_readback.py``) are the plan's and the policy's, written
out here by hand, and equal overlapcfg's record; and a plan that does not fit the model fails before the first
step, in the trainer. Fast: the refusals of each trainer's settings and versions, without processes.
"""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from overlapcfg import OverlapConfigError
from overlapcfg.compat import fake_process_group
from overlapcfg.demo.llama import Llama, LlamaConfig
from overlapcfg.integrations.trainer_checks import release_series, version_fault
from tests.support.fsdp2_readback import ROOT, windows
from tests.support.rank_warmup import preloaded

DEPTH = 2
TORCHTITAN_PLAN = ("plan: {buckets: [tok_embeddings, layers.*, {modules: [norm, lm_head], "
                   "reshard_after_forward: false}], require_full_coverage: true}\n"
                   f"policy: {{forward_prefetch: {DEPTH}, backward_prefetch: {DEPTH}}}\n")
LIGHTNING_CFG = {"plan": "llama_layers", "policy": {"forward_prefetch": DEPTH, "backward_prefetch": DEPTH}}


# --- 2 gloo ranks, all three trainers ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from overlapcfg.demo.gloo import run_on_gloo
    from tests.support.trainer_ranks import all_trainers

    folder = tmp_path_factory.mktemp("torchtitan")
    good, bad = folder / "overlap.yaml", folder / "bad.yaml"
    good.write_text(TORCHTITAN_PLAN)
    bad.write_text("plan: {buckets: [tok_embeddings, layer.*, [norm, lm_head]]}\n")
    jobs = {
        "torchtitan": (str(good), str(bad)),
        "lightning": (LIGHTNING_CFG, {"plan": {"buckets": ["tok_embeddings", "layer.*", ["norm", "output"]]}}),
        "accelerate": ({"plan": {"buckets": ["model.embed", "model.layers.*"]}},),
    }
    return run_on_gloo(all_trainers, jobs, timeout_s=280,
                       preload=preloaded("tests.support.trainer_ranks", "lightning.pytorch", "accelerate",
                                         "transformers"))


# trainer -> (its own variant, the forward order of the groups the plan makes)
TRAINERS = {
    "torchtitan": ("torchtitan", ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm+lm_head"]),
    "lightning": ("lightning", ["tok_embeddings", *(f"layers.{i}" for i in range(4)), "norm+output"]),
    "accelerate": ("accelerate", ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)),
                                  "model.norm+lm_head"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_losses_and_parameters_match_the_trainers_own_fsdp2_bit_for_bit(runs: list[dict[str, Any]],
                                                                         trainer: str) -> None:
    own = TRAINERS[trainer][0]
    for rank in runs:
        ours, theirs = rank[trainer]["overlapcfg"], rank[trainer][own]
        assert len(ours["losses"]) == 3 and ours["losses"] == theirs["losses"]
        assert ours["params"].keys() == theirs["params"].keys()
        for name, shard in ours["params"].items():
            assert torch.equal(shard, theirs["params"][name]), name
    assert runs[0][trainer]["overlapcfg"]["losses"] != runs[1][trainer]["overlapcfg"]["losses"]  # own data per rank


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_fsdp2_holds_the_groups_of_the_plan_and_the_trainers_own_grouping(runs: list[dict[str, Any]],
                                                                          trainer: str) -> None:
    own, order = TRAINERS[trainer]
    for rank in runs:
        groups = rank[trainer]["overlapcfg"]["groups"]
        assert list(groups) == [ROOT, *order] and groups[ROOT] == ()  # every parameter in a bucket
        block = [g for g in order if g.rpartition(".")[0].endswith("layers")]
        assert all(groups[g] and all(p.startswith(f"{g}.") for p in groups[g]) for g in block)
        assert groups == rank[trainer][own]["groups"]  # the trainer's own route made the same groups


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_fsdp2_holds_the_prefetch_lists_the_policy_asks_for(runs: list[dict[str, Any]], trainer: str) -> None:
    order = TRAINERS[trainer][1]
    for rank in runs:
        seen = rank[trainer]["overlapcfg"]
        assert seen["forward"] == windows(order, DEPTH)
        assert seen["backward"] == windows(order[::-1], DEPTH)
        assert (seen["record_forward"], seen["record_backward"]) == (seen["forward"], seen["backward"])


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_each_trainer_checks_the_schedule_across_the_ranks_silently(runs: list[dict[str, Any]], trainer: str) -> None:
    """The integration's ``fully_shard`` compared the groups and prefetch lists across both ranks before sharding
    (``overlapcfg.graph.same_schedule``), found them equal and recorded it; the bitwise test above is the proof
    that the check changed nothing else."""
    for rank in runs:
        outcome = rank[trainer]["overlapcfg"]["same_schedule"]
        assert outcome.startswith("checked: the same ") and "(2 ranks)" in outcome, outcome


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "case", "text"), [
    ("torchtitan", "bad", "overlapcfg cannot shard this model in torchtitan's trainer: OVERLAPCFG_CONFIG="),
    ("torchtitan", "bad", "overlap.plan.buckets[1]: pattern 'layer.*' matches no module; did you mean 'layers.*'?"),
    ("lightning", "bad", "overlap.plan.buckets[1]: pattern 'layer.*' matches no module; did you mean 'layers.*'?"),
    ("accelerate", "bad", "pattern 'model.embed' matches no module; did you mean 'model.embed_tokens'?"),
    ("accelerate", "unpromoted", "fsdp_config.fsdp_version: the Accelerator is not running FSDP2: accelerate runs"),
    ("accelerate", "own_policy", "fsdp_config.fsdp_auto_wrap_policy: transformer_auto_wrap_policy wraps modules"),
])
def test_a_bad_plan_or_setting_fails_in_the_trainer_before_the_first_step(runs: list[dict[str, Any]], trainer: str,
                                                                          case: str, text: str) -> None:
    for rank in runs:
        seen = rank[trainer][case]
        assert seen["error"] is not None and seen["error"].startswith("OverlapConfigError"), seen
        assert text in seen["error"]
        assert seen.get("steps", 0) == 0 and seen.get("untouched", True)


# --- refusals, one process -----------------------------------------------------------------------------------------

def test_a_release_outside_the_tested_minor_series_is_a_fault_naming_the_extra() -> None:
    assert release_series("2.6.6") == (2, 6) and release_series("1.15.0.dev3") == (1, 15)
    assert release_series("nightly") is None
    assert version_fault("lightning", "2.6.6", extra="lightning", installed="2.6.0") is None
    fault = version_fault("lightning", "2.6.6", extra="lightning", installed="2.5.1")
    assert fault is not None and fault.path == "lightning"
    assert "version 2.5.1 is not supported" in fault.message and "accepts 2.6.x only" in fault.message
    assert "pip install 'overlapcfg[lightning]' installs 2.6.6" in fault.message
    assert version_fault("no-such-distribution-here", "1.0.0", extra="x") is None


@pytest.fixture
def mesh_2d() -> Iterator[Any]:
    with fake_process_group(2, 0):
        yield init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))


def _demo() -> nn.Module:
    return Llama(LlamaConfig(n_layers=2), seed=0)


def test_lightning_refuses_no_mesh_fsdp1_and_an_auto_tensor_parallel_split_at_once(mesh_2d: Any) -> None:
    pytest.importorskip("lightning")
    import lightning  # noqa: F401  (the Lightning in use is the one imported)

    from overlapcfg.integrations.lightning import parallelize

    fn = parallelize(LIGHTNING_CFG)
    with pytest.raises(OverlapConfigError) as err:
        fn(_demo(), None)
    assert "strategy: the device mesh is None" in str(err.value) and "FSDP1" in str(err.value)
    model = _demo()
    with pytest.raises(OverlapConfigError) as err:
        fn(model, mesh_2d)
    text = str(err.value)
    assert text.startswith("overlapcfg cannot shard this model under Lightning's ModelParallelStrategy (1 fault)")
    assert "ModelParallelStrategy.data_parallel_size: 1, with tensor_parallel_size=2" in text
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


def test_lightning_refuses_a_model_already_sharded_and_an_unsupported_release(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    import lightning  # noqa: F401

    import overlapcfg.integrations.lightning as integration

    with fake_process_group(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        model = _demo()
        torch_fully_shard(model.layers["0"], mesh=mesh)
        monkeypatch.setattr(integration, "TESTED", "2.5.0")
        with pytest.raises(OverlapConfigError) as err:
            integration.parallelize(LIGHTNING_CFG)(model, mesh)
    text = str(err.value)
    assert "(2 faults)" in text and "lightning: version" in text and "accepts 2.5.x only" in text
    assert "configure_model: module 'layers.0' is already sharded with FSDP2" in text


def test_lightning_returns_a_model_it_already_sharded_when_configure_model_runs_again() -> None:
    from overlapcfg.integrations.lightning import parallelize

    with fake_process_group(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        fn = parallelize(LIGHTNING_CFG)
        model = fn(_demo(), mesh)
        assert fn(model, mesh) is model


def _plugin(**fields: Any) -> Any:
    values = {"auto_wrap_policy": None, "activation_checkpointing": False, "cpu_ram_efficient_loading": False,
              "fsdp_version": 2, **fields}
    return types.SimpleNamespace(**values)


def test_accelerate_refuses_plugin_settings_it_would_skip_silently_all_at_once() -> None:
    pytest.importorskip("accelerate")
    from overlapcfg.integrations.accelerate import fully_shard

    plugin = _plugin(auto_wrap_policy=lambda module: True, activation_checkpointing=True,
                     cpu_ram_efficient_loading=True)
    acc = types.SimpleNamespace(is_fsdp2=True, state=types.SimpleNamespace(fsdp_plugin=plugin))
    model = _demo()
    with pytest.raises(OverlapConfigError) as err:
        fully_shard(acc, model, LIGHTNING_CFG)
    text = str(err.value)
    assert "(3 faults)" in text
    for setting in ("fsdp_auto_wrap_policy", "fsdp_activation_checkpointing", "fsdp_cpu_ram_efficient_loading"):
        assert f"fsdp_config.{setting}:" in text
    version = types.SimpleNamespace(is_fsdp2=False, state=types.SimpleNamespace(
        fsdp_plugin=_plugin(fsdp_version=1), distributed_type="DistributedType.MULTI_GPU"))
    with pytest.raises(OverlapConfigError, match="its FSDP plugin is fsdp_version 1"):
        fully_shard(version, model, LIGHTNING_CFG)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


class _Block(nn.Module):
    def __init__(self, moe: bool = False) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)
        self.moe_enabled = moe


class _Decoder(nn.Module):
    """torchtitan's decoder layout: ``tok_embeddings``, ``layers`` (a ModuleDict), ``norm``, ``lm_head``."""

    def __init__(self, moe: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 4)
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block(moe)})
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 8)
        self.enable_weight_tying = tied


def _dims(**fields: Any) -> Any:
    return types.SimpleNamespace(**{"pp_enabled": False, "pp": 1, "ep": 1, **fields})


def test_torchtitans_own_grouping_as_a_plan_keeps_its_reshard_rule() -> None:
    from overlapcfg.integrations.torchtitan.fsdp2 import torchtitan_fsdp2_plan

    plan = torchtitan_fsdp2_plan(_Decoder(), "default")
    assert plan["buckets"] == ["tok_embeddings", {"modules": ["norm", "lm_head"], "reshard_after_forward": False},
                               "layers.0", "layers.1"]
    assert plan["require_full_coverage"]
    tied = torchtitan_fsdp2_plan(_Decoder(tied=True), "always")["buckets"][0]
    assert tied == {"modules": ["tok_embeddings", "norm", "lm_head"], "reshard_after_forward": True}


def test_torchtitan_refuses_pipeline_and_expert_parallel_moe_and_foreign_parallelize_at_once() -> None:
    from overlapcfg.integrations.torchtitan.fsdp2 import parallelize_fn

    class Foreign:  # a parallelize_fn with no apply_fsdp_to_decoder to call (say, SimpleFSDP's)
        def __init__(self) -> None:
            self.calls: list[nn.Module] = []

        def __call__(self, model: nn.Module, **kwargs: Any) -> nn.Module:
            self.calls.append(model)
            return model

    foreign = Foreign()
    fn = parallelize_fn(foreign, {"plan": {"buckets": ["tok_embeddings", "layers.*", ["norm", "lm_head"]]}})
    with pytest.raises(OverlapConfigError) as err:
        fn(_Decoder(moe=True), parallel_dims=_dims(pp_enabled=True, pp=2, ep=2),
           parallelism=types.SimpleNamespace(fsdp_reshard_after_forward="default"))
    text = str(err.value)
    assert text.startswith("overlapcfg cannot shard this model in torchtitan's trainer (4 faults)")
    for path in ("model_spec.parallelize_fn:", "parallelism.pipeline_parallel_degree: 2",
                 "parallelism.expert_parallel_degree: 2", "model: MoE blocks (layers.1)"):
        assert path in text
    assert foreign.calls == []  # nothing of the trainer's parallelize ran


_CALLS: list[nn.Module] = []


def apply_fsdp_to_decoder(*args: Any, **kwargs: Any) -> None:
    """Named as torchtitan's FSDP step, so that ``_torchtitan_shaped_parallelize`` has the shape of its
    ``parallelize_*`` functions (the integration replaces this global while the function runs)."""
    raise AssertionError("never reached: the integration's pre-checks fail first")


def _torchtitan_shaped_parallelize(model: nn.Module, **kwargs: Any) -> nn.Module:
    _CALLS.append(model)
    apply_fsdp_to_decoder(model)
    return model


def test_torchtitan_checks_the_plan_before_its_parallelize_runs(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    from overlapcfg.integrations.torchtitan.fsdp2 import parallelize_fn

    path = tmp_path / "overlap.yaml"
    path.write_text("plan: {buckets: [tok_embedding, layers.*, [norm, lm_head]]}\n")
    monkeypatch.setenv("OVERLAPCFG_CONFIG", str(path))
    _CALLS.clear()
    with pytest.raises(OverlapConfigError) as err:
        parallelize_fn(_torchtitan_shaped_parallelize)(
            _Decoder(), parallel_dims=_dims(), parallelism=types.SimpleNamespace(fsdp_reshard_after_forward="never"))
    text = str(err.value)
    assert f"OVERLAPCFG_CONFIG={str(path)!r} does not fit the model (fsdp_reshard_after_forward=never)" in text
    assert "pattern 'tok_embedding' matches no module; did you mean 'tok_embeddings'?" in text
    assert _CALLS == []
    assert globals()["apply_fsdp_to_decoder"] is apply_fsdp_to_decoder  # restored


def test_importing_overlapcfg_imports_no_trainer() -> None:
    code = ("import sys, overlapcfg, overlapcfg.integrations, overlapcfg.integrations.trainer_checks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torchtitan', 'lightning', 'pytorch_lightning', 'lightning_fabric', 'accelerate')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"

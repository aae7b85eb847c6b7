"""Rank functions for ``tests/integrations/test_trainers.py``: each trainer trains a few steps on 2 gloo ranks twice,
once sharded by overlapcfg's integration and once by the trainer's own FSDP2 route with the same grouping (plain
``fully_shard`` calls, no explicit prefetch), then a config whose plan does not fit the model. Each returns the
losses, the final local parameter shards, what FSDP2 holds (``tests.support.fsdp2_readback``) and overlapcfg's
record of the lists it gave FSDP2. Spawned by ``run_on_gloo``, so everything here is importable by name.

The examples in ``examples/`` are the code under test where they can be: the Lightning and accelerate rank
functions import the example scripts and run their modules, trainers and data.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from tests.support.fsdp2_readback import read_fsdp2, record_lists

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 3


def example(name: str) -> ModuleType:
    """``examples/<name>/train.py`` as a module (the examples are scripts, not a package)."""
    key = f"_overlapcfg_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / name / "train.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to_local().clone() for n, p in model.named_parameters()}


def _observed(model: torch.nn.Module) -> dict[str, Any]:
    from overlapcfg.fsdp2 import read_record

    layout = read_fsdp2(model)
    forward, backward = record_lists(model)
    return {"groups": layout.groups, "forward": layout.forward, "backward": layout.backward,
            "record_forward": forward, "record_backward": backward,
            "same_schedule": read_record(model).record.same_schedule}


# --- Lightning ------------------------------------------------------------------------------------------------------

def lightning_ranks(rank: int, world_size: int, cfg: dict[str, Any], bad_cfg: dict[str, Any]) -> dict[str, Any]:
    """Lightning's Trainer with ``ModelParallelStrategy`` on this gloo rank (``LOCAL_RANK`` set: Lightning joins
    the open process group instead of launching processes): the example's module with overlapcfg's
    ``configure_model``, then the same module with a hand-written ``configure_model`` (torch's ``fully_shard`` on
    the embedding, each block, ``[norm, output]``, the root), then a plan that does not fit."""
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "RANK": str(rank),
                       "WORLD_SIZE": str(world_size)})
    ex = example("lightning")

    class OwnFsdp2(ex.LitLlama):  # type: ignore[misc,name-defined]
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            model = self.model
            torch_fully_shard(model.tok_embeddings, mesh=mesh)
            for block in model.layers.values():
                torch_fully_shard(block, mesh=mesh)
            torch_fully_shard([model.norm, model.output], mesh=mesh)
            torch_fully_shard(model, mesh=mesh)

    out: dict[str, Any] = {}
    for variant, module in (("overlapcfg", ex.LitLlama(cfg)), ("lightning", OwnFsdp2(cfg))):
        trainer = ex.trainer(STEPS, devices=world_size)
        trainer.fit(module, ex.batches(rank, STEPS, module.model.config.vocab_size))
        out[variant] = {"losses": [x.item() for x in module.losses], "params": _local(module.model)}
        out[variant].update(_observed(module.model) if variant == "overlapcfg" else
                            {"groups": read_fsdp2(module.model).groups})
    module = ex.LitLlama(bad_cfg)
    try:
        ex.trainer(STEPS, devices=world_size).fit(module, ex.batches(rank, STEPS, module.model.config.vocab_size))
        out["bad"] = {"error": None, "steps": len(module.losses)}
    except Exception as err:  # Lightning re-raises what configure_model raised, after its own teardown
        out["bad"] = {"error": f"{type(err).__name__}: {err}", "steps": len(module.losses)}
    return out


# --- torchtitan's main trainer ------------------------------------------------------------------------------------

def torchtitan_ranks(rank: int, world_size: int, setting: str, bad_file: str) -> dict[str, Any]:
    """torchtitan's ``Trainer.__init__`` cannot start on CPU (it picks CUDA when there is no accelerator, and sets
    that device). What runs instead, on this gloo rank, is its model set-up as ``Trainer.__init__`` does it: the
    config function's model built on the meta device, ``model_spec.parallelize_fn`` with a real ``ParallelDims``
    (2-way FSDP; its mesh built on CPU), ``to_empty`` + ``init_weights``; then ``STEPS`` of
    ``Trainer.forward_backward_step`` (torchtitan's loss and global-token scaling) and the optimizer built from the
    config. Once with ``examples/torchtitan/overlap_configs.llama3_debugmodel_overlapcfg`` (``OVERLAPCFG_CONFIG=
    setting``), once with torchtitan's own ``llama3_debugmodel``, then with a config file whose plan does not fit.

    CPU adjustments, the same for both: ``parallelism.spmd_backend=partial_dtensor`` (the default ``spmd_types``
    fails inside torchtitan's own ``apply_fsdp_to_decoder`` in this set-up), SDPA instead of FlexAttention, and
    ``set_force_sum_reduction_for_comms`` on every FSDP2 module (gloo has no ``PREMUL_SUM``, which FSDP2 uses for
    torchtitan's gradient divide factor 1)."""
    from tests.thirdparty.graph_trainer import graph_trainer_stubs

    with graph_trainer_stubs():
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        from torchtitan.models.llama3.config_registry import llama3_debugmodel

        spec = importlib.util.spec_from_file_location("_overlapcfg_example_torchtitan",
                                                      EXAMPLES / "torchtitan" / "overlap_configs.py")
        assert spec is not None and spec.loader is not None
        ex = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ex)
    parallel_dims_module.device_type = "cpu"  # where ParallelDims builds its meshes
    out: dict[str, Any] = {}
    for variant, make, env in (("overlapcfg", ex.llama3_debugmodel_overlapcfg, setting),
                               ("torchtitan", llama3_debugmodel, None)):
        os.environ.pop("OVERLAPCFG_CONFIG", None) if env is None else os.environ.update(OVERLAPCFG_CONFIG=env)
        model, losses = _torchtitan_train(make(), rank, world_size)
        out[variant] = {"losses": losses, "params": _local(model)}
        out[variant].update(_observed(model) if variant == "overlapcfg" else {"groups": read_fsdp2(model).groups})
    os.environ["OVERLAPCFG_CONFIG"] = bad_file
    try:
        _torchtitan_train(ex.llama3_debugmodel_overlapcfg(), rank, world_size, steps=0)
        out["bad"] = {"error": None}
    except Exception as err:
        out["bad"] = {"error": f"{type(err).__name__}: {err}"}
    return out


def _torchtitan_train(config: Any, rank: int, world_size: int, steps: int = STEPS) -> tuple[torch.nn.Module,
                                                                                             list[float]]:
    import types

    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.trainer import Trainer

    config.parallelism.spmd_backend = "partial_dtensor"
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    model_config = config.model_spec.model
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = model_config.build()
    model = config.model_spec.parallelize_fn(model, parallel_dims=dims, training=config.training,
                                             parallelism=config.parallelism, compile_config=config.compile,
                                             ac_config=None, dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    trainer = object.__new__(Trainer)  # Trainer.__init__ needs a GPU; forward_backward_step reads these fields
    trainer.model_parts, trainer.parallel_dims, trainer.model_config = [model], dims, model_config
    trainer.loss_fn = CrossEntropyLoss.Config().build()
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=dims)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    trainer.device, trainer.tokenizer, trainer.ntokens_seen = torch.device("cpu"), None, 0
    trainer.config = types.SimpleNamespace(parallelism=config.parallelism)
    optimizers = config.optimizer.build(model_parts=[model])
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        data = torch.randint(0, model_config.vocab_size, (2, 33), generator=gen)
        optimizers.zero_grad()
        loss = trainer.forward_backward_step(input_dict={"input": data[:, :-1]}, labels=data[:, 1:],
                                             global_valid_tokens=torch.tensor(float(2 * 32 * world_size)))
        optimizers.step()
        losses.append(loss.item())
    return model, losses


# --- accelerate -----------------------------------------------------------------------------------------------------

def accelerate_ranks(rank: int, world_size: int, bad_cfg: dict[str, Any]) -> dict[str, Any]:
    """accelerate's FSDP2 path on this gloo rank: ``examples/accelerate/train.py``'s ``train`` with ``cpu=True``
    (the state accelerate built set to FSDP2, as the example documents), once through overlapcfg's
    ``fully_shard`` and the example's ``CONFIG``, once with accelerate's own wrapping (``TRANSFORMER_BASED_WRAP``),
    then a plan that does not fit, and the refusals of a state accelerate left unpromoted and of its own
    wrapping policy."""
    from accelerate.state import AcceleratorState

    # accelerate reads torchrun's variables; the process group already exists, so the address is never dialled
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    ex = example("accelerate")
    out: dict[str, Any] = {}
    for variant, own in (("overlapcfg", False), ("accelerate", True)):
        AcceleratorState._reset_state(reset_partial_state=True)
        losses, model = ex.train(ex.CONFIG, steps=STEPS, own=own, cpu=True)
        out[variant] = {"losses": losses, "params": _local(model)}
        out[variant].update(_observed(model) if variant == "overlapcfg" else {"groups": read_fsdp2(model).groups})
    for case, cpu, own, cfg in (("bad", True, False, bad_cfg), ("unpromoted", False, False, ex.CONFIG),
                                ("own_policy", True, True, ex.CONFIG)):
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = ex.accelerator(own=own, cpu=cpu)
        model = ex.tiny_llama()
        try:
            ex.fully_shard(acc, model, cfg)
            out[case] = {"error": None}
        except Exception as err:
            out[case] = {"error": f"{type(err).__name__}: {err}",
                         "untouched": not any(type(m).__name__.startswith("FSDP") for m in model.modules())}
    return out


def all_trainers(rank: int, world_size: int, jobs: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """The rank functions above named in ``jobs`` (``{trainer: args}``), in one gloo run: spawning ranks and
    importing torch costs more than the steps."""
    functions = {"lightning": lightning_ranks, "torchtitan": torchtitan_ranks, "accelerate": accelerate_ranks}
    return {name: functions[name](rank, world_size, *args) for name, args in jobs.items()}

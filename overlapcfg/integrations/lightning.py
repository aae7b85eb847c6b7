"""overlapcfg in PyTorch Lightning: a ``parallelize_fn`` for ``ModelParallelStrategy``, Lightning's FSDP2 route.

Lightning 2.6 runs FSDP2 through ``ModelParallelStrategy``, where the user shards: Fabric's strategy takes
``parallelize_fn(model, device_mesh) -> model``, and the Trainer's calls ``LightningModule.configure_model``, where
``self.device_mesh`` is set. ``parallelize(cfg)`` is such a function, for both::

    # Fabric
    strategy = ModelParallelStrategy(parallelize_fn=parallelize(cfg), data_parallel_size=8, tensor_parallel_size=1)

    # Trainer(strategy=ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1)), in your LightningModule:
    def configure_model(self):
        parallelize(cfg)(self.model, self.device_mesh)

It shards over the mesh's ``data_parallel`` dim with ``overlapcfg.fully_shard`` (one FSDP2 group per bucket,
explicit prefetch from the policy); Lightning then materializes meta parameters and moves the model, as it does
after a hand-written ``configure_model``. Lightning calls ``configure_model`` once per stage (fit, then validate or
test in the same process): a model this config already sharded is returned as it is.

Refused before anything is sharded, in Lightning's terms, every fault at once: a Lightning outside 2.6.x, no
device mesh (``Trainer(strategy="fsdp")`` is FSDP1, which wraps by its own ``auto_wrap_policy`` and never sets
``device_mesh``), FSDP1 or FSDP2 already applied to the model (a ``fully_shard`` of your own in
``configure_model``), a ``data_parallel`` dim of size 1 while ``tensor_parallel_size`` took every device
(``"auto"`` does that) and no tensor parallelism was applied: FSDP2 would shard over one rank. The plan's own
faults against the model follow (``overlapcfg.fully_shard``), also before anything is sharded.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from overlapcfg.config import load_config
from overlapcfg.config.load import ConfigSource
from overlapcfg.errors import Fault
from overlapcfg.fsdp2 import RECORD_ATTR, fully_shard
from overlapcfg.integrations.trainer_checks import raise_faults, version_fault

__all__ = ["DATA_PARALLEL", "TESTED", "parallelize"]

logger = logging.getLogger(__name__)

TESTED = "2.6.6"
"""The Lightning release this integration is tested with (2.6.x is accepted)."""

DATA_PARALLEL = "data_parallel"
"""The dim of ``ModelParallelStrategy``'s mesh that FSDP2 shards over (the other is ``tensor_parallel``)."""

HEADER = "overlapcfg cannot shard this model under Lightning's ModelParallelStrategy"

_DISTRIBUTIONS = {"lightning": "lightning", "pytorch_lightning": "pytorch-lightning",
                  "lightning_fabric": "lightning-fabric"}
"""Lightning's import names and their distributions: whichever is imported is the Lightning in use."""

M = TypeVar("M", bound=nn.Module)


def parallelize(cfg: ConfigSource, *, config_root: str = "overlap",
                **fully_shard_kwargs: Any) -> Callable[[M, DeviceMesh | None], M]:
    """A ``parallelize_fn(model, device_mesh) -> model`` that shards ``model`` by ``cfg`` over the mesh's
    ``data_parallel`` dim (a 1-D mesh is used as it is). ``cfg`` is loaded now, so its faults arrive when the
    strategy is built; ``fully_shard_kwargs`` pass through (``mp_policy``, ``reshard_after_forward``, ...)."""
    config = load_config(cfg, root=config_root)

    def parallelize_fn(model: M, device_mesh: DeviceMesh | None) -> M:
        if isinstance(model, FSDPModule) and RECORD_ATTR in vars(model):
            logger.debug("overlapcfg: configure_model ran again; the model is already sharded by overlapcfg")
            return model
        mesh, faults = _data_parallel_mesh(model, device_mesh)
        raise_faults([*_version_faults(), *faults, *_already_sharded(model)], HEADER)
        return fully_shard(model, config, mesh=mesh, **fully_shard_kwargs)

    return parallelize_fn


def _version_faults() -> list[Fault | None]:
    return [version_fault(dist, TESTED, extra="lightning") for name, dist in _DISTRIBUTIONS.items()
            if name in sys.modules]


def _data_parallel_mesh(model: nn.Module, mesh: DeviceMesh | None) -> tuple[DeviceMesh | None, list[Fault]]:
    if mesh is None:
        return None, [Fault("strategy", (
            "the device mesh is None: Lightning sets LightningModule.device_mesh under ModelParallelStrategy only. "
            "Trainer(strategy='fsdp') is FSDP1, which wraps the model by its own auto_wrap_policy and would override "
            "the plan: use strategy=ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)"))]
    names = tuple(mesh.mesh_dim_names or ())
    if DATA_PARALLEL in names:
        dp = mesh[DATA_PARALLEL]
    elif mesh.ndim == 1:
        return mesh, []
    else:
        return None, [Fault("device_mesh", f"expected ModelParallelStrategy's mesh (dims {DATA_PARALLEL!r}, "
                                           f"'tensor_parallel') or a 1-D data-parallel mesh, got dims {names}")]
    tensor_parallel = mesh.size() // dp.size()
    has_dtensors = any(isinstance(p, DTensor) for p in model.parameters())
    if dp.size() == 1 and tensor_parallel > 1 and not has_dtensors:
        return dp, [Fault("ModelParallelStrategy.data_parallel_size", (
            f"1, with tensor_parallel_size={tensor_parallel} ('auto' gives every device to tensor parallel) and no "
            "tensor parallelism applied: FSDP2 would shard over one rank and no bucket would gather anything; set "
            f"data_parallel_size={mesh.size()}, tensor_parallel_size=1"))]
    return dp, []


def _already_sharded(model: nn.Module) -> list[Fault]:
    """FSDP1 or FSDP2 applied before us: overlapcfg's ``fully_shard`` must make every group itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for name, module in model.named_modules():
        where = f"module {name!r}" if name else "the model"
        if isinstance(module, FullyShardedDataParallel):
            return [Fault("strategy", f"{where} is wrapped in FSDP1 (FullyShardedDataParallel), whose wrapping policy "
                                      "overrides the plan: use ModelParallelStrategy and let parallelize shard")]
        if isinstance(module, FSDPModule):
            return [Fault("configure_model", (
                f"{where} is already sharded with FSDP2 (a fully_shard call of your own in configure_model, or a "
                "callback's): overlapcfg's parallelize calls fully_shard for every bucket and the root itself; "
                "remove the other call"))]
    return []

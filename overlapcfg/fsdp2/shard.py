"""``overlapcfg.fully_shard(model, cfg)``: drive eager FSDP2 from the same plan and policy as the compiled path.

The one place in the package with side effects on the model, in three steps:

1. **Decide everything** (``overlapcfg.fsdp2.layout``): load the config, check the keywords and the mesh,
   resolve the plan against ``model.named_modules()``, refuse what FSDP2 would refuse (container modules, 0-dim
   parameters), size every bucket, plan the prefetch lists. Any fault raises here, before a single module is
   sharded, so the model comes back exactly as it was given.
2. **Shard**: torch's ``fully_shard`` once per bucket (a list of modules where the bucket holds several, so FSDP2
   all-gathers them as one group), deepest buckets first, then once on the root for the parameters no bucket
   holds (FSDP2 requires inner modules to be sharded before the modules containing them).
3. **Prefetch**: ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` on every group, from
   the plan's depths (``overlapcfg.fsdp2.prefetch``), then the record is attached (``overlapcfg.fsdp2.sharded``).
   The first forward checks the bucket order the lists assume and re-plans them if the model runs its buckets
   in another order (``overlapcfg.fsdp2.observe``).

Between steps 1 and 2, the layout's fingerprint (groups, parameters, prefetch lists: ``sharded.layout_schedule``)
is compared across the ranks of the mesh (``overlapcfg.graph.same_schedule``; off with ``check_same_schedule:
false``): ranks that would shard differently raise ``SameScheduleError`` before anything is sharded, instead of
hanging in FSDP2's first all-gather.

Steps 2 and 3 fail only for what torch alone can see (a ``shard_placement_fn`` that raises, say); then the model
is restored from a snapshot taken before step 2 (``overlapcfg.fsdp2.rollback``) and torch's error propagates.

Not done: choosing a mesh (``mesh=None`` is FSDP2's default, every rank of the default group), mixed precision or
offload (pass them through as ``fully_shard`` keywords), activation checkpointing (apply it before, it is
transparent to the plan's patterns).
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from overlapcfg.config import load_config
from overlapcfg.config.boundary import user_paths
from overlapcfg.config.load import ConfigSource
from overlapcfg.fsdp2.checks import check_kwargs, check_mesh, check_unsharded, shard_size
from overlapcfg.fsdp2.layout import ShardLayout, plan_layout
from overlapcfg.fsdp2.observe import watch_first_forward
from overlapcfg.fsdp2.rollback import Snapshot
from overlapcfg.fsdp2.sharded import RECORD_ATTR, build_record, layout_schedule
from overlapcfg.graph.same_schedule import check_same_schedule

__all__ = ["fully_shard"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


def fully_shard(model: M, cfg: ConfigSource, *, mesh: DeviceMesh | None = None, config_root: str = "overlap",
                **fully_shard_kwargs: Any) -> M:
    """Shard ``model`` with FSDP2, one ``fully_shard`` group per bucket of ``cfg``'s plan, prefetching as its policy
    says; returns ``model`` (sharded in place, as torch's ``fully_shard`` does).

    ``cfg``: anything ``overlapcfg.load_config`` reads (a config, a dict, YAML text, a ``pathlib.Path``, a Hydra
    node); its strategy must be ``manual``. ``mesh``: the data-parallel ``DeviceMesh`` (None: FSDP2's default).
    ``config_root``: where the config sits in the user's tree (as ``load_config(cfg, root=...)``; a config loaded
    already, or a Hydra node, knows it), so faults read ``trainer.overlap.plan...``.
    ``fully_shard_kwargs``: passed to every ``torch.distributed.fsdp.fully_shard`` call (``mp_policy``,
    ``offload_policy``, ``reshard_after_forward`` as the default of buckets that set none, ...).

    Raises ``OverlapConfigError`` (every fault, with its config path), ``TypeError`` for an unknown keyword,
    ``ValueError`` for a mesh FSDP2 cannot shard over (3-D without ``dp_mesh_dims``) and ``RuntimeError`` for a
    model FSDP2 already manages, all before anything is sharded. An error torch raises while sharding comes after
    the model was restored.
    """
    started = time.perf_counter()
    config = load_config(cfg, root=config_root)
    check_kwargs(fully_shard_kwargs)
    check_unsharded(model)
    check_mesh(mesh, fully_shard_kwargs)
    with user_paths(config.mount):
        layout = plan_layout(model, config, shard_size=shard_size(mesh, fully_shard_kwargs),
                             kwargs=fully_shard_kwargs)
    notes = config.mount.notes(layout.notes)  # the record's notes, at the user's paths
    mesh_groups = _mesh_groups(mesh)
    schedule = layout_schedule(layout, mesh_groups)
    checked = check_same_schedule(schedule, enabled=config.check_same_schedule,
                                  timeout_s=config.same_schedule_timeout_s, where="overlapcfg.fully_shard")
    snapshot = Snapshot.take(model)
    try:
        groups = _shard(model, layout, mesh, fully_shard_kwargs)
        _set_prefetch(model, layout, groups)
        record = build_record(layout, config, seconds=time.perf_counter() - started, notes=notes, schedule=schedule,
                              same_schedule=checked)
        setattr(model, RECORD_ATTR, record)
    except BaseException:
        snapshot.restore()  # whatever torch refused half-way, the model comes back as it was given
        raise

    def replan(measured: ShardLayout) -> None:
        _set_prefetch(model, measured, groups)
        again = layout_schedule(measured, mesh_groups)
        note = "" if again == schedule else " (for the planned order; prefetch re-planned on the first forward, " \
                                            "not checked again)"
        setattr(model, RECORD_ATTR, build_record(measured, config, seconds=record.record.seconds, notes=notes,
                                                 schedule=again, same_schedule=checked + note))

    watch_first_forward(model, layout, replan)
    logger.info("overlapcfg.fully_shard: %d FSDP2 groups + root (%d root parameters), %.3fs", len(groups),
                len(layout.root_params), record.record.seconds)
    return model


def _mesh_groups(mesh: DeviceMesh | None) -> list[tuple[str, int]]:
    """``(name, size)`` of the process groups FSDP2 will communicate over: one per dimension of ``mesh``, or the
    default group (FSDP2's default mesh); none without a process group."""
    if mesh is not None:
        return [(g.group_name, g.size()) for g in (mesh.get_group(i) for i in range(mesh.ndim))]
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return [(world.group_name, world.size())] if world is not None else []


def _shard(model: nn.Module, layout: ShardLayout, mesh: DeviceMesh | None,
           kwargs: dict[str, Any]) -> list[FSDPModule]:
    """``fully_shard`` each bucket, deepest first, then the root; the FSDP module standing for each bucket."""
    groups: list[FSDPModule | None] = [None] * len(layout.buckets)
    # Buckets never nest (a module belongs to one bucket, counting nesting), so any order would do; deepest
    # first keeps FSDP2's inner-before-outer rule true by construction.
    depth = [max(m.count(".") for m in b.resolved.modules) for b in layout.buckets]
    order = sorted(range(len(layout.buckets)), key=lambda i: -depth[i])
    for i in order:
        b = layout.buckets[i]
        own = {} if b.reshard_after_forward is None else {"reshard_after_forward": b.reshard_after_forward}
        target: nn.Module | list[nn.Module] = list(b.modules) if len(b.modules) > 1 else b.modules[0]
        torch_fully_shard(target, mesh=mesh, **{**kwargs, **own})
        groups[i] = _fsdp(b.modules[0])
        logger.debug("fully_shard %s (%d modules, %d bytes)", b.name, len(b.modules), b.unsharded_bytes)
    torch_fully_shard(model, mesh=mesh, **kwargs)
    return [_fsdp(g) for g in groups]


def _fsdp(module: object) -> FSDPModule:
    if not isinstance(module, FSDPModule):
        raise AssertionError(f"overlapcfg.fully_shard: {type(module).__name__} is not an FSDP module after sharding")
    return module


def _set_prefetch(model: nn.Module, layout: ShardLayout, groups: list[FSDPModule]) -> None:
    """Explicit lists on every group and the root. FSDP2 reads an empty backward list as "use the implicit
    depth-1 prefetch", so depth 0 is given as the group itself: prefetching a group that has just been
    all-gathered is a no-op (``unshard`` returns early), and the implicit prefetch stays off."""
    root = _fsdp(model)
    for i, group in enumerate(groups):
        group.set_modules_to_forward_prefetch([groups[j] for j in layout.forward_lists[i]])
        group.set_modules_to_backward_prefetch([groups[j] for j in layout.backward_lists[i]] or [group])
    root.set_modules_to_forward_prefetch([groups[j] for j in layout.root_forward])
    root.set_modules_to_backward_prefetch([groups[j] for j in layout.root_backward] or [root])

"""What the FSDP2 driver refuses, and what it reads but cannot use, decided before any module is sharded.

Config faults (one per field, each path relative to the config: ``policy.unmerged``) are collected here and raised
together with the plan's own faults by ``overlapcfg.fsdp2.layout``; ``overlapcfg.fully_shard`` names them where the
user put the config (``overlapcfg.config.boundary``). Misuse of the Python API (an
unknown ``fully_shard`` keyword, a model FSDP2 already manages) is a ``TypeError`` / ``RuntimeError``, raised
first: there is no config path to point at.

Settings the driver reads but that have no eager meaning are not errors (one config serves the compiled and the
eager path) but each becomes a note on the record: never silently dropped.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from overlapcfg.config import OverlapConfig, OverlapPolicy
from overlapcfg.config.boundary import SettingNote
from overlapcfg.errors import (
    Fault,
    OverlapConfigError,
    OverlapStateError,
    OverlapUsageError,
    closest_first,
    did_you_mean,
)

__all__ = ["NATIVE_REDUCE_SCATTER_DELAY", "check_config", "check_kwargs", "check_mesh", "check_unsharded",
           "ignored_settings", "shard_size"]

NATIVE_REDUCE_SCATTER_DELAY = 1
"""FSDP2's own reduce-scatter overlap, in the policy's terms. In post-backward a bucket issues its reduce-scatter
and moves on; the previous bucket's reduce-scatter is waited (its input buffer reused) just before this one is
issued, after this bucket's gradients were computed. So a reduce-scatter overlaps the next bucket's backward
compute, which is what ``reduce_scatter_delay: 1`` asks for (the compiled schedule also lets it overlap the next
reduce-scatter's issue). 0 (wait right after issue) and >= 2 have no FSDP2 knob per bucket."""

_WHY_NOT: dict[str, str] = {
    "auto": "it is torch's automatic scheduler for compiled graphs, and eager FSDP2 has no graph to reorder",
    "torch_manual": "it runs upstream's manual_overlap_bucketing graph pass, and eager FSDP2 runs no graph pass "
                    "(use 'manual': at depth 1 it asks FSDP2 for the same overlap)",
    "none": "it leaves a graph's collectives as traced, and here there is no graph; for FSDP2 without explicit "
            "prefetch call torch.distributed.fsdp.fully_shard yourself",
}

_RESERVED = ("module", "mesh")


def check_config(cfg: OverlapConfig) -> list[Fault]:
    """Faults of ``cfg`` the FSDP2 driver cannot honour: a strategy other than ``manual``, a reduce-scatter
    delay other than FSDP2's native one (policy, plan entry or override), no plan."""
    faults: list[Fault] = []
    if cfg.strategy != "manual":
        why = _WHY_NOT.get(cfg.strategy, "it is a graph strategy for compiled graphs, and eager FSDP2 runs none")
        faults.append(Fault("strategy", f"the FSDP2 driver (overlapcfg.fully_shard) runs strategy 'manual' only, "
                                        f"got {cfg.strategy!r}: {why}"))
        return faults  # the policy belongs to that strategy; judging its fields would only add noise
    if cfg.plan is None:
        faults.append(Fault("plan", "the FSDP2 driver needs a plan: a preset name or a mapping with 'buckets'"))
    no_delay = (f"FSDP2 has no per-bucket reduce-scatter delay: each bucket's reduce-scatter overlaps the next "
                f"bucket's backward compute, which is reduce_scatter_delay {NATIVE_REDUCE_SCATTER_DELAY}; got {{got}}. "
                f"Use {NATIVE_REDUCE_SCATTER_DELAY} (or leave it unset) with overlapcfg.fully_shard")
    # FSDP2's HSDP all-reduce runs right after its reduce-scatter inside post-backward: no knob to delay it.
    no_all_reduce_delay = ("FSDP2 issues an HSDP bucket's all-reduce right after its reduce-scatter, with no "
                           "per-bucket delay; got {got}. Leave all_reduce_delay unset with overlapcfg.fully_shard")
    if isinstance(cfg.policy, OverlapPolicy) and cfg.policy.unmerged:
        faults.append(Fault("policy.unmerged", f"FSDP2 gathers and reduces a bucket's parameters in one collective "
                                               f"each (fully_shard of the bucket's modules): it cannot leave "
                                               f"{list(cfg.policy.unmerged)} unmerged. Leave unmerged empty with "
                                               "overlapcfg.fully_shard"))
    for setting in cfg.settings("reduce_scatter_delay", "all_reduce_delay"):
        if setting.key == "all_reduce_delay":
            faults.append(Fault(setting.path(), no_all_reduce_delay.format(got=setting.value)))
        elif setting.value != NATIVE_REDUCE_SCATTER_DELAY:
            faults.append(Fault(setting.path(), no_delay.format(got=setting.value)))
    return faults


def ignored_settings(cfg: OverlapConfig) -> tuple[SettingNote, ...]:
    """Compiled-graph settings that mean nothing to eager FSDP2, set away from their defaults: one note each."""
    notes = []
    if isinstance(cfg.policy, OverlapPolicy):
        if cfg.policy.insert_overlap_deps:
            notes.append(SettingNote("policy.insert_overlap_deps", " is ignored: it orders a compiled graph for "
                                     "inductor; FSDP2 issues its collectives from module hooks"))
        if cfg.policy.issue_order != OverlapPolicy.model_fields["issue_order"].default:
            notes.append(SettingNote("policy.issue_order", f"={cfg.policy.issue_order!r} is ignored: it orders "
                                     "collectives in a compiled graph; FSDP2 issues all-gathers and reduce-scatters "
                                     "on streams of its own"))
        if cfg.policy.bucket_mode != OverlapPolicy.model_fields["bucket_mode"].default:
            notes.append(SettingNote("policy.bucket_mode", f"={cfg.policy.bucket_mode!r} is ignored: FSDP2 merges a "
                                     "bucket's parameters into one all-gather itself (fully_shard of the bucket's "
                                     "modules)"))
    return tuple(notes)


def check_kwargs(kwargs: Mapping[str, Any]) -> None:
    """``TypeError`` for a keyword ``torch.distributed.fsdp.fully_shard`` does not take, before anything is sharded
    (torch would only say so at the first call, possibly after an earlier bucket was sharded)."""
    accepted = [name for name in inspect.signature(torch_fully_shard).parameters if name not in _RESERVED]
    for name in kwargs:
        if name in _RESERVED:
            raise OverlapUsageError(
                f"overlapcfg.fully_shard: {name!r} is not a pass-through keyword; the model is the first "
                "argument and mesh= is overlapcfg.fully_shard's own keyword")
        if name not in accepted:
            raise OverlapUsageError(
                f"overlapcfg.fully_shard got an unexpected keyword {name!r}{did_you_mean(name, accepted)};"
                f" torch.distributed.fsdp.fully_shard takes: {', '.join(closest_first(name, accepted))}")


def check_unsharded(model: nn.Module) -> None:
    """``RuntimeError`` if FSDP2 already manages a module of ``model``: the driver applies FSDP2 itself, and FSDP2
    cannot be applied to a module twice or regroup modules that already have a state."""
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"module {name!r}" if name else "the model itself"
            raise OverlapStateError(
                f"overlapcfg.fully_shard: {where} is already sharded with FSDP2; pass the unsharded "
                "model (the driver calls torch's fully_shard on every bucket and on the root)")


def check_mesh(mesh: object, kwargs: Mapping[str, Any]) -> None:
    """``TypeError`` / ``ValueError`` for a mesh FSDP2 would refuse, before anything is sharded.

    FSDP2 takes a 1-D mesh (FSDP), a 2-D mesh with named dims (HSDP: replicate, shard), or any mesh together with
    ``dp_mesh_dims`` naming its data-parallel dims. A 3-D mesh (say data parallel x tensor parallel) is the
    common mistake: it is the sub-mesh of the data-parallel dims that FSDP2 wants.
    """
    if mesh is None:
        return
    if not isinstance(mesh, DeviceMesh):
        raise OverlapUsageError(f"overlapcfg.fully_shard: mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if kwargs.get("dp_mesh_dims") is not None:
        return  # torch checks the names against the mesh; shard_size reads them
    names = mesh.mesh_dim_names
    shape = " x ".join(f"{n}={s}" if names else str(s) for n, s in zip(names or [""] * mesh.ndim, mesh.shape,
                                                                       strict=True))
    if mesh.ndim > 2:
        dp = [n for n in names or () if n.startswith("dp")]
        example = f'mesh["{dp[0]}"]' if len(dp) == 1 else (
            "mesh[" + ", ".join(f'"{n}"' for n in dp) + "]" if dp else 'mesh["dp"]')
        raise OverlapConfigError(
            f"overlapcfg.fully_shard: mesh has {mesh.ndim} dims ({shape}); FSDP2 shards over a 1-D mesh "
            f"(FSDP) or a 2-D one (HSDP: replicate, shard). Pass the data-parallel sub-mesh ({example}), "
            "or the whole mesh with dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)")
    if mesh.ndim == 2 and names is None:
        raise OverlapConfigError(
            f"overlapcfg.fully_shard: a 2-D mesh ({shape}) is HSDP, and FSDP2 needs its dims named: "
            'init_device_mesh(..., mesh_dim_names=("replicate", "shard"))')


def shard_size(mesh: DeviceMesh | None, kwargs: Mapping[str, Any]) -> int | None:
    """Ranks a parameter is sharded over: the mesh's shard dims (``dp_mesh_dims.shard``, else its last dim: HSDP is
    ``(replicate, shard)``), else the default group's size; None if no group exists yet (torch will say so at the
    first ``fully_shard``)."""
    dims = kwargs.get("dp_mesh_dims")
    if mesh is not None and dims is not None:
        size = 1
        for name in dims.shard_names:
            names = mesh.mesh_dim_names or ()
            size *= mesh.size(names.index(name)) if name in names else 1
        return size
    if mesh is not None:
        return mesh.size(mesh.ndim - 1)
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None

"""Private ``torch.distributed`` pieces: the communication-free "fake" process group (``torch.testing._internal``)
and DTensor's caches it clears, process group lookups by name, the default group's c10d store (what the
same-schedule check exchanges through), the functional collectives' ops (what our graphs hold, and the demo's
SimpleFSDP sharding) as each release names them, and FSDP2's state registry.

Like ``overlapcfg.compat._torch``, reached as ``overlapcfg.compat.<name>``; nothing else imports them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from datetime import timedelta

import torch as _torch
import torch.distributed as dist

# --- fake process group (testing._internal) -------------------------------------------------------------------
# Importing fake_pg registers the "fake" backend with torch.distributed as a side effect.
from torch.testing._internal.distributed.fake_pg import FakeStore

from overlapcfg.errors import OverlapConfigError, OverlapStateError

__all__ = ["FakeStore", "fake_process_group", "forget_dtensor_caches"]

# --- DTensor's caches ------------------------------------------------------------------------------------------
# DTensor memoizes sharding propagation (a Python lru_cache and a C++ fast path) and redistribution plans, keyed by
# ``DeviceMesh`` *equality*: same ranks, layout, dimension names and thread; not the process groups, not the object.
# The cached results hold the mesh object they were computed with. A mesh built again in a later process group
# (another fake group of the same size, one trace after another) equals the first, so ops on its DTensors get specs
# carrying the *first* mesh, a mesh of a group that no longer exists: tensor-parallel parameters of the second
# model end up on the old mesh, dynamo then sees two distinct meshes where the model has one (an extra graph input;
# sequence-parallel activations on both meshes mis-shaped), and what a capture sees depends on what the process
# traced before. Nothing in torch clears these caches when a group is destroyed.
from torch.distributed.tensor import _redistribute as _dtensor_redistribute
from torch.distributed.tensor import debug as _dtensor_debug


def forget_dtensor_caches() -> None:
    """Clear DTensor's sharding-propagation and redistribution caches (see above): every DTensor op after this
    computes its output placements afresh, on the meshes it is given. Only a cost (the caches refill), never a
    change of results. ``fake_process_group`` calls it when a group opens and when it closes."""
    _dtensor_debug._clear_sharding_prop_cache()
    clear_planner = getattr(_dtensor_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planner is not None:
        clear_planner()
    transform_infos = getattr(_dtensor_redistribute, "_gen_transform_infos", None)
    if transform_infos is not None and hasattr(transform_infos, "cache_clear"):
        transform_infos.cache_clear()


@contextlib.contextmanager
def fake_process_group(world_size: int = 2, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Init the default process group with the communication-free "fake" backend; destroy it on exit.

    One CPU process can then trace (and even run) graphs with real ``_c10d_functional`` collectives as rank
    ``rank`` of ``world_size``: the fake backend returns without communicating, so values are garbage but shapes,
    dtypes and group names are those of a real run. Safe to enter repeatedly in one process (the group name stays
    "0"): DTensor's caches, which would carry device meshes from one group to the next, are cleared on entry and
    on exit (``forget_dtensor_caches``). Refuses to replace a default group someone else initialized.
    """
    if not 0 <= rank < world_size:
        raise OverlapConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if dist.is_initialized():
        raise OverlapStateError("fake_process_group: a default process group is already initialized; destroy it first")
    # init_process_group installs a ``[rankN]:``-prefixing sys.excepthook that destroy_process_group keeps:
    # every later uncaught exception in the caller's process would carry it. Restore what was there.
    excepthook = sys.excepthook
    forget_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        if group is None:
            raise AssertionError("fake_process_group: init_process_group left no default group")
        yield group
    finally:
        dist.destroy_process_group()
        forget_dtensor_caches()
        sys.excepthook = excepthook


def process_group_initialized() -> bool:
    """Whether a default process group exists (``apply`` needs one to merge: the rank is written into graphs)."""
    return dist.is_initialized()


def registered_group_size(name: str) -> int | None:
    """Size of the process group registered under ``name`` in this process; ``None`` if there is none (a graph
    read after its process group is gone, or on another machine): graphs state all-reduce groups by name only."""
    if not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return int(_resolve_process_group(name).size())  # type: ignore[arg-type]  # torch's GroupName: a str
    except (KeyError, ValueError, RuntimeError):  # unknown name: c10d raises one of these depending on version
        return None


def rank_in_group(name: str) -> int:
    """This process's rank in the process group registered under ``name`` (a merged all-gather copies its shard
    in at this rank's slot)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return int(dist.get_rank(_resolve_process_group(name)))  # type: ignore[arg-type]  # GroupName: a str


def group_ranks(name: str) -> tuple[int, ...] | None:
    """Global ranks of the process group registered under ``name`` in this process, in rank order; None where no
    group of that name is registered (a graph read after its group is gone, a compile-on-one-rank graph's group
    input)."""
    if not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(name)  # type: ignore[arg-type]  # torch's GroupName: a str
    except (KeyError, ValueError, RuntimeError):  # unknown name: c10d raises one of these depending on version
        return None
    return tuple(sorted(int(r) for r in dist.get_process_group_ranks(group)))


def default_store() -> dist.Store | None:
    """The store the default process group was built with (the rendezvous ``TCPStore`` under ``torchrun``, prefixed
    for the default group); None without a default group. What the same-schedule check exchanges through."""
    if not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def store_timeout(store: dist.Store) -> timedelta:
    """How long ``store``'s own waits last (``init_process_group(timeout=...)`` sets the default store's)."""
    return store.timeout  # type: ignore[attr-defined]  # a property at runtime, absent from the stubs


__all__ += ["default_store", "group_ranks", "process_group_initialized", "rank_in_group", "registered_group_size",
            "store_timeout"]

# --- functional collectives (the ops our graphs hold, and the demo's SimpleFSDP sharding) ------------------------
import torch.distributed._functional_collectives as functional_collectives  # noqa: E402

_c10d_functional = _torch.ops._c10d_functional
WAIT_TENSOR = _c10d_functional.wait_tensor.default
ALL_GATHER_INTO_TENSOR = _c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER_TENSOR = _c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = _c10d_functional.all_reduce.default

__all__ += ["ALL_GATHER_INTO_TENSOR", "ALL_REDUCE", "REDUCE_SCATTER_TENSOR", "WAIT_TENSOR", "functional_collectives"]

# The all-gather of one tensor along dim 0, in both forms, as each supported release names them (probed once here):
# - functional (what SimpleFSDP's parametrization traces): ``all_gather_single`` since torch 2.13, where
#   ``all_gather_tensor`` became a deprecated alias (a ``FutureWarning`` outside compiled code); torch 2.11 has
#   only ``all_gather_tensor``. Both trace to ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``.
# - c10d (eager, into a given output): ``torch.distributed.all_gather_single`` since 2.13, which FSDP2 calls;
#   2.11 has only ``all_gather_into_tensor`` (same arguments, same result), and its FSDP2 calls that.
functional_all_gather = getattr(functional_collectives, "all_gather_single", None) or \
    functional_collectives.all_gather_tensor
"""``functional_all_gather(shard, gather_dim, group)``: the traceable all-gather (``_c10d_functional`` ops)."""
C10D_ALL_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
"""Name in ``torch.distributed`` of the eager all-gather into a tensor that this release's FSDP2 calls."""
c10d_all_gather = getattr(dist, C10D_ALL_GATHER_NAME)
"""``c10d_all_gather(output, input, group=None)``: the eager all-gather into ``output`` (``C10D_ALL_GATHER_NAME``)."""

__all__ += ["C10D_ALL_GATHER_NAME", "c10d_all_gather", "functional_all_gather"]

# --- verify: the other collective overloads the verifier interprets (overlapcfg.graph.provenance) ---------------
# ``_c10d_functional`` ops that merged buckets use besides the plain ones above: the ``out=`` all-gather of torch's
# bucket modes and the coalesced forms of ``bucket_mode="coalesced"``.
ALL_GATHER_INTO_TENSOR_OUT = _torch.ops._c10d_functional.all_gather_into_tensor_out.default
ALL_GATHER_INTO_TENSOR_COALESCED = _torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default
REDUCE_SCATTER_TENSOR_COALESCED = _torch.ops._c10d_functional.reduce_scatter_tensor_coalesced.default

__all__ += ["ALL_GATHER_INTO_TENSOR_COALESCED", "ALL_GATHER_INTO_TENSOR_OUT", "REDUCE_SCATTER_TENSOR_COALESCED"]


# --- FSDP2 rollback (overlapcfg.fsdp2.rollback) ---------------------------------------------------------------
# ``fully_shard`` records each module's state in a private module-level registry besides the module's own
# ``__dict__``; a module whose sharding is rolled back must leave it, or a later ``fully_shard`` of that module
# fails ("Inserting ... more than once", or "State has already been garbage collected").
from torch.distributed import _composable_state  # noqa: E402


def forget_module_states(modules: list[_torch.nn.Module]) -> None:
    """Drop ``modules`` from torch's composable-API state registry (what ``fully_shard`` inserted)."""
    mapping = _composable_state._module_state_mapping
    for module in modules:
        mapping.pop(module, None)


__all__ += ["forget_module_states"]

"""The FSDP2 sharding layout: which modules each ``fully_shard`` call groups, with which ``reshard_after_forward``,
and whom each group prefetches. Derived from the config and the module tree alone; nothing is sharded here.

Every fault is collected and raised as one ``RelativeConfigError`` (the plan's own faults from
``overlapcfg.resolve`` included; paths from the config node, which ``overlapcfg.fully_shard`` names where the user
put the config), so a config that fails here leaves the model exactly as it was.

Prefetch lists follow the order buckets start computing, in each direction. FSDP2 takes the lists before any
forward has run, so the order is read from ``model.named_modules()`` (registration order), which is the order a
transformer stack runs its modules in (embedding, blocks, norm, head):

- forward: a bucket starts at its first module (FSDP2 all-gathers a group at the first of its modules to run);
- backward: a bucket starts where its *last* module's forward ended (autograd runs backward in reverse), so
  backward is the reverse of forward only for buckets whose modules run together. A tied embedding and head,
  ``[transformer.wte, lm_head]``, is first in forward *and* first in backward (``lm_head`` ran last), and FSDP2
  keeps it gathered from ``wte``'s forward to ``lm_head``'s and from ``lm_head``'s backward to the end::

      forward:   wte+lm_head  wpe  h.0  h.1  ln_f          (each bucket at its first module)
      backward:  wte+lm_head  ln_f  h.1  h.0  wpe          (each bucket at its last module, reversed)

The record lists both orders and says which buckets run apart.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from overlapcfg.config import Bucket, OverlapConfig, OverlapPolicy
from overlapcfg.config.boundary import RelativeConfigError, SettingNote
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.fsdp2.checks import check_config, ignored_settings
from overlapcfg.fsdp2.prefetch import DirectionPlan, plan_direction
from overlapcfg.fsdp2.tree import ModuleTree, ParamInfo, module_tree, param_info
from overlapcfg.module_paths import ModelFacts
from overlapcfg.resolve import ResolvedBucket, ResolvedPlan, resolve_config

__all__ = ["LayoutBucket", "ShardLayout", "plan_layout", "reordered", "reshards"]

logger = logging.getLogger(__name__)

HEADER = "the config cannot drive FSDP2 on this model"


@dataclass(frozen=True, slots=True)
class LayoutBucket:
    """One ``fully_shard`` call: a resolved bucket, its modules and parameters, its ``reshard_after_forward``."""

    resolved: ResolvedBucket
    modules: tuple[nn.Module, ...]
    reshard_after_forward: bool | int | None
    """Passed to ``fully_shard`` for this bucket; None: not passed (FSDP2's default, true for a non-root)."""
    reshard_origin: str
    """Where the value came from: the plan entry's path (``plan.buckets[1].reshard_after_forward``),
    ``fully_shard(reshard_after_forward=...)`` or ``FSDP2 default``."""
    params: tuple[ParamInfo, ...]

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def unsharded_bytes(self) -> int:
        return sum(p.unsharded_bytes for p in self.params)


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Everything ``overlapcfg.fully_shard`` does, decided up front. Bucket indices refer to ``buckets``."""

    buckets: tuple[LayoutBucket, ...]
    """In registration order of their first modules (see the module docstring); ``chain`` is the order used."""
    root_params: tuple[ParamInfo, ...]
    """Parameters in no bucket: the root's ``fully_shard`` groups them."""
    uncovered: tuple[str, ...]
    """Modules owning parameters that no bucket holds (``ResolvedPlan.uncovered``)."""
    chain: tuple[int, ...]
    """Buckets that have parameters (a bucket without any has no all-gather to prefetch), forward order."""
    backward_chain: tuple[int, ...]
    """The same buckets in the order backward reaches them (see the module docstring)."""
    forward: DirectionPlan
    """Positions are indices into ``chain``."""
    backward: DirectionPlan
    """Positions are indices into ``backward_chain``."""
    forward_lists: tuple[tuple[int, ...], ...]
    """Per bucket, the buckets it prefetches in forward (``set_modules_to_forward_prefetch``)."""
    backward_lists: tuple[tuple[int, ...], ...]
    """Per bucket, the buckets it prefetches in backward; empty means none (see ``overlapcfg.fsdp2.shard``)."""
    root_forward: tuple[int, ...]
    """What the root prefetches in its pre-forward: the first bucket unless its forward depth is 0."""
    root_backward: tuple[int, ...]
    """What the root prefetches in its pre-backward: the first bucket of backward unless its backward depth is 0."""
    shard_size: int | None
    max_inflight_bytes: int | None
    """The policy's cap the lists were planned under (kept to re-plan them for a measured order)."""
    notes: tuple[str | SettingNote, ...]
    """What the layout ignores or implies; a ``SettingNote`` names a setting from the config node (the record words
    it where the user put the config)."""
    order_notes: tuple[str, ...] = ()
    """What the bucket order implies (buckets running apart), and how it was established."""


def reshards(value: bool | int | None) -> bool:
    """Whether FSDP2 frees the unsharded parameters after forward (so backward all-gathers them again) for a
    non-root ``reshard_after_forward`` value: None (default) and True do; False and the int 1 (one rank) do not."""
    if value is None or value is True:
        return True
    return value is not False and value != 1


def plan_layout(model: nn.Module, cfg: OverlapConfig, *, shard_size: int | None,
                kwargs: Mapping[str, Any]) -> ShardLayout:
    """The layout for ``model`` (unchanged) under ``cfg``; ``RelativeConfigError`` lists every fault of the config
    (``OverlapConfigError`` for a pass-through keyword's).

    ``shard_size``: ranks each parameter is sharded over (None if unknown: int ``reshard_after_forward`` values
    are then left to torch). ``kwargs``: the pass-through ``fully_shard`` keywords.
    """
    faults = check_config(cfg)
    if cfg.strategy != "manual" or cfg.plan is None:  # nothing more can be judged without the manual plan
        raise RelativeConfigError(faults, header=HEADER)
    _check_default_reshard(kwargs.get("reshard_after_forward"), shard_size)
    tree = module_tree(model)
    policy = cfg.policy if isinstance(cfg.policy, OverlapPolicy) else OverlapPolicy()
    try:
        plan = resolve_config(cfg, ModelFacts(tree.fqns, tree.owners))
    except RelativeConfigError as err:
        raise RelativeConfigError([*err.faults, *faults], header=HEADER) from None
    ordered = sorted(plan.buckets, key=lambda b: min(tree.order[m] for m in b.modules))
    faults += _root_in_bucket(ordered)
    if cfg.strict and not ordered:
        faults.append(Fault("plan.buckets", "the plan has no buckets, so FSDP2 would shard the whole model as one "
                                            "group (strict is set)"))
    ignored = _ignored_params(kwargs)
    param_dtype = _param_dtype(kwargs)
    homes = _homes(tree, plan, ignored)
    faults += _shared_params(homes, ordered)
    faults += _containers(ordered, tree)
    faults += _scalars(homes)
    homes = _once(homes)
    buckets = []
    for b in ordered:
        value, origin, fault = _reshard(cfg, b, kwargs, shard_size)
        faults += fault
        params = tuple(param_info(owner, name, p, shard_size=shard_size, param_dtype=param_dtype)
                       for owner, name, p, home in homes if home is b)
        buckets.append(LayoutBucket(b, tuple(tree.modules[m] for m in b.modules),
                                    value, origin, params))
    if faults:  # one fault per place: an entry giving several buckets is wrong once
        raise RelativeConfigError(list(dict.fromkeys(faults)), header=HEADER)
    root_params = tuple(param_info(owner, name, p, shard_size=shard_size, param_dtype=param_dtype)
                        for owner, name, p, home in homes if home is None)
    starts = [min(tree.order[m] for m in b.resolved.modules) for b in buckets]
    ends = [max(tree.ends[m] for m in b.resolved.modules) for b in buckets]
    return _with_prefetch(buckets, root_params, plan.uncovered, shard_size, policy.max_inflight_bytes, starts, ends,
                          (*ignored_settings(cfg), *_notes(buckets, root_params)))


def reordered(layout: ShardLayout, starts: Sequence[int], ends: Sequence[int]) -> ShardLayout:
    """``layout`` with its prefetch planned for another order of the buckets (measured on the first forward:
    ``starts[i]`` / ``ends[i]`` are when bucket ``i``'s first / last module was called)."""
    return _with_prefetch(list(layout.buckets), layout.root_params, layout.uncovered, layout.shard_size,
                          layout.max_inflight_bytes, starts, ends, layout.notes)


def _with_prefetch(buckets: list[LayoutBucket], root_params: tuple[ParamInfo, ...], uncovered: tuple[str, ...],
                   shard_size: int | None, cap: int | None, starts: Sequence[int], ends: Sequence[int],
                   notes: tuple[str | SettingNote, ...]) -> ShardLayout:
    """Prefetch lists for buckets that start forward at ``starts`` and whose forward ends at ``ends`` (any
    consistent positions: registration order, or call order)."""
    chain = tuple(sorted((i for i, b in enumerate(buckets) if b.params), key=lambda i: starts[i]))
    back = tuple(sorted(chain, key=lambda i: -ends[i]))  # backward reaches a bucket where its forward ended
    fwd = plan_direction([buckets[i].name for i in chain], [buckets[i].resolved.forward_prefetch for i in chain],
                         [buckets[i].unsharded_bytes for i in chain], cap, "forward")
    bwd = plan_direction([buckets[i].name for i in back], [buckets[i].resolved.backward_prefetch for i in back],
                         [buckets[i].unsharded_bytes if reshards(buckets[i].reshard_after_forward) else 0
                          for i in back], cap, "backward")
    forward_lists: list[tuple[int, ...]] = [() for _ in buckets]
    backward_lists: list[tuple[int, ...]] = [() for _ in buckets]
    for p, targets in enumerate(fwd.lists):
        forward_lists[chain[p]] = tuple(chain[q] for q in targets)
    for p, targets in enumerate(bwd.lists):
        backward_lists[back[p]] = tuple(back[q] for q in targets)
    # The first bucket of each direction has no bucket before it to prefetch it: the root does, as the compiled
    # schedule issues it before the first compute, unless the bucket's own depth is 0.
    root_forward = chain[:1] if chain and buckets[chain[0]].resolved.forward_prefetch > 0 else ()
    root_backward = back[:1] if back and buckets[back[0]].resolved.backward_prefetch > 0 else ()
    return ShardLayout(tuple(buckets), root_params, uncovered, chain, back, fwd, bwd, tuple(forward_lists),
                       tuple(backward_lists), root_forward, root_backward, shard_size, cap, notes,
                       tuple(_apart(buckets, chain, starts, ends)))


def _apart(buckets: list[LayoutBucket], chain: tuple[int, ...], starts: Sequence[int],
           ends: Sequence[int]) -> list[str]:
    """A note for each bucket whose modules run apart, other buckets' forward in between (a tied embedding and
    head): FSDP2 keeps it gathered all that time, and backward reaches it before those buckets."""
    notes = []
    for p, i in enumerate(chain):
        if p + 1 == len(chain) or ends[i] < starts[chain[p + 1]]:  # ends before the next one starts: the usual case
            continue
        inside = [buckets[j].name for j in chain[p + 1:] if ends[j] < ends[i]]
        if inside:
            first, last = buckets[i].resolved.modules[0], buckets[i].resolved.modules[-1]
            shown = ", ".join(inside[:3]) + (f" ... ({len(inside)} buckets)" if len(inside) > 3 else "")
            notes.append(f"bucket {buckets[i].name!r} runs apart: {first} runs before and {last} after {shown}; "
                         f"FSDP2 keeps it gathered from {first}'s forward to {last}'s, and backward reaches it at "
                         f"{last}, before them: the backward prefetch order has it there")
    return notes


def _check_default_reshard(value: object, shard_size: int | None) -> None:
    """The pass-through ``reshard_after_forward`` is checked like a plan value, but it is API input: ``ValueError``."""
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1 or (shard_size is not None and shard_size % value):
        raise OverlapConfigError(
            f"overlapcfg.fully_shard: reshard_after_forward={value!r} must be a bool or an integer "
            f"that divides the shard world size ({shard_size})")


def _reshard(cfg: OverlapConfig, bucket: ResolvedBucket, kwargs: Mapping[str, Any],
             shard_size: int | None) -> tuple[bool | int | None, str, list[Fault]]:
    entry = cfg.plan.buckets[bucket.entry_index] if cfg.plan is not None else None
    path = f"plan.buckets[{bucket.entry_index}].reshard_after_forward"
    own = entry.reshard_after_forward if isinstance(entry, Bucket) else None
    if own is None:
        given = kwargs.get("reshard_after_forward")
        return given, "FSDP2 default" if given is None else "fully_shard(reshard_after_forward=...)", []
    faults = []
    if not isinstance(own, bool) and shard_size is not None and (own > shard_size or shard_size % own):
        faults.append(Fault(path, f"{own} does not divide the shard world size {shard_size}: FSDP2 reshards to "
                                  "groups of that many ranks (true: all of them, false: keep unsharded)"))
    return own, path, faults


def _root_in_bucket(buckets: list[ResolvedBucket]) -> list[Fault]:
    return [Fault(f"plan.buckets[{b.entry_index}]",
                  f"entry {b.entry_text} holds the root module, which the FSDP2 driver shards last for the parameters "
                  "no bucket holds; name the submodules instead")
            for b in buckets if "" in b.modules]


_Home = tuple[str, str, nn.Parameter, ResolvedBucket | None]


def _homes(tree: ModuleTree, plan: ResolvedPlan, ignored: set[nn.Parameter]) -> list[_Home]:
    """``(owner, name, parameter, bucket or None for the root)`` for every direct parameter, model order."""
    out: list[_Home] = []
    for owner, params in tree.direct.items():
        b = plan.bucket_of(owner)
        for name, p in params:
            if p not in ignored:
                out.append((owner, name, p, b))
    return out


def _once(homes: list[_Home]) -> list[_Home]:
    """Each parameter once, under its first name: tied parameters are one tensor to FSDP2 (and to byte counts)."""
    seen: set[nn.Parameter] = set()
    out = []
    for home in homes:
        if home[2] not in seen:
            seen.add(home[2])
            out.append(home)
    return out


def _shared_params(homes: list[_Home], ordered: list[ResolvedBucket]) -> list[Fault]:
    """A parameter reachable from two groups (tied weights): FSDP2 would fail at the first forward."""
    first: dict[nn.Parameter, tuple[str, ResolvedBucket | None]] = {}
    faults: list[Fault] = []
    for owner, name, p, b in homes:
        fqn = f"{owner}.{name}" if owner else name
        seen = first.setdefault(p, (fqn, b))
        if seen[1] is b:
            continue
        where = [x for x in (seen[1], b) if x is not None]
        path = f"plan.buckets[{where[-1].entry_index}]"
        groups = " and ".join(f"bucket {x.name!r}" if x is not None else "the root group" for x in (seen[1], b))
        faults.append(Fault(path, f"parameter {fqn!r} is the same tensor as {seen[0]!r} (tied), held by {groups}; "
                                  "FSDP2 shards a parameter in one group only: put both modules in one bucket "
                                  f"([{seen[0].rpartition('.')[0]}, {owner}])"))
    return faults


def _containers(buckets: list[ResolvedBucket], tree: ModuleTree) -> list[Fault]:
    """A ``ModuleList`` / ``ModuleDict`` without a ``forward`` of its own: FSDP2 hooks a group's modules' forward,
    and a container's is never called, so torch refuses it (at that bucket's ``fully_shard``, after deeper buckets
    were already sharded)."""
    faults = []
    for b in buckets:
        for fqn in b.modules:
            module = tree.modules[fqn]
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
                faults.append(Fault(f"plan.buckets[{b.entry_index}]",
                                    f"entry {b.entry_text} selects {fqn!r}, a {type(module).__name__} with no forward "
                                    f"of its own: FSDP2 hooks forward calls, and a container is never called; "
                                    f"select what it holds ({fqn}.*)"))
    return faults


def _scalars(homes: list[_Home]) -> list[Fault]:
    """0-dim parameters: FSDP2 shards along a dimension, a scalar has none (torch refuses it midway through a
    group, after the group's earlier parameters were replaced)."""
    faults = []
    for owner, name, p, b in homes:
        if p.dim() == 0:
            fqn = f"{owner}.{name}" if owner else name
            where = f"plan.buckets[{b.entry_index}]" if b is not None else "plan"
            group = f"bucket {b.name!r}" if b is not None else "the root group (no bucket holds it)"
            faults.append(Fault(where, f"parameter {fqn!r} in {group} is a 0-dim tensor, which FSDP2 cannot shard: "
                                       "give it shape (1,), or pass it in fully_shard(ignored_params=...)"))
    return faults


def _ignored_params(kwargs: Mapping[str, Any]) -> set[nn.Parameter]:
    return set(kwargs.get("ignored_params") or ())


def _param_dtype(kwargs: Mapping[str, Any]) -> torch.dtype | None:
    mp = kwargs.get("mp_policy")
    return mp.param_dtype if isinstance(mp, MixedPrecisionPolicy) else None


def _notes(buckets: list[LayoutBucket], root_params: tuple[ParamInfo, ...]) -> tuple[str, ...]:
    notes = [f"bucket {b.name!r} holds no parameters: it is sharded but has no all-gather to prefetch"
             for b in buckets if not b.params]
    if root_params:
        owners = list(dict.fromkeys(p.owner or "<root>" for p in root_params))
        shown = ", ".join(owners[:6]) + (f" ... ({len(owners)} modules)" if len(owners) > 6 else "")
        notes.append(f"{len(root_params)} parameter(s) in no bucket go to the root's group ({shown}): gathered at "
                     "the root's pre-forward and kept until backward ends")
    return tuple(notes)

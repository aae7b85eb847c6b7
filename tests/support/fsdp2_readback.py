"""What FSDP2 itself holds after sharding, read from the modules (not from overlapcfg's record): which modules each
``fully_shard`` call grouped and which groups each one prefetches, forward and backward.

Groups are named by the test from the modules they hold (``"norm+output"``, wrappers stripped), so a test compares
them with what the plan means, written out by hand, and separately with
``overlapcfg.fsdp2.read_record(model).forward_prefetch``.
FSDP2's state is private (``_fsdp_param_group``, ``_states_to_*_prefetch``): tests may read it, the package may not.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from overlapcfg.module_paths import strip_wrappers

ROOT = "<root>"


@dataclass(frozen=True)
class Fsdp2Layout:
    groups: dict[str, tuple[str, ...]]
    """Group name -> the FQNs of the parameters FSDP2 shards in it (the root's group: ``<root>``)."""
    forward: dict[str, tuple[str, ...]]
    """Group -> the groups it prefetches in forward (``set_modules_to_forward_prefetch``)."""
    backward: dict[str, tuple[str, ...]]
    """Group -> the groups it prefetches in backward; a group listing only itself (overlapcfg's way of switching
    off FSDP2's implicit prefetch) reads as ``()``."""


def read_fsdp2(model: nn.Module) -> Fsdp2Layout:
    names = {module: strip_wrappers(name) for name, module in reversed(list(model.named_modules()))}
    params = {p: strip_wrappers(name) for name, p in model.named_parameters()}
    states = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = torch_fully_shard.state(module)
            states.setdefault(state, module)

    def label(state: object) -> str:
        module = states[state]
        if module is model:
            return ROOT
        group = state._fsdp_param_group  # type: ignore[attr-defined]
        return "+".join(names[m] for m in group.modules) if group is not None else names[module]

    groups, forward, backward = {}, {}, {}
    for state in states:
        name = label(state)
        group = state._fsdp_param_group  # type: ignore[attr-defined]
        groups[name] = tuple(params[fp.sharded_param] for fp in group.fsdp_params) if group is not None else ()
        forward[name] = tuple(label(s) for s in state._states_to_forward_prefetch)  # type: ignore[attr-defined]
        back = tuple(label(s) for s in state._states_to_backward_prefetch)  # type: ignore[attr-defined]
        backward[name] = () if back == (name,) else back
    return Fsdp2Layout(groups, forward, backward)


def windows(order: list[str], depth: int) -> dict[str, tuple[str, ...]]:
    """Each group prefetching the next ``depth`` groups of ``order`` (what a uniform depth means), the root
    prefetching the first."""
    out = {name: tuple(order[i + 1:i + 1 + depth]) for i, name in enumerate(order)}
    out[ROOT] = tuple(order[:1]) if depth > 0 else ()
    return out


def record_lists(model: nn.Module) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """overlapcfg's record of the lists it handed FSDP2 (``overlapcfg.fsdp2.read_record``), bucket names as groups."""
    from overlapcfg.fsdp2 import read_record

    record = read_record(model)
    return dict(record.forward_prefetch), dict(record.backward_prefetch)

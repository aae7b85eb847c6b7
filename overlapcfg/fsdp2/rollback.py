"""Putting a model back as it was when ``fully_shard`` fails half-way.

``overlapcfg.fsdp2.layout`` refuses everything it can foresee before a module is sharded. What it cannot foresee
(a ``shard_placement_fn`` that raises, a parameter torch refuses for a reason of its own, running out of memory
while moving parameters to the mesh's device) fails inside torch's ``fully_shard`` for some bucket after others
were sharded, and even mid-bucket: FSDP2 replaces a group's parameters one by one before it changes the module's
class. So the driver takes a ``Snapshot`` first and restores it on any failure.

What FSDP2 changes on a module, and what the snapshot keeps to undo it: the module's class (``FSDP<Name>``), its
``__dict__`` entries (composable-API state and registry keys), the dicts inside it (``_parameters`` get DTensor
shards, the hook dicts get FSDP2's hooks), each parameter's and buffer's data (moved to the mesh's device), and an
entry in torch's private module-state registry (``overlapcfg.compat.forget_module_states``). Nothing is copied:
the snapshot holds references, so taking one costs a walk over the modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from overlapcfg import compat

__all__ = ["Snapshot"]


@dataclass(frozen=True, slots=True)
class _ModuleState:
    module: nn.Module
    cls: type
    attrs: dict[str, object]
    """The module's ``__dict__``, shallow."""
    dicts: dict[str, dict[object, object]]
    """Shallow copies of the dicts in ``__dict__`` (parameters, buffers, submodules, every hook dict)."""
    data: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """``(tensor, tensor.data)`` for the module's own parameters and buffers."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What ``restore`` needs to undo ``fully_shard`` calls on ``model`` (and only that model's modules)."""

    states: tuple[_ModuleState, ...]

    @classmethod
    def take(cls, model: nn.Module) -> Snapshot:
        states = []
        for module in model.modules():
            attrs = dict(vars(module))
            dicts = {k: dict(v) for k, v in attrs.items() if isinstance(v, dict)}
            own = [t for _, t in (*module.named_parameters(recurse=False, remove_duplicate=False),
                                  *module.named_buffers(recurse=False, remove_duplicate=False))]
            states.append(_ModuleState(module, type(module), attrs, dicts, tuple((t, t.data) for t in own)))
        return cls(tuple(states))

    def restore(self) -> None:
        """Every module back to its class, attributes, parameters, buffers and hooks; data back where it was."""
        for s in self.states:
            if type(s.module) is not s.cls:
                s.module.__class__ = s.cls
            now = vars(s.module)
            for key in [k for k in now if k not in s.attrs]:
                del now[key]
            for key, value in s.attrs.items():
                if now.get(key) is not value:
                    now[key] = value
                if key in s.dicts:  # the same dict object, refilled: hook handles hold it by reference
                    value.clear()  # type: ignore[attr-defined]
                    value.update(s.dicts[key])  # type: ignore[attr-defined]
            for tensor, data in s.data:
                if tensor.data.data_ptr() != data.data_ptr() or tensor.device != data.device:
                    tensor.data = data
        compat.forget_module_states([s.module for s in self.states])

"""The one place that touches private APIs: ``torch._*``, ``torch.ops._*``, ``torch.testing._internal`` and
OmegaConf internals. Everything else in overlapcfg reaches them through this package, so a torch or OmegaConf
upgrade that moves one of them breaks exactly one place, and each probe for a changed API runs once at import.

Two modules, split by what importing them costs: ``overlapcfg.compat.omegaconf`` (torch-free: the config layer
uses it) and ``overlapcfg.compat._torch`` (torch, dynamo, functorch and inductor pieces), whose names are
forwarded from this package lazily, so ``from overlapcfg import compat; compat.fake_process_group`` works and
``import overlapcfg.compat.omegaconf`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(importlib.import_module("overlapcfg.compat._torch"), name)
    globals()[name] = value
    return value

"""The one place that touches private APIs: ``torch._*``, ``torch.ops._*``, ``torch.testing._internal`` and
OmegaConf internals. Everything else in overlapcfg reaches them through this package, so a torch or OmegaConf
upgrade that moves one of them breaks exactly one place, and each probe for a changed API runs once at import.

Split by what importing them costs: ``overlapcfg.compat.omegaconf`` (torch-free: the config layer uses it), and,
forwarded from this package lazily, ``overlapcfg.compat._torch`` (dynamo, aot_autograd, op identity, graph copies),
``overlapcfg.compat._distributed`` (the fake process group, the functional collectives' ops),
``overlapcfg.compat._inductor`` (bucket copy-in ops, ordering wrappers, compiling), ``overlapcfg.compat._schedulers``
(upstream's overlap schedulers) and ``overlapcfg.compat._fake`` (fake tensors and tracing under a fake mode, for
the bucket merge): ``from overlapcfg import compat; compat.fake_process_group`` works and
``import overlapcfg.compat.omegaconf`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULES = ("overlapcfg.compat._torch", "overlapcfg.compat._distributed", "overlapcfg.compat._inductor",
            "overlapcfg.compat._schedulers", "overlapcfg.compat._fake")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    for module in _MODULES:
        found = importlib.import_module(module)
        if name in getattr(found, "__all__", ()) or (not name.startswith("_") and hasattr(found, name)):
            value = getattr(found, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'overlapcfg.compat' has no attribute {name!r}")


if TYPE_CHECKING:
    # The typed surface: what ``__getattr__`` forwards is each module's ``__all__``, and a type checker reads the
    # same lists here (each module's own annotations), so ``compat.fake_process_group`` is typed, not ``Any``, and a
    # name missing from an ``__all__`` is an error at its use. Star imports, so a name added to a module is typed
    # here without a second list to keep in step.
    from overlapcfg.compat._distributed import *  # noqa: F403
    from overlapcfg.compat._fake import *  # noqa: F403
    from overlapcfg.compat._inductor import *  # noqa: F403
    from overlapcfg.compat._schedulers import *  # noqa: F403
    from overlapcfg.compat._torch import *  # noqa: F403

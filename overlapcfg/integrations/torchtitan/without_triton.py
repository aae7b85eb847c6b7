"""Importing torchtitan's model code on a machine without triton, for ``--check`` only.

torchtitan 0.3's models import ``torchtitan.distributed.minimal_async_ep.kernels`` (through their MoE token
dispatcher), which imports triton at its top; triton comes with a CUDA build of torch, so on a CPU-only machine
``from torchtitan.models.llama3.config_registry import llama3_8b`` ends in ``ModuleNotFoundError: triton``. Those
kernels serve expert-parallel all-to-all alone: a dense model never calls them, and the FSDP2 integration refuses
expert parallelism and MoE blocks anyway. So ``--check`` imports the config module with a placeholder in that one
module's place: every name it is asked for is a function that raises, saying that it needs triton.

Scoped on purpose: the placeholder goes into ``sys.modules`` only where triton cannot be imported, and is removed
on exit (modules imported meanwhile keep their references to its functions, which raise if ever called). It is
for the check's own short-lived process, which exits after printing one line; the trainer itself needs a GPU and
never goes through here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from overlapcfg.errors import OverlapStateError

__all__ = ["TRITON_KERNELS", "without_triton"]

TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
"""The one torchtitan 0.3 module on the dense-model import path that imports triton."""


class _Placeholder(types.ModuleType):
    """Stands in for ``TRITON_KERNELS``: any attribute is a kernel that raises when called."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise OverlapStateError(f"{TRITON_KERNELS}.{name} needs triton (expert-parallel kernels, GPU machines "
                                    "only); overlapcfg imported torchtitan without it to check a config")

        return kernel


def _have_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:  # a finder that refuses it
        return False


@contextlib.contextmanager
def without_triton() -> Iterator[None]:
    """Inside: torchtitan's model code imports without triton (module docstring). Where triton exists, or the
    module is already imported, nothing changes."""
    if TRITON_KERNELS in sys.modules or _have_triton():
        yield
        return
    placeholder = _Placeholder(TRITON_KERNELS, "placeholder for triton kernels (overlapcfg --check, no triton)")
    sys.modules[TRITON_KERNELS] = placeholder
    try:
        yield
    finally:
        if sys.modules.get(TRITON_KERNELS) is placeholder:
            del sys.modules[TRITON_KERNELS]

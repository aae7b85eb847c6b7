"""The demo, on top of everything: a small Llama, its train-step tracing on meshes, the ``overlapcfg`` command and
the gloo harness. Nothing below this package imports it. The SimpleFSDP sharder it uses is public API in
``overlapcfg.capture`` (``overlapcfg.shard_module``).

Exports are lazy so the command validates its config before paying for torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "LLAMA3_8B": "overlapcfg.demo.llama",
    "Llama": "overlapcfg.demo.llama",
    "LlamaConfig": "overlapcfg.demo.llama",
    "cross_entropy_loss": "overlapcfg.demo.llama",
}

__all__ = ["LLAMA3_8B", "Llama", "LlamaConfig", "cross_entropy_loss"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:
    from overlapcfg.demo.llama import LLAMA3_8B, Llama, LlamaConfig, cross_entropy_loss

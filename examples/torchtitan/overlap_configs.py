"""torchtitan config functions whose FSDP2 grouping and prefetch come from an overlap config: torchtitan's main
trainer (``torchtitan.train``, eager FSDP2) with ``overlapcfg.integrations.torchtitan.fsdp2.use_overlapcfg``.

    OVERLAPCFG_CONFIG=aggressive PYTHONPATH=examples/torchtitan torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module overlap_configs --config llama3_8b_overlapcfg

``OVERLAPCFG_CONFIG`` unset: torchtitan's own grouping (``tok_embeddings``, each block, ``[norm, lm_head]``) at
prefetch depth 1; a policy preset name (``aggressive``: depth 2) on the same grouping; or a YAML file with a whole
config (``overlap.yaml`` beside this file). Everything else is torchtitan's: every ``--...`` flag works as with
``--module llama3``. torchtitan's trainer needs a GPU (it picks CUDA when no other accelerator is present).
"""

from __future__ import annotations

from typing import Any

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel

from overlapcfg.integrations.torchtitan.fsdp2 import use_overlapcfg  # overlapcfg


def llama3_debugmodel_overlapcfg() -> Any:
    """torchtitan's ``llama3_debugmodel`` (6 layers, dim 256), sharded by the overlap config."""
    return use_overlapcfg(llama3_debugmodel())  # overlapcfg


def llama3_8b_overlapcfg() -> Any:
    """torchtitan's ``llama3_8b``, sharded by the overlap config."""
    return use_overlapcfg(llama3_8b())  # overlapcfg

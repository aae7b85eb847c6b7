"""torchtitan config functions whose FSDP2 grouping and prefetch come from an overlap config: torchtitan's main
trainer (``torchtitan.train``, eager FSDP2) with ``overlapcfg.integrations.torchtitan.fsdp2.use_overlapcfg``.

    OVERLAPCFG_CONFIG=examples/torchtitan/overlap.yaml PYTHONPATH=examples/torchtitan torchrun --nproc-per-node 8 \\
        -m torchtitan.train --module overlap_configs --config llama3_8b_overlapcfg

``OVERLAPCFG_CONFIG`` unset: torchtitan's own grouping (``tok_embeddings``, each block, ``[norm, lm_head]``) at
prefetch depth 1; a policy preset the FSDP2 driver runs on the same grouping (``OVERLAPCFG_CONFIG=memory_saving``:
depth 1 under a 512 MiB cap; ``default``: depth 1); or a YAML file with a whole config (``overlap.yaml`` beside this
file: two groups prefetched ahead). ``aggressive`` and ``auto`` are refused on this path (FSDP2 has no per-bucket
reduce-scatter delay and no graph to schedule), naming the nearest preset it runs. Everything else is torchtitan's:
every ``--...`` flag works as with ``--module llama3``. torchtitan's trainer needs a GPU (it picks CUDA when no
other accelerator is present); on any machine, check the config against the model first (the model is built on
the meta device):

    OVERLAPCFG_CONFIG=examples/torchtitan/overlap.yaml PYTHONPATH=examples/torchtitan \\
        python -m overlapcfg.integrations.torchtitan --check --module overlap_configs --config llama3_8b_overlapcfg

torchtitan is imported inside the functions, not at the top: its model code imports triton kernels, which a
machine without a GPU lacks, and importing this module must not need them.
"""

from __future__ import annotations

from typing import Any

from overlapcfg.integrations.torchtitan.fsdp2 import use_overlapcfg  # overlapcfg


def llama3_debugmodel_overlapcfg() -> Any:
    """torchtitan's ``llama3_debugmodel`` (6 layers, dim 256), sharded by the overlap config."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return use_overlapcfg(llama3_debugmodel())  # overlapcfg


def llama3_8b_overlapcfg() -> Any:
    """torchtitan's ``llama3_8b``, sharded by the overlap config."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    return use_overlapcfg(llama3_8b())  # overlapcfg

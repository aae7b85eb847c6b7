"""Train a tiny Hugging Face Llama with accelerate's FSDP plugin (``fsdp_version: 2``), its FSDP2 groups and prefetch
lists from an overlap config (``overlapcfg.integrations.accelerate.fully_shard``).

On GPUs (every argument after the script is this script's)::

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate/train.py --steps 20

On CPU accelerate never turns FSDP on (it runs MULTI_CPU and drops the plugin), so ``--cpu`` sets the state it
built to FSDP2 before anything is prepared; everything after that is accelerate's own code::

    torchrun --nproc-per-node 2 examples/accelerate/train.py --cpu

``--own`` trains the same model with accelerate's own FSDP2 wrapping instead (``TRANSFORMER_BASED_WRAP``: a group
per decoder layer, the embedding, ``[norm, lm_head]``), the grouping ``llama_layers`` below asks for: the losses are
the same, bit for bit. The overlapcfg lines are marked ``# overlapcfg``. Needs ``transformers`` (nothing is
downloaded: the model is built from a config).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import overlapcfg
from overlapcfg.integrations.accelerate import fully_shard  # overlapcfg

CONFIG = {"plan": {"name": "hf_llama", "buckets": ["model.embed_tokens", "model.layers.*",
                                                   {"modules": ["model.norm", "lm_head"],
                                                    "reshard_after_forward": False}],
                   "require_full_coverage": True},
          "policy": {"forward_prefetch": 2, "backward_prefetch": 2}}
"""accelerate's own grouping (its tail ``[norm, lm_head]`` stays unsharded after forward, as accelerate does), with
two groups in flight instead of FSDP2's implicit prefetch."""

VOCAB, BATCH, SEQ_LEN = 128, 2, 16


def tiny_llama() -> torch.nn.Module:
    """``LlamaForCausalLM``: 4 layers, hidden 64, 4 heads / 2 KV heads, vocab 128, untied head; seeded."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def accelerator(*, own: bool, cpu: bool) -> Accelerator:
    """Under ``accelerate launch`` the launch config's FSDP plugin (``fsdp2.yaml``: no wrapping policy of
    accelerate's, the plan wraps). ``--own``: accelerate's transformer-layer wrapping; ``--cpu``: the plugin made
    here, and the state set to FSDP2."""
    if not (own or cpu):
        return Accelerator()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                            auto_wrap_policy="transformer_based_wrap" if own else "no_wrap")
    acc = Accelerator(fsdp_plugin=plugin, cpu=cpu)
    if cpu:
        # accelerate 1.15 enables FSDP for accelerator devices only (state.py); on CPU it builds a MULTI_CPU state
        # without the plugin. Set both as it would on a GPU; prepare() then runs its FSDP2 path unchanged.
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    return acc


def train(cfg: Any, *, steps: int, own: bool = False, cpu: bool = False) -> tuple[list[float], torch.nn.Module]:
    acc = accelerator(own=own, cpu=cpu)
    model = tiny_llama()
    if not own:
        model = fully_shard(acc, model, cfg)  # overlapcfg: before the optimizer and prepare()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * acc.process_index + step)  # each rank's own data
        ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen).to(acc.device)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config", type=Path, help="an overlap config YAML file (default: CONFIG above)")
    parser.add_argument("--cpu", action="store_true", help="run accelerate's FSDP2 path on CPU (gloo)")
    parser.add_argument("--own", action="store_true", help="accelerate's own FSDP2 wrapping, for comparison")
    args = parser.parse_args(argv)
    cfg = overlapcfg.load_config(args.config or CONFIG)
    losses, model = train(cfg, steps=args.steps, own=args.own, cpu=args.cpu)
    acc = Accelerator()
    if acc.is_main_process:
        print("losses:", " ".join(f"{loss:.6f}" for loss in losses))
        if not args.own:
            print(overlapcfg.explain(acc.unwrap_model(model), cfg))
    acc.wait_for_everyone()
    if args.cpu:
        overlapcfg.exit_process()  # FSDP2 keeps gloo's threads alive past teardown (see README, "Eager FSDP2")


if __name__ == "__main__":
    main()

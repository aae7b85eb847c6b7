"""``python -m overlapcfg.integrations.torchtitan ARGS``: torchtitan's trainer (``torchtitan.train``) with the
``overlapcfg`` pass pipeline registered on every rank. ``ARGS`` are torchtitan's (``--module``, ``--config``,
``--compile.*``, ...); without a ``--compile.pass_pipeline`` of their own, ``--compile.pass_pipeline overlapcfg`` is
added, so the entry point never runs a step without the pipeline it exists for.

Two arguments are the entry point's own: ``--help`` says what it does, what it needs and what runs without a GPU
before torchtitan lists its options (where its trainer can be imported), and ``--check`` validates the config
``OVERLAPCFG_CONFIG`` names, on any machine. Where torchtitan's trainer cannot be imported (a CPU-only machine
lacks triton; a ``--no-deps`` install lacks tensorboard or datasets), the entry point says what is missing and
what to install instead of ending on torchtitan's own ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from overlapcfg.errors import OverlapConfigError

_FLAGS = ("--compile.pass_pipeline", "--compile.pass-pipeline")
INSTALL = "pip install 'overlapcfg[torchtitan]'"
"""What brings torchtitan 0.3.0 and the pure-Python packages its trainer imports, pinned, with no torch."""
TRAINER = "torchtitan.train"

USAGE = f"""\
usage: [OVERLAPCFG_CONFIG=<preset or file>] torchrun --nproc-per-node N -m overlapcfg.integrations.torchtitan \\
           --module graph_trainer.llama3 --config graph_trainer_llama3_8b [torchtitan's arguments]
       python -m overlapcfg.integrations.torchtitan --check

torchtitan's graph trainer with overlapcfg's pass pipeline registered on every rank: torchtitan's default passes,
its joint bucketing pass replaced by overlapcfg.apply on the whole-step graph. --compile.pass_pipeline overlapcfg
is added unless the arguments name a pipeline.

OVERLAPCFG_CONFIG: unset = torchtitan's own buckets at depth 1; a policy preset (aggressive, memory_saving,
default, auto) with torchtitan's buckets; else a YAML file holding a whole overlap config.

--check   validate OVERLAPCFG_CONFIG (preset names, fields, pattern syntax) and exit; runs without a GPU. The plan's
          patterns are matched against the model's modules when the trainer starts, before tracing.

Needs: {INSTALL} (torchtitan 0.3.0 and what its trainer imports, pinned, no torch).
Without a GPU: torchtitan 0.3's trainer imports triton kernels and trains on a CUDA device, so it does not start
on a CPU-only machine. What runs there: --check; and overlapcfg.apply(gm, cfg, graph_kind="joint"), explain,
compare and tune on graph-trainer graphs captured on CPU (README "torchtitan graph trainer").
"""

_PURE_PYTHON = ("tensorboard", "datasets", "einops", "tyro", "torchdata", "spmd_types", "docstring_parser",
                "typeguard", "torch_checkpointing", "wandb", "tokenizers", "safetensors", "PIL")
"""Modules torchtitan's trainer imports that ``overlapcfg[torchtitan]`` installs (or torchtitan itself declares)."""


def with_pipeline(args: Sequence[str]) -> list[str]:
    """``args`` with ``--compile.pass_pipeline overlapcfg`` appended unless a pipeline is already named."""
    named = any(a in _FLAGS or a.startswith(tuple(f"{f}=" for f in _FLAGS)) for a in args)
    return list(args) if named else [*args, _FLAGS[0], "overlapcfg"]


def trainer_problem() -> str | None:
    """Why torchtitan's trainer cannot be imported here, in words that say what to do; None where it can."""
    try:
        importlib.import_module(TRAINER)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if missing == "triton":
            return (f"torchtitan's trainer ({TRAINER}) imports triton (its MoE kernels, "
                    "torchtitan.distributed.minimal_async_ep.kernels), which comes with a CUDA build of torch; this "
                    "torch has none. The trainer runs on GPU machines; see 'Without a GPU' below.")
        if missing in _PURE_PYTHON:
            return f"torchtitan's trainer ({TRAINER}) imports {missing}, which is not installed: {INSTALL}"
        return f"torchtitan's trainer ({TRAINER}) cannot be imported: {err}. {INSTALL} installs what it declares."
    return None


def check() -> str:
    """``--check``: the config ``OVERLAPCFG_CONFIG`` selects, validated without the model (one line)."""
    from overlapcfg.integrations.torchtitan.source import describe_config

    return describe_config()


def _say(text: str) -> None:
    """The entry point's own output (help, --check): standard output, like torchtitan's help after it."""
    sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    import overlapcfg.integrations.torchtitan  # noqa: F401  (registers the pipeline)

    args = list(sys.argv[1:] if argv is None else argv)
    if "--check" in args:
        try:
            _say(check())
        except OverlapConfigError as err:
            sys.exit(str(err))
        return
    helping = "--help" in args or "-h" in args
    if helping:
        _say(USAGE)
    problem = trainer_problem()
    if problem is not None:
        if helping:
            _say(f"torchtitan's own options are not listed here: {problem}")
            return
        sys.exit(f"{problem}\n\n{USAGE}")
    sys.argv = [sys.argv[0], *with_pipeline(args)]  # torchtitan's ConfigManager parses sys.argv
    from torchtitan.train import main as train

    if helping:
        _say("torchtitan's options:")
    train()


if __name__ == "__main__":
    main()

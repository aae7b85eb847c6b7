"""``python -m overlapcfg.integrations.torchtitan ARGS``: torchtitan's trainer (``torchtitan.train``) with the
``overlapcfg`` pass pipeline registered on every rank. ``ARGS`` are torchtitan's (``--module``, ``--config``,
``--compile.*``, ...); without a ``--compile.pass_pipeline`` of their own, ``--compile.pass_pipeline overlapcfg`` is
added, so the entry point never runs a step without the pipeline it exists for.

Two arguments are the entry point's own: ``--help`` says what it does, what it needs and what runs without a GPU
before torchtitan lists its options (where its trainer can be imported), and ``--check`` validates the config
``OVERLAPCFG_CONFIG`` names, on any machine. ``--check --module M --config C [overrides]`` checks a config module for
torchtitan's main trainer (``use_overlapcfg``, eager FSDP2) the way the trainer will before its first step: the
config function's model is built on the meta device and every fault of the config against it is reported
(``fsdp2.check_trainer_config``; torchtitan's model code imported without triton: ``without_triton``). Where
torchtitan's trainer cannot be imported (a CPU-only machine lacks triton; a ``--no-deps`` install lacks tensorboard
or datasets), the entry point says what is missing and what to install instead of ending on torchtitan's own
``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from overlapcfg.errors import OverlapConfigError, OverlapStateError, OverlapUsageError

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
--check --module M --config C [torchtitan's overrides]
          torchtitan's main trainer (a config function returning use_overlapcfg(...)): check OVERLAPCFG_CONFIG
          against that config's model, built on the meta device, as the trainer will before its first step;
          runs without a GPU. Presets the FSDP2 driver runs: default, memory_saving.

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


def check(args: Sequence[str] = ()) -> str:
    """``--check``: the config ``OVERLAPCFG_CONFIG`` selects, validated without the model (one line). With
    ``--module``/``--config`` among ``args`` (torchtitan's main trainer), validated against that config's model."""
    rest = [a for a in args if a != "--check"]
    if not any(a == "--module" or a.startswith("--module=") for a in rest):
        from overlapcfg.integrations.torchtitan.source import describe_config

        return describe_config()
    from overlapcfg.integrations.torchtitan.fsdp2 import check_trainer_config
    from overlapcfg.integrations.torchtitan.without_triton import without_triton

    with without_triton():
        from torchtitan.config import ConfigManager

        try:
            config = ConfigManager().parse_args(rest)  # torchtitan's reading of --module, --config and overrides
        except ImportError as err:  # torchtitan may say only that the module did not import: find out why
            raise OverlapStateError(_import_problem(err, rest)) from None
    return check_trainer_config(config)


def _import_problem(err: ImportError, args: Sequence[str]) -> str:
    """Why the config module of ``args`` (``--module``) or its config function did not import, in words that say
    what to do: a package ``overlapcfg[torchtitan]`` installs, or the module not on the path."""
    name = next((b for a, b in zip(args, [*args[1:], ""], strict=True) if a == "--module"), None) or next(
        (a.split("=", 1)[1] for a in args if a.startswith("--module=")), "")
    found: list[ImportError] = [err]
    if not isinstance(err, ModuleNotFoundError):  # torchtitan's own "cannot import": import it here to see why
        for candidate in (f"{name}.config_registry", name):
            try:
                importlib.import_module(candidate)
                break
            except ImportError as again:
                found.append(again)
    for problem in found[::-1]:
        missing = (getattr(problem, "name", None) or "").split(".")[0]
        if missing in _PURE_PYTHON:
            return f"--module {name} imports {missing} (through torchtitan), which is not installed: {INSTALL}"
        if isinstance(problem, ModuleNotFoundError) and missing and missing != name.split(".")[0]:
            return f"--module {name} cannot be imported: {problem}"
    return (f"--module {name} cannot be imported ({err}); the directory holding your config module goes on "
            "PYTHONPATH")


def _say(text: str) -> None:
    """The entry point's own output (help, --check): standard output, like torchtitan's help after it."""
    sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    import overlapcfg.integrations.torchtitan  # noqa: F401  (registers the pipeline)

    args = list(sys.argv[1:] if argv is None else argv)
    if "--check" in args:
        try:
            _say(check(args))
        except (OverlapConfigError, OverlapUsageError, OverlapStateError) as err:
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

"""overlapcfg as a pass pipeline of torchtitan's graph trainer: importing this module registers it.

Run torchtitan's trainer through this package's entry point (it imports this module on every rank, then runs
``torchtitan.train``; every argument is torchtitan's)::

    OVERLAPCFG_CONFIG=overlap.yaml torchrun --nproc-per-node 8 -m overlapcfg.integrations.torchtitan \\
        --module graph_trainer.llama3 --config graph_trainer_llama3_8b --compile.pass_pipeline overlapcfg

or import ``overlapcfg.integrations.torchtitan`` from your own config module (``--module my_configs``) and run
``torchtitan.train`` as usual. ``compile.pass_pipeline=overlapcfg`` selects the pipeline (``pipeline``): torchtitan's
default passes with its joint bucketing pass replaced by ``overlapcfg.apply`` on the whole-step graph.
``OVERLAPCFG_CONFIG`` names the config (``source``: unset = torchtitan's own buckets at depth 1, a policy preset
name, or a YAML file). The post-init hook checks the trainer's settings and the config before anything is traced.

Registration goes through torchtitan's own decorators (``registry.register_pass_pipeline`` and
``register_post_init_hook``); a different function already registered under ``overlapcfg`` is an error naming it,
rather than overwritten silently.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from torchtitan.experiments.graph_trainer import registry as _registry

from overlapcfg.errors import OverlapStateError
from overlapcfg.integrations.torchtitan.pipeline import (
    PASS_NAME,
    PIPELINE_NAME,
    check_trainer,
    overlapcfg_bucketing_pass,
    overlapcfg_pipeline,
)
from overlapcfg.integrations.torchtitan.source import ENV_VAR, find_config, torchtitan_plan

__all__ = ["ENV_VAR", "PASS_NAME", "PIPELINE_NAME", "check_trainer", "find_config", "overlapcfg_bucketing_pass",
           "overlapcfg_pipeline", "register", "torchtitan_plan"]


def _register(table: MutableMapping[str, Callable[..., Any]], decorator: Callable[[str], Callable[..., Any]],
              fn: Callable[..., Any], what: str) -> None:
    existing = table.get(PIPELINE_NAME)
    if existing is not None and _origin(existing) != _origin(fn):
        raise OverlapStateError(f"torchtitan {what} {PIPELINE_NAME!r} is already registered by {_origin(existing)}; "
                                f"overlapcfg would replace it with {_origin(fn)}")
    decorator(PIPELINE_NAME)(fn)


def _origin(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register() -> None:
    """Register the ``overlapcfg`` pass pipeline and its post-init hook with torchtitan's graph trainer (done on
    import; calling it again is harmless)."""
    _register(_registry.PASS_PIPELINE_REGISTRY, _registry.register_pass_pipeline, overlapcfg_pipeline,
              "pass pipeline")
    _register(_registry.POST_INIT_HOOKS, _registry.register_post_init_hook, check_trainer, "post-init hook")


register()

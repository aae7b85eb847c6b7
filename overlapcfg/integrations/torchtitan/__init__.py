"""overlapcfg as a pass pipeline of torchtitan's graph trainer: importing this module registers it.

Run torchtitan's trainer through this package's entry point (it imports this module on every rank, then runs
``torchtitan.train``; every argument is torchtitan's)::

    OVERLAPCFG_CONFIG=overlap.yaml torchrun --nproc-per-node 8 -m overlapcfg.integrations.torchtitan \\
        --module graph_trainer.llama3 --config graph_trainer_llama3_8b --compile.pass_pipeline overlapcfg

or select it from your own config module (``--module my_configs``) with ``select_pipeline(config)`` and run
``torchtitan.train`` as usual. ``compile.pass_pipeline=overlapcfg`` selects the pipeline (``pipeline``): torchtitan's
default passes with its joint bucketing pass replaced by ``overlapcfg.apply`` on the whole-step graph.

torchtitan looks a pipeline name up with a default (``PASS_PIPELINE_REGISTRY.get(name, ...)``): where nothing
imported this module, ``--compile.pass_pipeline overlapcfg`` runs torchtitan's own passes without a word. Hence the
entry point, which always imports it, and ``select_pipeline``, which a config module cannot call without importing
it, and which fails if the name does not reach this pipeline.
``OVERLAPCFG_CONFIG`` names the config (``source``: unset = torchtitan's own buckets at depth 1, a policy preset
name, or a YAML file). The post-init hook checks the trainer's settings and the config before anything is traced.

Registration goes through torchtitan's own decorators (``registry.register_pass_pipeline`` and
``register_post_init_hook``); a different function already registered under ``overlapcfg`` is an error naming it,
rather than overwritten silently.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

try:
    from torchtitan.experiments.graph_trainer import registry as _registry
except ModuleNotFoundError as _missing:  # say what to install, not only what is missing
    raise ImportError(f"overlapcfg.integrations.torchtitan needs torchtitan's graph trainer ({_missing}): pip install "
                      "'overlapcfg[torchtitan]' (pinned, brings no torch; README \"torchtitan graph trainer\")") \
        from _missing

from overlapcfg.errors import OverlapStateError, OverlapUsageError
from overlapcfg.integrations.torchtitan.graph_trainer import (
    PASS_NAME,
    PIPELINE_NAME,
    check_trainer,
    overlapcfg_bucketing_pass,
    overlapcfg_pipeline,
)
from overlapcfg.integrations.torchtitan.source import ENV_VAR, find_config, torchtitan_plan

__all__ = ["ENV_VAR", "PASS_NAME", "PIPELINE_NAME", "check_trainer", "find_config", "overlapcfg_bucketing_pass",
           "overlapcfg_pipeline", "register", "require_registered", "select_pipeline", "torchtitan_plan"]

C = TypeVar("C")


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


def require_registered() -> None:
    """Raise unless ``compile.pass_pipeline=overlapcfg`` reaches this pipeline and its post-init hook in torchtitan's
    registries: otherwise torchtitan would run its default passes silently (it looks names up with a default)."""
    found = {what: table.get(PIPELINE_NAME) for what, table in (("pass pipeline", _registry.PASS_PIPELINE_REGISTRY),
                                                                ("post-init hook", _registry.POST_INIT_HOOKS))}
    wrong = {what: fn for (what, fn), ours in zip(found.items(), (overlapcfg_pipeline, check_trainer), strict=True)
             if fn is not ours}
    if wrong:
        seen = "; ".join(f"{what}: {'nothing' if fn is None else _origin(fn)}" for what, fn in wrong.items())
        raise OverlapStateError(f"compile.pass_pipeline={PIPELINE_NAME!r} does not reach overlapcfg's pipeline in "
                                f"torchtitan's registries ({seen}): torchtitan would run its default passes without "
                                f"a word and never read {ENV_VAR}. Call overlapcfg.integrations.torchtitan.register() "
                                "in every rank, or run python -m overlapcfg.integrations.torchtitan")


def select_pipeline(config: C) -> C:
    """``config`` (a graph trainer config, ``GraphTrainer.Config``) with ``compile.pass_pipeline = "overlapcfg"``,
    after checking that the name reaches this pipeline (``require_registered``). For config modules::

        def llama3_8b_overlapcfg():
            return select_pipeline(graph_trainer_llama3_8b())
    """
    compile_config = getattr(config, "compile", None)
    if compile_config is None or not hasattr(compile_config, "pass_pipeline"):
        raise OverlapUsageError(f"select_pipeline takes a torchtitan graph trainer config (its compile config has "
                                f"pass_pipeline), got {type(config).__name__}"
                                + (f" whose compile is {type(compile_config).__name__}"
                                   if compile_config is not None else ""))
    require_registered()
    compile_config.pass_pipeline = PIPELINE_NAME
    return config


register()

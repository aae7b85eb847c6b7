"""Traced demo steps and torchtitan whole-step captures, made once per process and shared read-only.

Tracing costs seconds, so each variant is traced once per process (per xdist worker) and every test that needs it
gets the same object, through conftest's fixtures (``traced_2l`` ..., ``whole_step``) or by calling these functions
from a module-level helper; tests that rewrite a graph go through ``apply_to`` (the ``applied`` fixture), which
deep-copies it first.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeAlias

from torch import fx

from overlapcfg.compat import fake_process_group
from overlapcfg.demo import LlamaConfig
from overlapcfg.demo.tracing import TracedStep, trace_train_step
from overlapcfg.kinds import Direction

ApplyFn: TypeAlias = Callable[[TracedStep, Direction, Any], fx.GraphModule]

_TRACES: dict[tuple[int, bool], TracedStep] = {}


def traced_step(n_layers: int, reshard_after_forward: bool) -> TracedStep:
    """The traced demo step for ``n_layers`` (rank 0 of 2), memoized for the process. Do not mutate it."""
    key = (n_layers, reshard_after_forward)
    if key not in _TRACES:
        _TRACES[key] = trace_train_step(LlamaConfig(n_layers=n_layers), world_size=2, rank=0,
                                        reshard_after_forward=reshard_after_forward)
    return _TRACES[key]


_HSDP_TRACES: dict[int, TracedStep] = {}


def traced_hsdp_step(n_layers: int) -> TracedStep:
    """The demo step for ``n_layers`` traced on a 2 x 2 (dp_replicate x dp_shard) mesh, rank 0, memoized for the
    process (the report tests of HSDP groups read the same one). Do not mutate it."""
    if n_layers not in _HSDP_TRACES:
        from overlapcfg.demo.dims import ParallelDims

        _HSDP_TRACES[n_layers] = trace_train_step(LlamaConfig(n_layers=n_layers),
                                                  parallel=ParallelDims(dp_replicate=2, dp_shard=2))
    return _HSDP_TRACES[n_layers]


def apply_to(step: TracedStep, graph_name: Direction, cfg: Any) -> fx.GraphModule:
    """Run ``overlapcfg.passes.apply`` on a deep copy of ``step``'s ``graph_name`` graph; return the copy.

    Runs under the fake process group (the merge helpers read the rank); ``apply`` verifies by default, so every
    applied graph in the suite is also verified.
    """
    from overlapcfg import load_config
    from overlapcfg.passes import apply

    gm = copy.deepcopy(step.graph(graph_name))
    with fake_process_group(step.world_size, step.rank):
        return apply(gm, load_config(cfg), module_fqn_fn=step.module_fqn_fn(graph_name), module_fqns=step.module_fqns,
                     graph_kind=graph_name)


_WHOLE_STEPS: dict[tuple[str, str, bool, str], Any] = {}


def whole_step_capture(model: str = "llama3", reshard: str = "always", optimizer: bool = False,
                       loss: str = "cross_entropy") -> Any:
    """torchtitan graph_trainer's whole-step graph of ``model`` (``llama3`` / ``qwen3_tied``), normalized by
    torchtitan's own passes, captured once per process under a fake group of 2 (``tests/thirdparty/graph_trainer``;
    no overlapcfg involved). ``loss``: ``cross_entropy`` or the trainer's default ``chunked``. Shared read-only:
    transform ``.copy()``."""
    key = (model, reshard, optimizer, loss)
    if key not in _WHOLE_STEPS:
        from tests.thirdparty import graph_trainer, models

        with models.fake_process_group(2):
            _WHOLE_STEPS[key] = graph_trainer.capture_whole_step(model, reshard=reshard, optimizer=optimizer,
                                                                 loss=loss)
    return _WHOLE_STEPS[key]

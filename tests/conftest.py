"""Shared fixtures: demo train steps traced once per session, and ``applied`` to run the pass on a copy.

Tracing costs seconds, so each configuration (layers, reshard-after-forward) is traced once per test session and
shared read-only; tests that rewrite a graph go through ``applied``/``apply_to`` which deep-copies it first.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any, TypeAlias

import pytest
import torch
from torch import fx

from overlapcfg.compat import fake_process_group
from overlapcfg.demo import LlamaConfig
from overlapcfg.demo.tracing import GraphName, TracedStep, trace_train_step


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (``-n N``) each worker gets its share of the cores for torch's intra-op threads: N
    workers each running as many threads as there are cores oversubscribe the machine and run slower together than
    one alone. Spawned ranks set their own count (``run_on_gloo(num_threads=)``)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores_between_workers()

ApplyFn: TypeAlias = Callable[[TracedStep, GraphName, Any], fx.GraphModule]

_TRACES: dict[tuple[int, bool], TracedStep] = {}


def traced_step(n_layers: int, reshard_after_forward: bool) -> TracedStep:
    """The traced demo step for ``n_layers`` (rank 0 of 2), memoized for the whole session. Do not mutate it."""
    key = (n_layers, reshard_after_forward)
    if key not in _TRACES:
        _TRACES[key] = trace_train_step(LlamaConfig(n_layers=n_layers), world_size=2, rank=0,
                                        reshard_after_forward=reshard_after_forward)
    return _TRACES[key]


def apply_to(step: TracedStep, graph_name: GraphName, cfg: Any) -> fx.GraphModule:
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


@pytest.fixture(scope="session")
def traced_2l() -> TracedStep:
    return traced_step(2, False)


@pytest.fixture(scope="session")
def traced_2l_reshard() -> TracedStep:
    return traced_step(2, True)


@pytest.fixture(scope="session")
def traced_4l() -> TracedStep:
    return traced_step(4, False)


@pytest.fixture(scope="session")
def traced_4l_reshard() -> TracedStep:
    return traced_step(4, True)


@pytest.fixture(scope="session")
def applied() -> ApplyFn:
    """``applied(step, graph_name, cfg) -> GraphModule``: the pass on a fresh copy, verified (see ``apply_to``)."""
    return apply_to


_WHOLE_STEPS: dict[tuple[str, str, bool], Any] = {}


def whole_step_capture(model: str = "llama3", reshard: str = "always", optimizer: bool = False) -> Any:
    """torchtitan graph_trainer's whole-step graph of ``model`` (``llama3`` / ``qwen3_tied``), normalized by
    torchtitan's own passes, captured once per session under a fake group of 2 (``tests/thirdparty/graph_trainer``;
    no overlapcfg involved). Shared read-only: transform ``.copy()``."""
    key = (model, reshard, optimizer)
    if key not in _WHOLE_STEPS:
        from thirdparty import graph_trainer, models

        with models.fake_process_group(2):
            _WHOLE_STEPS[key] = graph_trainer.capture_whole_step(model, reshard=reshard, optimizer=optimizer)
    return _WHOLE_STEPS[key]


@pytest.fixture(scope="session")
def whole_step() -> Callable[..., Any]:
    """``whole_step(model="llama3", reshard="always", optimizer=False) -> WholeStep`` (see ``whole_step_capture``)."""
    return whole_step_capture

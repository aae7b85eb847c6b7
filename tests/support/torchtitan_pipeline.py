"""torchtitan's registered ``overlapcfg`` pipeline run as the graph trainer runs it, and the independent check of its
output (``tests.support.checker``) against the original whole-step graph's own annotations. Shared by the
pipeline's tests and the keep-unsharded tests."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import fx

from tests.support.checker import (
    achieved_delays,
    achieved_prefetch,
    expected_delays,
    expected_prefetch,
    joint_merged,
    joint_order,
)


def trainer_config(reshard: str, loss: str = "cross_entropy") -> Any:
    """The slice of ``GraphTrainer.Config`` the pipeline reads for the fixture's 2-layer dense models (``loss``: a
    chunked loss adds ``loss`` to torchtitan's head bucket)."""
    from tests.thirdparty import graph_trainer as G

    with G.graph_trainer_stubs():
        from torchtitan.config import ParallelismConfig
        from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig

    layers = [types.SimpleNamespace(moe=None)] * 2
    return types.SimpleNamespace(compile=GraphTrainerCompileConfig(), loss=G.loss_config(loss),
                                 model_spec=types.SimpleNamespace(model=types.SimpleNamespace(layers=layers)),
                                 parallelism=ParallelismConfig(fsdp_reshard_after_forward=reshard))


def registered_pass(step: Any) -> Callable[..., fx.GraphModule]:
    """The overlapcfg pass exactly as the registered pipeline binds it for ``step`` (config read now)."""
    from tests.thirdparty import graph_trainer as G

    with G.graph_trainer_stubs():
        from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

        import overlapcfg.integrations.torchtitan  # noqa: F401

    passes = PASS_PIPELINE_REGISTRY["overlapcfg"](step.traced, trainer_config(step.reshard, step.loss))
    found = [p for p in passes if isinstance(p, functools.partial) and p.func.__name__ == "overlapcfg_bucketing_pass"]
    assert len(found) == 1, passes
    return found[0]


def run_registered(step: Any) -> fx.GraphModule:
    from tests.thirdparty import models as M

    graph_pass = registered_pass(step)
    with M.fake_process_group(step.world_size, step.rank):
        return graph_pass(step.copy(), step.traced.example_inputs)


def check_joint(gm: fx.GraphModule, original: fx.GraphModule, depth: int,
                kept: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every FSDP collective of ``original`` merged into its own bucket once per kind and direction (re-gathers of
    ``kept`` buckets gone), and the depths the final order achieves equal to what ``depth`` everywhere asks."""
    merged = joint_merged(gm, original)
    found: dict[str, Any] = {}
    for kind, direction in (("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward")):
        want = joint_order(original, kind, direction)
        if kind == "all_gather" and direction == "backward":
            want = {b: s for b, s in want.items() if b not in kept}
        got = {m.bucket: set(m.sources) for m in merged if (m.kind, m.direction) == (kind, direction)}
        assert got == {b: set(s) for b, s in want.items()}, (kind, direction)
        assert sum(1 for m in merged if (m.kind, m.direction) == (kind, direction)) == len(want)
        ks = [depth] * len(want)
        if kind == "all_gather":
            achieved = achieved_prefetch(gm, merged, direction)
            assert [achieved[b] for b in want] == expected_prefetch(ks), (direction, achieved)
        else:
            achieved = achieved_delays(gm, merged)
            assert [achieved[b] for b in want] == expected_delays(ks), achieved
        found[f"{direction} {kind}"] = [achieved[b] for b in want]
    return found

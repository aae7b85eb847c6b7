"""The pass on every graph shape it accepts: aot's separate graphs (elsewhere), aot's joint graph, and the
upstream automatic scheduler as a strategy."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from overlapcfg import compat, load_config
from overlapcfg.capture import shard_module
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.tracing import StepBackend, demo_batch, module_fqn, train_step
from overlapcfg.graph.collectives import find_collectives
from overlapcfg.passes import apply

MODEL = LlamaConfig(n_layers=2)

pytestmark = pytest.mark.slow  # every test here traces the demo step (dynamo)


@pytest.fixture(scope="module")
def joint_graph() -> torch.fx.GraphModule:
    backend = StepBackend(capture_joint=True)
    with compat.fake_process_group(2, 0):
        model = shard_module(Llama(MODEL), world_size=2, rank=0)
        compat.dynamo_reset()
        train_step(torch.compile(model, backend=backend, fullgraph=True), *demo_batch(MODEL.vocab_size))
        compat.dynamo_reset()
    return backend.graphs["joint"]


def _apply(gm: torch.fx.GraphModule, cfg: dict, **kw) -> torch.fx.GraphModule:
    with compat.fake_process_group(2, 0):
        return apply(copy.deepcopy(gm), load_config(cfg), **kw)


def test_joint_graph_directions_are_read_from_node_metadata(joint_graph):
    kinds = Counter((c.direction, c.kind, c.fsdp) for c in find_collectives(joint_graph.graph, module_fqn))
    assert kinds == {("forward", "all_gather", True): 21, ("backward", "reduce_scatter", True): 21}


def test_joint_graph_is_bucketed_and_scheduled_in_both_directions(joint_graph):
    gm = _apply(joint_graph, {"plan": "llama_layers", "policy": {"forward_prefetch": 2, "reduce_scatter_delay": 1}})
    record = gm.meta["overlapcfg"]
    assert record.after.fsdp == (("backward", "reduce_scatter", 4), ("forward", "all_gather", 4))
    forward = [(s.bucket, s.effective) for s in record.decisions if s.direction == "forward"]
    backward = [(s.bucket, s.effective) for s in record.decisions if s.kind == "reduce_scatter"]
    assert forward == [("tok_embeddings", 2), ("layers.0", 2), ("layers.1", 1), ("norm+output", 0)]
    assert backward == [("norm+output", 1), ("layers.1", 1), ("layers.0", 1), ("tok_embeddings", 0)]


@pytest.mark.parametrize("name", ["forward", "backward"])
def test_auto_strategy_runs_upstream_scheduler_on_cpu_and_buckets(traced_2l_reshard, name):
    step = traced_2l_reshard
    gm = _apply(step.graph(name), {"strategy": "auto", "policy": {"collective_bucketing": True}},
                module_fqn_fn=step.module_fqn_fn(name), graph_kind=name)
    record = gm.meta["overlapcfg"]
    assert record.strategy == "auto"
    assert 0 < record.after.total_fsdp < record.before.total_fsdp
    assert record.after.other == 0

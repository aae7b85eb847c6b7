"""The demo on a 3-D mesh, traced once in one process: dp_replicate 2 x dp_shard 2 x tp 2 (8 fake ranks), sequence
parallel (TP all-gathers and reduce-scatters in both graphs) and HSDP reducing scatter-first (the order the 4-rank
parity run does not take). Checks what the graphs hold before the pass, what the pass changes (fewer all-gathers,
one HSDP all-reduce per bucket) and what it must not (TP collectives: order, inputs, readers), and that the
``overlapcfg`` job runs on such a mesh end to end. Graph facts are read from the FX graphs (op, group name, node
names), not from the pass record.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from rich.console import Console
from torch import fx

from overlapcfg import load_config
from overlapcfg.demo.job import run_report, traced
from overlapcfg.demo.settings import demo_settings
from overlapcfg.demo.tracing import TracedStep
from overlapcfg.graph.attribution import module_fqn
from overlapcfg.graph.collectives import collective_kind, find_collectives, group_name
from overlapcfg.passes import apply_step
from tests.support.mesh import counts_by_dim, group_signature

pytestmark = pytest.mark.slow

SETTINGS: dict[str, Any] = {
    "model": {"n_layers": 2, "dim": 32, "n_heads": 4, "ffn_hidden": 64, "vocab_size": 64},
    "parallel": {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "sequence_parallel": True,
                 "hsdp_reduce": "reduce_scatter_first"},
    "reshard_after_forward": True,
}
N_PARAMS = 3 + 9 * 2
BUCKETS = 4
"""``llama_layers`` on 2 layers: tok_embeddings, layers.0, layers.1, norm + output."""
OVERLAP: dict[str, Any] = {
    "strategy": "manual", "plan": "llama_layers",
    "policy": {"forward_prefetch": 2, "backward_prefetch": 1, "reduce_scatter_delay": 1, "all_reduce_delay": 2},
}
GRAPHS = ("forward", "backward")


@pytest.fixture(scope="module")
def step() -> TracedStep:
    """Traced through the job's own path (``overlapcfg.demo.job.traced``), so the end-to-end test reuses it."""
    return traced(demo_settings(SETTINGS))


@pytest.fixture(scope="module")
def applied(step: TracedStep) -> dict[str, fx.GraphModule]:
    return {a.name: a.graph for a in apply_step(step, load_config(OVERLAP)).graphs}


def _dims_of(step: TracedStep) -> dict[str, str]:
    return {group: dim for dim, group in step.mesh_groups}


def test_the_trace_has_every_mesh_dimension_s_collectives_on_its_own_group(step: TracedStep) -> None:
    assert [dim for dim, _ in step.mesh_groups] == ["dp_replicate", "dp_shard", "tp"]
    assert len({group for _, group in step.mesh_groups}) == 3
    fw, bw = (counts_by_dim(step.graph(g), _dims_of(step)) for g in GRAPHS)
    assert fw[("all_gather", "dp_shard")] == bw[("reduce_scatter", "dp_shard")] == N_PARAMS
    assert bw[("all_reduce", "dp_replicate")] == N_PARAMS  # HSDP: every gradient also on the replicas
    assert not fw[("all_reduce", "dp_replicate")]
    for counts in (fw, bw):  # sequence parallel: activations gathered and scattered on the TP group
        assert counts[("all_gather", "tp")] and counts[("reduce_scatter", "tp")]
        assert not counts[("all_gather", "?")] + counts[("reduce_scatter", "?")] + counts[("all_reduce", "?")]


def test_process_groups_rebuilds_the_mesh_groups_under_their_traced_names(step: TracedStep) -> None:
    """Merging resolves groups by the names the graphs state; outside the trace's own group they must be rebuilt."""
    from overlapcfg import compat

    assert all(compat.registered_group_size(group) is None for _, group in step.mesh_groups)
    with step.process_groups():
        assert [compat.registered_group_size(group) for _, group in step.mesh_groups] == [2, 2, 2]


@pytest.mark.parametrize("graph", GRAPHS)
def test_the_pass_merges_the_shard_groups_all_gathers(step: TracedStep, applied: dict[str, fx.GraphModule],
                                                       graph: str) -> None:
    before = counts_by_dim(step.graph(graph), _dims_of(step))[("all_gather", "dp_shard")]  # type: ignore[arg-type]
    after = counts_by_dim(applied[graph], _dims_of(step))[("all_gather", "dp_shard")]
    assert 0 < after < before


def test_hsdp_all_reduces_after_reduce_scatters_are_bucketed_one_per_bucket(
        step: TracedStep, applied: dict[str, fx.GraphModule]) -> None:
    after = counts_by_dim(applied["backward"], _dims_of(step))
    assert after[("all_reduce", "dp_replicate")] == after[("reduce_scatter", "dp_shard")] == BUCKETS, after


def test_find_collectives_classifies_the_bucketed_replica_all_reduces_as_hsdp(
        step: TracedStep, applied: dict[str, fx.GraphModule]) -> None:
    """The pass's own classification agrees with the count read from the graph above."""
    with step.process_groups():
        found = find_collectives(applied["backward"].graph, step.module_fqn_fn("backward"))
    replicate = [c for c in found if c.group == step.group_of("dp_replicate")]
    assert [c.role for c in replicate] == ["hsdp_all_reduce"] * BUCKETS


def _gradient_all_reduces(gm: fx.GraphModule, tp: str, shard: str) -> set[str]:
    """TP-group all-reduces whose wait an FSDP reduce-scatter reads: the gradient of a parameter replicated over TP
    (the norms, under sequence parallel), reduced over TP before FSDP reduces it. Every other TP collective moves
    activations or their gradients."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return {name for name, kind, _, readers in group_signature(gm, tp)
            if kind == "all_reduce" and any(collective_kind(nodes[r]) == "reduce_scatter"
                                            and group_name(nodes[r]) == shard for r in readers)}


@pytest.mark.parametrize("graph", GRAPHS)
def test_tensor_parallel_activation_collectives_keep_their_order_inputs_and_readers(
        step: TracedStep, applied: dict[str, fx.GraphModule], graph: str) -> None:
    tp, shard, original = step.group_of("tp"), step.group_of("dp_shard"), step.graph(graph)  # type: ignore[arg-type]
    grads = _gradient_all_reduces(original, tp, shard)
    assert bool(grads) == (graph == "backward")  # the 5 norms' gradients, backward only
    before = [entry for entry in group_signature(original, tp) if entry[0] not in grads]
    assert before, f"no TP activation collective in the {graph} graph"
    names = {entry[0] for entry in before}
    after = group_signature(applied[graph], tp)
    assert [entry for entry in after if entry[0] in names] == before
    # Nothing else on the TP group but (possibly merged) gradient all-reduces: no TP activation was merged away.
    assert {kind for name, kind, _, _ in after if name not in names} <= {"all_reduce"}


def test_gradient_all_reduces_on_the_tensor_parallel_group_are_left_alone(
        step: TracedStep, applied: dict[str, fx.GraphModule]) -> None:
    tp, shard, original = step.group_of("tp"), step.group_of("dp_shard"), step.backward
    grads = _gradient_all_reduces(original, tp, shard)
    assert len(grads) == 1 + 2 * 2
    before = [entry for entry in group_signature(original, tp) if entry[0] in grads]
    # Same name, op and input, in the same order; the reader is now the merged dp-group reduce-scatter's copy-in.
    after = [entry for entry in group_signature(applied["backward"], tp) if entry[0] in grads]
    assert [entry[:3] for entry in after] == [entry[:3] for entry in before]
    assert all("reduce_scatter" in reader for *_, readers in after for reader in readers)
    # The chain looks like HSDP's all-reduce-first, but the group carries activations too: tensor parallel's.
    roles = {c.start.name: c.role for c in find_collectives(applied["backward"].graph, module_fqn)}
    assert {roles[name] for name in grads} == {"other"}


def test_the_job_reports_a_3d_mesh_end_to_end(step: TracedStep, tmp_path: Path) -> None:
    """``overlapcfg parallel.dp_replicate=2 parallel.dp_shard=2 parallel.tp=2 ...`` minus Hydra: the composed
    config through ``run_report`` (the trace is the fixture's, memoized by the job)."""
    cfg = OmegaConf.create({**SETTINGS, "sharding": "simple_fsdp", "world_size": None, "batch": 2, "seq_len": 16,
                            "overlap": OVERLAP, "hardware": "cpu_gloo"})
    out = io.StringIO()
    path = run_report(cfg, tmp_path, Console(file=out, width=200))
    text = out.getvalue()
    assert "for 8 ranks = 2 x 2 x 2 (dp_replicate x dp_shard x tp), sequence parallel" in text
    assert "(cached)" in text
    report = json.loads(path.read_text())
    assert report["world_size"] == 8 and report["simulation"] is not None

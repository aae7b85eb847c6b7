"""Numerical parity on 2-D meshes: HSDP (dp_replicate 2 x dp_shard 2) and FSDP + TP (dp_shard 2 x tp 2) training
steps on four real gloo ranks, with the pass and without it, bit for bit (loss and every local gradient shard).

Each rank builds each mesh in the gloo group, tensor-parallelizes and shards the 2-layer demo model
(``overlapcfg.demo.parallel``) and compiles one step once: the backend (``tests/support/variants.Variants``) keeps aot's
untransformed graphs as the reference and applies every config to its own copy, as the production backend does
(``verify`` runs inside). The same CPU kernels then run each variant from the same weights and batch; TP ranks of one
group read the same batch. One run serves both meshes and all configs (4 processes on 2 cores: a compile per mesh,
not per config), its ranks forked from a server that imported this module once (``run_on_gloo(preload=...)``).
The graph summaries prove the pass did something: fewer all-gathers, one HSDP all-reduce per bucket, and TP
collectives exactly where they were.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.dims import ParallelDims
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.demo.parallel import build_mesh, parallelize
from overlapcfg.demo.tracing import compile_with_pass, demo_batch, train_step
from tests.support.mesh import counts_by_dim, group_signature
from tests.support.rank_warmup import preloaded
from tests.support.variants import REFERENCE, REFERENCE_AGAIN, TAMPERED, Variants, assert_harness_ran_what_it_selected

pytestmark = pytest.mark.slow

MODEL = LlamaConfig(n_layers=1, dim=32, n_heads=4, ffn_hidden=64, vocab_size=64)
"""One layer, three buckets (the embedding, the layer, norm + output): parity, the HSDP all-reduce per bucket and
the TP collectives in place are per collective, not per layer, and depth 2 still reaches past the next bucket.
Every rank compiles the model once per mesh, four ranks on the machine's cores: dynamo's and aot's time grows with
the layers."""
N_PARAMS = 3 + 9 * MODEL.n_layers
MESHES = {
    "hsdp": ParallelDims(dp_replicate=2, dp_shard=2),
    "fsdp_tp": ParallelDims(dp_shard=2, tp=2),
}
BUCKETS = 2 + MODEL.n_layers
"""``llama_layers``: tok_embeddings, one per layer, norm + output."""


def _manual(k: int, d: int, **policy: Any) -> dict[str, Any]:
    return {"strategy": "manual", "plan": "llama_layers",
            "policy": {"forward_prefetch": k, "backward_prefetch": k, "reduce_scatter_delay": d, **policy}}


CONFIGS: dict[str, dict[str, Any]] = {
    # One config (each costs every rank an apply + verify per graph): deeper prefetch than the default and
    # all-reduces delayed further than reduce-scatters, so the schedule differs from the trace's in every way.
    "manual_k2_rs1_ar2": _manual(2, 1, all_reduce_delay=2, backward_prefetch=1),
}


def _summary(variants: Variants, dims_of: dict[str, str], tp_group: str | None) -> dict[str, Any]:
    return {name: {graph: {"counts": counts_by_dim(gms[name], dims_of),
                           "tp": group_signature(gms[name], tp_group) if tp_group else ()}
                   for graph, gms in variants.graphs.items()}
            for name in (REFERENCE, *CONFIGS)}


def _mesh_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, dims in MESHES.items():
        mesh = build_mesh(dims)
        groups = mesh.group_names()
        model = parallelize(Llama(MODEL, seed=0), mesh, reshard_after_forward=True)
        tokens, targets = demo_batch(MODEL.vocab_size, seed=100 + mesh.dp_rank)
        variants = Variants(CONFIGS)
        compiled = compile_with_pass(model, backend=variants.backend)
        steps = {}
        for key, name in variants.runs():
            variants.selected = name
            steps[key] = train_step(compiled, tokens, targets)
        out[label] = {"steps": steps, "dims": {g: d for d, g in groups.items()},
                      "graphs": _summary(variants, {g: d for d, g in groups.items()}, groups.get("tp"))}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_gloo(_mesh_worker, world_size=4, timeout_s=300, preload=preloaded(__name__))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mesh", list(MESHES))
def test_step_is_bitwise_identical_to_the_untransformed_step(results: list[dict[str, Any]], mesh: str,
                                                              config: str) -> None:
    for rank, res in enumerate(results):
        (ref_loss, ref_grads), (loss, grads) = res[mesh]["steps"][REFERENCE], res[mesh]["steps"][config]
        assert torch.equal(loss, ref_loss), (rank, loss, ref_loss)
        assert list(grads) == list(ref_grads) and len(grads) == N_PARAMS
        for param, grad in grads.items():
            assert torch.equal(grad, ref_grads[param]), (rank, param)


def _losses(results: list[dict[str, Any]], mesh: str) -> list[float]:
    return [float(res[mesh]["steps"][REFERENCE][0]) for res in results]


def _wq_grads(results: list[dict[str, Any]], mesh: str) -> list[torch.Tensor]:
    return [res[mesh]["steps"][REFERENCE][1]["layers.0.attention.wq.weight"] for res in results]


def test_hsdp_replicas_hold_the_same_reduced_shard_from_different_batches(results: list[dict[str, Any]]) -> None:
    """Mesh ``[[0, 1], [2, 3]]`` (replicate x shard): 0 and 2 are replicas of one shard, 0 and 1 hold different
    shards. Guards the parity against comparing nothing, and shows the all-reduce did reduce over the replicas."""
    losses, grads = _losses(results, "hsdp"), _wq_grads(results, "hsdp")
    assert len(set(losses)) == 4  # four batches
    assert torch.equal(grads[0], grads[2]) and torch.equal(grads[1], grads[3])
    assert not torch.equal(grads[0], grads[1])


def test_tensor_parallel_ranks_share_a_batch_and_split_the_weights(results: list[dict[str, Any]]) -> None:
    """Mesh ``[[0, 1], [2, 3]]`` (shard x tp): 0 and 1 are one TP group (one batch, one loss, different weight
    columns); 0 and 2 are FSDP peers (different batches)."""
    losses, grads = _losses(results, "fsdp_tp"), _wq_grads(results, "fsdp_tp")
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]
    assert not torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_pass_merges_the_shard_groups_all_gathers(results: list[dict[str, Any]], mesh: str, config: str) -> None:
    for res in results:
        for graph, summary in res[mesh]["graphs"][config].items():
            before = res[mesh]["graphs"][REFERENCE][graph]["counts"][("all_gather", "dp_shard")]
            after = summary["counts"][("all_gather", "dp_shard")]
            assert 0 < after < before, (mesh, graph, before, after)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_hsdp_all_reduces_are_bucketed_one_per_bucket(results: list[dict[str, Any]], config: str) -> None:
    """Before: one all-reduce (replicate group) and one reduce-scatter (shard group) per parameter; after: one of
    each per bucket, and never an all-reduce in forward."""
    for res in results:
        graphs = res["hsdp"]["graphs"]
        before, after = graphs[REFERENCE]["backward"]["counts"], graphs[config]["backward"]["counts"]
        assert before[("all_reduce", "dp_replicate")] == before[("reduce_scatter", "dp_shard")] == N_PARAMS
        assert after[("all_reduce", "dp_replicate")] == after[("reduce_scatter", "dp_shard")] == BUCKETS, after
        assert not graphs[config]["forward"]["counts"][("all_reduce", "dp_replicate")]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tensor_parallel_collectives_keep_their_order_inputs_and_readers(results: list[dict[str, Any]],
                                                                         config: str) -> None:
    for res in results:
        for graph, summary in res["fsdp_tp"]["graphs"][config].items():
            reference = res["fsdp_tp"]["graphs"][REFERENCE][graph]["tp"]
            assert reference, f"no TP collective in the {graph} graph: the mesh did not tensor-parallelize"
            assert summary["tp"] == reference


@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_harness_runs_the_graphs_it_selects(results: list[dict[str, Any]], mesh: str) -> None:
    for res in results:
        steps = res[mesh]["steps"]
        assert_harness_ran_what_it_selected(steps[REFERENCE], steps[REFERENCE_AGAIN], steps[TAMPERED])

"""Numerical parity: the rewritten graphs compute the same training step, bit for bit, on two real gloo ranks.

Each rank compiles one step of the sharded 2-layer demo model once (``tests/support/variants.Variants``): aot's
untransformed graphs are the reference, and every config is applied to its own copy as ``overlapcfg.backend(cfg)``
applies it. Each rank rewrites its own (rank-specific) graphs, ``verify`` runs inside, and the boxed-eager compiler
runs the same CPU kernels, so loss and every local gradient shard must be ``torch.equal`` to the reference. The
collective counts prove the pass did rewrite the graphs; a deliberately tampered variant and a second reference
step prove the harness runs the graphs it selects and carries nothing from one step to the next. All configs of
one reshard setting share one compile, and both settings one pair of processes.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from overlapcfg.capture import shard_module
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.demo.tracing import compile_with_pass, demo_batch, train_step
from tests.support.rank_warmup import preloaded
from tests.support.variants import REFERENCE, REFERENCE_AGAIN, TAMPERED, Variants, assert_harness_ran_what_it_selected

pytestmark = pytest.mark.slow

MODEL = LlamaConfig(n_layers=2)
_LAYER_BYTES = 4 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64)
"""Unsharded fp32 bytes of one transformer block's parameters (one ``layers.*`` bucket)."""


def _manual(k: int, d: int, **policy: Any) -> dict[str, Any]:
    return {"strategy": "manual", "plan": "llama_layers",
            "policy": {"forward_prefetch": k, "backward_prefetch": k, "reduce_scatter_delay": d, **policy}}


CONFIGS: dict[str, dict[str, Any]] = {
    "manual_k0_d0": _manual(0, 0),
    "manual_k1_d1": _manual(1, 1),
    "manual_k2_d2": _manual(2, 2),
    # Room for one block's all-gather and a little: depth 2 is requested, the cap cuts it where blocks meet.
    "manual_capped": _manual(2, 2, max_inflight_bytes=_LAYER_BYTES + 70_000),
    "manual_override": {**_manual(1, 1), "overrides": [
        {"match": "layers.1", "forward_prefetch": 0, "backward_prefetch": 2, "reduce_scatter_delay": 2}]},
    "torch_manual": {"strategy": "torch_manual", "plan": "llama_layers"},
    "none": {"strategy": "none"},
}


def _sampled(seed: int, count: int) -> dict[str, dict[str, Any]]:
    """Configs drawn at random (a fixed seed: the same sample every run) over plans, depths, caps, bucket modes and
    overrides: parity on combinations nobody chose by hand."""
    rng = random.Random(seed)
    out: dict[str, dict[str, Any]] = {}
    for i in range(count):
        policy: dict[str, Any] = {key: rng.randint(0, 3) for key in
                                  ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay")}
        policy["bucket_mode"] = rng.choice(["default", "custom_ops", "custom_ops_multidtype", "coalesced"])
        if rng.random() < 0.5:
            policy["max_inflight_bytes"] = rng.randint(_LAYER_BYTES // 2, 3 * _LAYER_BYTES)
        cfg: dict[str, Any] = {"strategy": "manual", "policy": policy,
                               "plan": rng.choice(["llama_layers", "per_block_split", "two_layers_per_bucket"])}
        if rng.random() < 0.5:
            cfg["overrides"] = [{"match": f"layers.{rng.randint(0, 1)}.**", "forward_prefetch": rng.randint(0, 2)}]
        out[f"sampled_{i}"] = cfg
    return out


CONFIGS.update(_sampled(seed=14, count=4))
REWRITING = [name for name in CONFIGS if name != "none"]


_COMM_OPS = ("all_gather", "reduce_scatter", "wait_tensor")


def _comm_order(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """Where collectives and waits sit among the compute: 'c' for each compute run, op names otherwise."""
    out: list[str] = []
    for node in gm.graph.nodes:
        parts = str(node.target).split(".") if node.op == "call_function" else []
        name = parts[-2] if len(parts) >= 2 else ""
        if name.startswith(_COMM_OPS):  # merged starts are ``all_gather_into_tensor_out`` etc.
            out.append(name)
        elif node.op == "call_function" and (not out or out[-1] != "c"):
            out.append("c")
    return tuple(out)


def _step(compiled: torch.nn.Module, variants: Variants, name: str, tokens: torch.Tensor,
          targets: torch.Tensor) -> dict[str, Any]:
    variants.selected = name
    loss, grads = train_step(compiled, tokens, targets)
    graphs = {graph: gms[name] for graph, gms in variants.graphs.items()}
    records = {graph: gm.meta.get("overlapcfg") for graph, gm in graphs.items()}
    return {
        "loss": loss,
        "grads": grads,
        "counts": {graph: (r.before.total_fsdp, r.after.total_fsdp) for graph, r in records.items() if r},
        "order": {graph: _comm_order(gm) for graph, gm in graphs.items()},
        "capped": [(r.graph_kind, s.bucket, s.requested, s.effective) for r in records.values() if r
                   for s in r.decisions if s.effective < s.requested and "max_inflight_bytes" in (s.reason or "")],
    }


RESHARD = {"keep": False, "reshard": True}
"""``reshard_after_forward`` of the two captures every rank compiles, one after the other."""


def _parity_worker(rank: int, world_size: int, configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per reshard setting: reference step, then one step per config, the tampered step and the reference again
    (``Variants.runs``), every one from the same seeded weights (no optimizer step in between) and this rank's
    batch. Both settings in one job: each has its own model and compile (``compile_with_pass`` resets dynamo), and
    the ranks' start-up, gloo connections and dynamo's first-compile warm-up are paid once, not once per setting."""
    tokens, targets = demo_batch(MODEL.vocab_size, seed=100 + rank)
    out = {}
    for label, reshard in RESHARD.items():
        model = shard_module(Llama(MODEL, seed=0), world_size=world_size, rank=rank, reshard_after_forward=reshard)
        variants = Variants(configs)
        compiled = compile_with_pass(model, backend=variants.backend)
        out[label] = {key: _step(compiled, variants, name, tokens, targets) for key, name in variants.runs()}
    return out


@pytest.fixture(scope="module")
def both_settings() -> list[dict[str, dict[str, Any]]]:
    return run_on_gloo(_parity_worker, CONFIGS, world_size=2, timeout_s=360, preload=preloaded(__name__))


@pytest.fixture(scope="module", params=list(RESHARD))
def results(request: pytest.FixtureRequest, both_settings: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One reshard setting's per-rank results (the tests run once per setting, as before the job was shared)."""
    return [per_rank[request.param] for per_rank in both_settings]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_is_bitwise_identical_to_the_untransformed_step(results: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        ref, got = res[REFERENCE], res[name]
        assert torch.equal(got["loss"], ref["loss"]), (rank, name, got["loss"], ref["loss"])
        assert list(got["grads"]) == list(ref["grads"])
        for param, grad in got["grads"].items():
            assert torch.equal(grad, ref["grads"][param]), (rank, name, param)


@pytest.mark.parametrize("name", REWRITING)
def test_rewriting_configs_merge_collectives_in_both_graphs(results: list[dict[str, Any]], name: str) -> None:
    for res in results:
        counts = res[name]["counts"]
        assert set(counts) == {"forward", "backward"}
        for graph, (before, after) in counts.items():
            assert 0 < after < before, (name, graph, before, after)


def test_depths_place_collectives_differently(results: list[dict[str, Any]]) -> None:
    """Parity at several depths is only evidence if the depths really produced different schedules."""
    for res in results:
        orders = [res[name]["order"]["forward"] for name in ("manual_k0_d0", "manual_k1_d1", "manual_k2_d2")]
        assert len(set(orders)) == 3
        assert res["manual_override"]["order"] != res["manual_k1_d1"]["order"]


def test_none_leaves_every_collective_in_place(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert all(before == after > 0 for before, after in res["none"]["counts"].values())


def test_the_cap_binds_in_the_capped_config(results: list[dict[str, Any]]) -> None:
    """Guards the capped config against silently testing nothing but depth 2."""
    for res in results:
        assert res["manual_capped"]["capped"], "max_inflight_bytes never reduced a depth"
        assert not res["manual_k2_d2"]["capped"]


def test_the_harness_runs_the_graphs_it_selects(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert_harness_ran_what_it_selected(*((res[key]["loss"], res[key]["grads"])
                                              for key in (REFERENCE, REFERENCE_AGAIN, TAMPERED)))

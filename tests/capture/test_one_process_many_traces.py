"""One Python process, many captures: what a capture sees must not depend on what the process traced before.

The trap (torch 2.11-2.14): DTensor memoizes sharding propagation keyed by ``DeviceMesh`` *equality* (ranks,
layout, dimension names; not the process group, not the object), and the cached results hold the mesh they were
computed with. A mesh built again in the next fake process group equals the first, so the next model's DTensors
were handed the first trace's mesh: ``trace_train_step`` with tensor parallel, then with sequence parallel, failed
with "dynamo's inputs name parameters the model does not have (layers.0.attention.wq)" (the old mesh became an extra
graph input, read off a parametrization), and torchtitan's sequence-parallel Llama mis-shaped its activations after
the demo's TP model had been traced. overlapcfg clears those caches whenever its fake process group opens or closes
and around every capture (``overlapcfg.compat.forget_dtensor_caches``).

Fast: the cache itself, on DTensor ops in two fake groups one after the other. Slow: six different captures (plain
FSDP, TP, TP + SP, HSDP, a Hugging Face model, torchtitan's TP + SP Llama) in one process, in one order and then in
the reverse order: every capture succeeds and each one's graphs are the same whichever ran before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import overlapcfg
from overlapcfg import compat
from overlapcfg.demo import LlamaConfig
from overlapcfg.demo.dims import ParallelDims
from overlapcfg.passes.step import CapturedStep
from tests.support.diagnose_jobs import batches, llama
from tests.thirdparty import models as M


def _sum_on_a_fresh_mesh() -> bool:
    """In a new fake group of 2: build a 1-D mesh, add two DTensors on it; whether the sum is on that mesh."""
    with compat.fake_process_group(2, 0):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        a = DTensor.from_local(torch.ones(2, 8, 4), mesh, [Shard(1)], run_check=False)
        return (a + a).device_mesh is mesh


def test_a_dtensor_op_in_a_later_process_group_gets_that_groups_mesh() -> None:
    assert _sum_on_a_fresh_mesh()
    assert _sum_on_a_fresh_mesh()  # before: the first group's (equal, dead) mesh came back from DTensor's cache


def test_forgetting_dtensor_caches_is_what_user_managed_groups_need() -> None:
    """A user who opens and destroys groups without overlapcfg's context manager gets the old mesh back (torch's
    behaviour, the reason overlapcfg clears the caches) unless they call ``forget_dtensor_caches`` in between."""
    import torch.distributed as dist

    def sum_mesh_is_fresh(forget: bool) -> bool:
        dist.init_process_group("fake", store=compat.FakeStore(), rank=0, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            a = DTensor.from_local(torch.ones(2, 6, 4), mesh, [Shard(1)], run_check=False)
            return (a + a).device_mesh is mesh
        finally:
            dist.destroy_process_group()
            if forget:
                compat.forget_dtensor_caches()

    compat.forget_dtensor_caches()
    assert sum_mesh_is_fresh(forget=False)
    assert not sum_mesh_is_fresh(forget=True)  # torch's cache handed out the previous group's mesh
    assert sum_mesh_is_fresh(forget=False)  # cleared after the last one: fresh again


# --- six captures, two orders (slow) ----------------------------------------------------------------------------

SMALL = LlamaConfig(n_layers=1, vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64)


def _demo(parallel: ParallelDims) -> Callable[[], CapturedStep]:
    return lambda: overlapcfg.trace_train_step(SMALL, parallel=parallel)


def _hf() -> CapturedStep:
    """A one-layer Hugging Face Llama (dynamo's time grows with the layers; the caches at stake do not)."""
    model = llama({"layers": 1})
    overlapcfg.shard_module(model, world_size=2)
    ((tokens, targets),) = batches(0, 1, model.config.vocab_size)
    return overlapcfg.capture_step(model, (tokens,), loss_fn=lambda out: torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), targets.flatten(0, 1)))


def _torchtitan_sequence_parallel() -> CapturedStep:
    """torchtitan's own FSDP + TP + SP Llama on a 2 x 2 mesh, built and captured in overlapcfg's fake group, at one
    layer (``tests/thirdparty/models.LAYERS`` is 2): the meshes and DTensor caches at stake are the model's, not a
    layer's, and dynamo's time grows with the layers (this capture was half the test's time at two)."""
    with mock.patch.object(M, "LAYERS", 1), compat.fake_process_group(4, 0):
        model, make_batch = M.torchtitan_llama3("fsdp_tp")
        inputs, loss_fn = make_batch()
        return overlapcfg.capture_step(model, inputs, loss_fn=loss_fn)


CAPTURES: dict[str, Callable[[], CapturedStep]] = {
    "fsdp": _demo(ParallelDims(dp_shard=2)),
    "tp": _demo(ParallelDims(dp_shard=2, tp=2)),
    "tp_sp": _demo(ParallelDims(dp_shard=2, tp=2, sequence_parallel=True)),
    "hsdp": _demo(ParallelDims(dp_replicate=2, dp_shard=2)),
    "hf_llama": _hf,
    "torchtitan_tp_sp": _torchtitan_sequence_parallel,
}


def _graph_print(gm: fx.GraphModule) -> tuple[tuple[str, str, tuple[int, ...] | None], ...]:
    """Ops, targets and output shapes in graph order (node names aside)."""
    def shape(node: fx.Node) -> tuple[int, ...] | None:
        val = node.meta.get("val")
        return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None
    return tuple((n.op, str(n.target) if n.op != "placeholder" else "", shape(n)) for n in gm.graph.nodes)


def _fingerprint(step: CapturedStep) -> dict[str, Any]:
    return {"forward": _graph_print(step.forward), "backward": _graph_print(step.backward),
            "params": step.param_fqns, "collectives": [(c.graph, c.kind, c.param_fqn) for c in step.collectives]}


@pytest.mark.slow
def test_six_different_captures_in_one_process_do_not_depend_on_what_ran_before() -> None:
    order = list(CAPTURES)
    first = {name: _fingerprint(CAPTURES[name]()) for name in order}
    again = {name: _fingerprint(CAPTURES[name]()) for name in reversed(order)}
    for name in order:
        assert first[name]["collectives"], name
        assert again[name] == first[name], name

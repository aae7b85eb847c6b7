"""A collective waited more than once, on a model nobody here wrote: GPT-NeoX with ``use_parallel_residual``
(Pythia's and Phi's block: attention and MLP read the same input, their outputs are added).

The attention output projection's bias and the MLP's output bias get the same gradient, so the tracer's CSE keeps
one reduce-scatter for both, with one ``wait_tensor`` per gradient output. torch's merge helpers assert one wait per
collective ("Expected single user for reduce_scatter_tensor_3"), which crashed every route (apply, explain, tune,
the backend) on these models; a newcomer trying the README on Phi met it first. The pass now folds the repeated
waits into the first (``overlapcfg.graph.merge.fold_repeated_waits``; ``wait_tensor`` returns its argument, so the
graph means the same), then merges as usual. Checked here on the captured graphs (every FSDP collective merged, each
collective of the result waited once, verification on) and by one step on 2 gloo ranks, bit for bit against the
untransformed compile.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

import overlapcfg
from overlapcfg.demo.gloo import run_on_gloo
from overlapcfg.passes import apply
from tests.support.rank_warmup import preloaded
from tests.thirdparty import conformance as C
from tests.thirdparty import models as M

CASE = C.CASES["hf_gpt_neox"]
_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _waits_per_start(gm: fx.GraphModule) -> dict[str, int]:
    """Collective start -> how many ``wait_tensor`` nodes read it (read off the graph, not through overlapcfg)."""
    return {n.name: sum(u.target is _WAIT for u in n.users) for n in gm.graph.nodes
            if n.op == "call_function" and n.target in C._KIND}


@pytest.fixture(scope="module")
def step() -> overlapcfg.CapturedStep:
    """The newcomer's route: ``shard_module`` and ``capture_step`` (HF's loss from ``labels`` traces here)."""
    model, _ = M.hf_gpt_neox()
    tokens = torch.randint(0, M.VOCAB, (M.BATCH, M.SEQ_LEN), generator=torch.Generator().manual_seed(0))
    overlapcfg.shard_module(model, world_size=CASE.world_size, reshard_after_forward=True)
    return overlapcfg.capture_step(model, (tokens,), {"labels": tokens})


@pytest.mark.slow
def test_the_captured_backward_has_reduce_scatters_waited_twice(step: overlapcfg.CapturedStep) -> None:
    """What the other tests rely on: the graph really has the shape that crashed (one per layer)."""
    waited_twice = [name for name, n in _waits_per_start(step.backward).items() if n > 1]
    assert len(waited_twice) == 2, _waits_per_start(step.backward)
    assert all(n <= 1 for n in _waits_per_start(step.forward).values())


@pytest.mark.slow
def test_apply_merges_every_fsdp_collective_and_waits_each_once(step: overlapcfg.CapturedStep) -> None:
    cfg = overlapcfg.load_config(CASE.config(1))  # verification on (the default)
    with M.fake_process_group(CASE.world_size):
        out = {g: apply(M.copy_graph_module(getattr(step, g)), cfg, module_fqn_fn=step.module_fqn_fn(g),
                        module_fqns=step.module_fqns, graph_kind=g) for g in ("forward", "backward")}
    assert C.counts(out["forward"]) == {"all_gather": 4}  # C.counts asserts one wait per collective
    assert C.counts(out["backward"]) == {"all_gather": 3, "reduce_scatter": 4}
    record = out["backward"].meta["overlapcfg"]
    assert record.uncovered == () and record.non_fsdp == ()
    assert any(n.startswith("2 collectives were waited more than once") for n in record.notes), record.notes
    assert not any("waited more than once" in n for n in out["forward"].meta["overlapcfg"].notes)
    assert record.before.get("backward", "reduce_scatter") == 26 and record.after.get("backward", "reduce_scatter") == 4
    # The graph's outputs still return the one reduced gradient for both biases, from the merged bucket.
    outputs = [a for a in out["backward"].graph.output_node().args[0] if isinstance(a, fx.Node)]
    assert len(outputs) > len(set(outputs))


@pytest.mark.slow
def test_explain_runs_on_it(step: overlapcfg.CapturedStep) -> None:
    """The route the newcomer met the crash on (tune and the backend go through the same pass)."""
    report = overlapcfg.explain(step, CASE.config(1))
    assert [(g.collectives_before, g.collectives_after) for g in report.graphs] == [(28, 4), (45, 7)]


@pytest.mark.slow
def test_one_step_on_gloo_is_bitwise_identical_to_the_untransformed_compile() -> None:
    results = run_on_gloo(C.parity_worker, [("hf_gpt_neox", CASE.config(1))], world_size=2, timeout_s=300,
                          preload=preloaded(C.__name__))  # ranks fork with torch, transformers and the checker imported
    for rank, res in enumerate(r["hf_gpt_neox"] for r in results):
        got, ref = res["transformed"], res["reference"]
        assert got["uncovered"] == 0, rank
        assert got["counts"]["backward"] == {"all_gather": 3, "reduce_scatter": 4}, rank
        assert torch.isfinite(got["loss"]) and torch.equal(got["loss"], ref["loss"]), rank
        assert list(got["grads"]) == list(ref["grads"]) and got["grads"], rank
        for name, grad in got["grads"].items():
            assert torch.equal(grad, ref["grads"][name]), (rank, name)
        torch.testing.assert_close(got["loss"], res["eager_loss"])  # the collectives really communicated

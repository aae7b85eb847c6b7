"""Per-bucket ``reshard_after_forward: false`` on whole-step graphs: the backward reads the forward's gathered
parameters of that bucket instead of re-gathering them, the record and report show the memory held, and the
verifier accepts exactly that change (``overlapcfg.passes.keep_unsharded``, ``verify(reused_regathers=...)``).

Fast: hand-built joint graphs (``synthetic.joint_graph``). Slow: torchtitan's Llama3 whole-step graph through the
registered pipeline (checked by ``tests/support/checker.py`` against the original graph's own annotations) and one step
on 2 gloo ranks, bit for bit against the untransformed graph, with and without the optimizer traced in.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import fx

from overlapcfg import OverlapVerificationError, compat, load_config
from overlapcfg.graph.verify import summarize, verify
from overlapcfg.passes import apply
from overlapcfg.report.bucket_table import bucket_table
from tests.support.rank_warmup import preloaded
from tests.support.synthetic import DIM, joint_graph

_AG = compat.ALL_GATHER_INTO_TENSOR


def _keep(*kept: str, setting: object = False, regather: bool = True, write_shard: int | None = None,
          depth: int = 1) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A two-layer joint graph (one parameter per layer) and a copy with ``kept`` buckets' setting applied."""
    built = joint_graph([[2], [1]], regather=regather, write_shard=write_shard)
    buckets = [{"modules": [name], "reshard_after_forward": setting} if name in kept else name
               for name in ("layers.0", "layers.1")]
    cfg = load_config({"plan": {"buckets": buckets}, "policy": {"forward_prefetch": depth,
                                                                "backward_prefetch": depth}})
    original = copy.deepcopy(built.gm)
    with compat.fake_process_group(2):
        return original, apply(built.gm, cfg, module_fqns=built.module_fqns, graph_kind="joint")


def _gathers_of(gm: fx.GraphModule, shard: str, backward: bool) -> list[fx.Node]:
    """All-gathers (merged or not) whose copy-in reads ``shard``, in forward or backward."""
    out = []
    for node in gm.graph.nodes:
        if node.target not in (_AG, compat.ALL_GATHER_INTO_TENSOR_OUT):
            continue
        seen, stack, found = set(), list(node.all_input_nodes), False
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            found |= n.name == shard
            stack.extend(n.all_input_nodes)
        if found and bool(node.meta.get("autograd_backward")) == backward:
            out.append(node)
    return out


def test_a_kept_bucket_is_not_gathered_again_in_backward_and_the_memory_held_is_recorded() -> None:
    original, gm = _keep("layers.1")
    assert len(_gathers_of(original, "param_1", backward=True)) == 1
    assert _gathers_of(gm, "param_1", backward=True) == []  # layers.1: the forward's gather serves the backward
    assert len(_gathers_of(gm, "param_1", backward=False)) == 1
    assert len(_gathers_of(gm, "param_0", backward=True)) == 1  # layers.0 is resharded as traced
    record = gm.meta["overlapcfg"]
    kept, other = record.buckets[1], record.buckets[0]
    assert (kept.name, kept.reshard_after_forward, other.reshard_after_forward) == ("layers.1", False, None)
    assert kept.held_bytes == 2 * 1 * DIM * 4 and other.held_bytes == 0  # 2 ranks x 1 row x DIM fp32
    assert kept.changes("backward", "all_gather").before == 1 and kept.changes("backward", "all_gather").after == 0
    assert record.after.get("backward", "all_gather") == 1


def test_the_report_table_shows_the_memory_held() -> None:
    _, gm = _keep("layers.1")
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(bucket_table("t", gm.meta["overlapcfg"].buckets,
                                                                       world_size=2))
    text = out.getvalue()
    assert "held" in text.splitlines()[1] and "32 B" in text
    assert "held: unsharded bytes kept from the forward gather to the backward" in text


def test_verification_accepts_exactly_the_named_regathers() -> None:
    original, gm = _keep("layers.1")
    before = summarize(original)
    regather = _gathers_of(original, "param_1", backward=True)[0].name
    forward = _gathers_of(original, "param_1", backward=False)[0].name
    verify(before, gm, reused_regathers={regather})
    with pytest.raises(OverlapVerificationError, match=r"param_1 is all-gathered 1 times in .*, was 2"):
        verify(before, gm)
    with pytest.raises(OverlapVerificationError,
                       match=f"{forward}: reported as a removed backward re-gather, but before the pass it was a "
                             "forward all_gather"):
        verify(before, gm, reused_regathers={regather, forward})


def test_verification_rejects_a_backward_reader_moved_to_another_parameters_gather() -> None:
    """Naming the removed re-gather relaxes nothing else: a reader that now reads other elements still fails."""
    original, gm = _keep("layers.0", "layers.1")
    regathers = {n.name for s in ("param_0", "param_1") for n in _gathers_of(original, s, backward=True)}
    verify(summarize(original), gm, reused_regathers=regathers)
    # The backward transposes of each layer's weight now read a forward node (the weight split off its bucket).
    reads = {n: n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.t.default
             and n.meta.get("autograd_backward") and not n.args[0].meta.get("autograd_backward")}
    assert len(set(reads.values())) == 2, reads
    reader, weight = next(iter(reads.items()))
    other = next(w for w in reads.values() if w is not weight)
    reader.replace_input_with(weight, other)  # reads the other layer's forward-gathered weight instead
    with pytest.raises(OverlapVerificationError, match=r"reads .*; before it read"):
        verify(summarize(original), gm, reused_regathers=regathers)


def test_a_write_to_the_shard_between_the_gathers_keeps_the_regather_and_says_why() -> None:
    _, gm = _keep("layers.0", write_shard=0)
    assert len(_gathers_of(gm, "param_0", backward=True)) == 1
    record = gm.meta["overlapcfg"]
    assert record.buckets[0].held_bytes == 0
    assert any("bucket layers.0 keeps 1 backward re-gather(s)" in n and "add__tensor writes the shard param_0" in n
               for n in record.notes), record.notes


def test_a_regather_of_other_elements_than_the_forwards_is_kept_and_says_why() -> None:
    """The backward gathers a bf16 cast of the shard, the forward the fp32 shard: not the same elements."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    built = joint_graph([[2], [1]])
    start = next(n for n in built.gm.graph.nodes if n.target is _AG and n.meta.get("autograd_backward")
                 and n.args[0].name == "param_0")
    wait = next(iter(start.users))
    graph = built.gm.graph
    with graph.inserting_before(start):
        cast = graph.call_function(torch.ops.prims.convert_element_type.default, (start.args[0], torch.bfloat16))
    start.replace_input_with(start.args[0], cast)
    with graph.inserting_after(wait):
        back = graph.call_function(torch.ops.prims.convert_element_type.default, (wait, torch.float32))
    wait.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    for node in (cast, back):
        node.meta.update(autograd_backward=True, custom={"module_fqn": "layers.0.wq"})
    inputs = [n.meta["val"] for n in graph.find_nodes(op="placeholder")]
    FakeTensorProp(built.gm, inputs[0].fake_mode).propagate_dont_convert_inputs(*inputs)
    built.gm.recompile()
    cfg = load_config({"plan": {"buckets": [{"modules": ["layers.0"], "reshard_after_forward": False}, "layers.1"]}})
    with compat.fake_process_group(2):
        gm = apply(built.gm, cfg, module_fqns=built.module_fqns, graph_kind="joint")
    assert len(_gathers_of(gm, "param_0", backward=True)) == 1
    assert any("keeps 1 backward re-gather(s)" in n and "gathers other elements than the forward's" in n
               for n in gm.meta["overlapcfg"].notes), gm.meta["overlapcfg"].notes


@pytest.mark.parametrize(("setting", "regather", "said"), [
    (True, False, "is ignored for bucket layers.0: this graph has no backward re-gather of it"),
    (False, False, "bucket layers.0 has no backward re-gather in this graph; its parameters already stay unsharded"),
    (2, True, "= 2 is ignored for bucket layers.0: resharding to groups of ranks applies to overlapcfg.fully_shard"),
])
def test_a_setting_that_cannot_act_on_this_graph_is_said(setting: object, regather: bool, said: str) -> None:
    original, gm = _keep("layers.0", setting=setting, regather=regather)
    notes = gm.meta["overlapcfg"].notes
    assert any(n.startswith("overlap.plan.buckets[0].reshard_after_forward") and said in n for n in notes), notes
    assert len(_gathers_of(gm, "param_0", backward=True)) == len(_gathers_of(original, "param_0", backward=True))
    assert gm.meta["overlapcfg"].buckets[0].held_bytes == 0


# --- torchtitan's whole-step graph ---------------------------------------------------------------------------------

KEPT_PLAN = {"buckets": ["tok_embeddings", "layers.0", {"modules": ["layers.1"], "reshard_after_forward": False},
                         ["norm", "lm_head"]], "require_full_coverage": True}


def _param_bytes(original: fx.GraphModule, bucket: str) -> int:
    """Unsharded bytes of ``bucket``'s parameters, from the original graph's forward gathers and their owners."""
    from tests.support.checker import torchtitan_bucket

    total = 0
    for node in original.graph.nodes:
        if node.target is _AG and not node.meta.get("autograd_backward") \
                and torchtitan_bucket(node.meta["custom"]["module_fqn"]) == bucket:
            val = node.meta["val"]
            total += val.numel() * val.element_size()
    return total


@pytest.mark.slow
@pytest.mark.parametrize("reshard", ["always", "never"])
def test_torchtitan_pipeline_keeps_a_bucket_unsharded_from_a_config_file(
        whole_step: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, reshard: str) -> None:
    from tests.support.checker import joint_order
    from tests.support.torchtitan_pipeline import check_joint, run_registered

    path = tmp_path / "overlap.yaml"
    path.write_text(load_config({"plan": KEPT_PLAN, "policy": "aggressive"}).to_yaml())
    monkeypatch.setenv("OVERLAPCFG_CONFIG", str(path))
    step = whole_step("llama3", reshard, False)
    gm = run_registered(step)
    check_joint(gm, step.gm, 2, kept=("layers.1",))
    record = gm.meta["overlapcfg"]
    kept = record.buckets[2]
    if reshard == "always":
        assert len(joint_order(step.gm, "all_gather", "backward")["layers.1"]) == 7
        assert kept.held_bytes == _param_bytes(step.gm, "layers.1") > 0
        assert kept.changes("backward", "all_gather").before == 7
    else:
        assert kept.held_bytes == 0
        assert any("its parameters already stay unsharded" in n for n in record.notes), record.notes


def kept_transform(gm: fx.GraphModule, cfg: dict[str, Any]) -> fx.GraphModule:
    """The parity worker's transform (runs on each gloo rank): overlapcfg with one bucket kept unsharded."""
    return apply(gm, load_config(cfg), graph_kind="joint")


@pytest.mark.slow
def test_a_kept_bucket_is_bitwise_identical_on_two_gloo_ranks() -> None:
    from overlapcfg.demo.gloo import run_on_gloo
    from tests.thirdparty import graph_trainer as G

    cfg = {"plan": KEPT_PLAN, "policy": "aggressive"}
    jobs = [("llama3", "always", False, cfg), ("llama3", "always", True, cfg)]
    results = run_on_gloo(G.whole_step_parity_worker, jobs, kept_transform, world_size=2, timeout_s=420,
                          preload=preloaded(__name__))
    for rank, per_job in enumerate(results):
        for name, res in per_job.items():
            ref, got = res["reference"], res["transformed"]
            assert ref["collectives"]["all_gather_into_tensor"] == 32, (rank, name)
            assert got["collectives"]["all_gather_into_tensor_out"] == 4 + 2, (rank, name)  # layers.1: no re-gather
            assert torch.isfinite(got["loss"]) and torch.equal(got["loss"], ref["loss"]), (rank, name)
            assert len(got["outputs"]) == len(ref["outputs"])
            assert all(torch.equal(a, b) for a, b in zip(got["outputs"], ref["outputs"], strict=True)), (rank, name)
            assert list(got["params"]) == list(ref["params"])
            assert all(torch.equal(got["params"][p], ref["params"][p]) for p in ref["params"]), (rank, name)
            if name.endswith("optim"):  # the optimizer step really ran: parameters changed
                assert got["params"]


def _kept_result() -> str:
    """``RESULT <sha256 of the code> <bytes held>`` for layers.0 and layers.2 kept unsharded in a 3-layer joint
    graph at depth 2 (a hand-built graph: no trace), in whatever process calls it."""
    import hashlib

    built = joint_graph([[2, 1], [1, 3], [2]])
    kept = {"reshard_after_forward": False}
    buckets = [{"modules": ["layers.0"], **kept}, "layers.1", {"modules": ["layers.2"], **kept}]
    cfg = load_config({"plan": {"buckets": buckets},
                       "policy": {"forward_prefetch": 2, "backward_prefetch": 2, "reduce_scatter_delay": 2}})
    with compat.fake_process_group(2):
        gm = apply(built.gm, cfg, module_fqns=built.module_fqns, graph_kind="joint")
    held = sum(b.held_bytes for b in gm.meta["overlapcfg"].buckets)
    return f"RESULT {hashlib.sha256(gm.code.encode()).hexdigest()} {held}"


_SEEDED = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.passes.test_keep_unsharded import _kept_result
print(_kept_result())
"""


@pytest.mark.slow
def test_keeping_buckets_is_the_same_whatever_the_hash_seed() -> None:
    """A process of an interpreter with another hash seed than this process's (``tests/support/warm_cli.shared``:
    forked, it keeps that interpreter's seed) emits this process's code: one other process, two seeds."""
    import sys

    from tests.support.warm_cli import shared

    repo = str(Path(__file__).resolve().parents[2])  # on sys.path there: ``tests`` is a package
    proc = shared().start([sys.executable, "-c", _SEEDED, repo], cwd=Path.cwd())
    here = _kept_result()  # while the other process runs
    done = proc.result(timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    there = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert there == here
    assert here.split()[2] == str(2 * (2 + 1 + 2) * DIM * 4)  # layers.0 and layers.2 held, 2 ranks, fp32

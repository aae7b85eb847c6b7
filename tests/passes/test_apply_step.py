"""``apply_step``: a config applied to copies of a captured step, the one entry point explain, compare and tune use;
``explain`` as a function of its result, its bucket facts read from the pass records."""

from __future__ import annotations

import copy

import pytest
import torch

from overlapcfg import compat, load_config
from overlapcfg.graph import verify as verify_module
from overlapcfg.passes import AppliedStep, apply, apply_step
from overlapcfg.passes import applied as applied_module
from overlapcfg.report import explain
from tests.support.synthetic import DIM, captured_step, forward_graph

LAYERS = [[1, 2], [2], [1, 1]]
CFG = load_config({"plan": {"buckets": ["layers.*"]}})


def test_apply_step_transforms_copies_and_leaves_the_step_as_it_was() -> None:
    step = captured_step(LAYERS)
    codes = {name: step.graph(name).code for name in ("forward", "backward")}
    applied = apply_step(step, CFG)
    assert applied.names == ("forward", "backward")
    for name in ("forward", "backward"):
        graph = applied.graph(name)
        assert graph.original is step.graph(name) and graph.graph is not graph.original
        assert graph.record.before.total_fsdp > graph.record.after.total_fsdp  # merged
        assert step.graph(name).code == codes[name]


def test_the_copies_code_is_that_of_the_transformed_graph() -> None:
    """The copies write their Python code when first read or called: it must be the transformed graph's."""
    step = captured_step(LAYERS)
    applied = apply_step(step, CFG)
    with compat.fake_process_group(2, 0):
        direct = apply(copy.deepcopy(step.forward), CFG, module_fqns=step.module_fqns, graph_kind="forward")
    assert applied.graph("forward").graph.code == direct.code


def test_the_untransformed_graphs_are_summarized_once_for_every_config(monkeypatch: pytest.MonkeyPatch) -> None:
    step = captured_step(LAYERS)
    calls: list[str] = []
    real = verify_module.summarize

    def counting(gm: object, *, direction: str | None = None) -> object:
        calls.append(str(direction))
        return real(gm, direction=direction)  # type: ignore[arg-type]

    monkeypatch.setattr(applied_module, "summarize", counting)
    apply_step(step, CFG)
    apply_step(step, load_config({"plan": {"buckets": ["layers.*"]}, "policy": {"forward_prefetch": 2}}))
    assert calls == ["forward", "backward"]
    # A captured graph edited in place since is summarized again (the cache keys on its nodes).
    node = next(n for n in step.forward.graph.nodes if n.target is torch.ops.aten.mm.default)
    with step.forward.graph.inserting_after(node):
        step.forward.graph.call_function(torch.ops.aten.clone.default, (node,)).meta["val"] = node.meta["val"]
    apply_step(step, CFG)
    assert calls == ["forward", "backward", "forward"]


def test_explain_is_a_function_of_the_applied_step() -> None:
    step = captured_step(LAYERS)
    applied = apply_step(step, CFG)
    direct, of_applied = explain(step, CFG), explain(applied)
    assert of_applied.buckets == direct.buckets
    assert [g.order for g in of_applied.graphs] == [g.order for g in direct.graphs]
    with pytest.raises(TypeError, match="carries the config"):
        explain(applied, CFG)
    assert isinstance(applied, AppliedStep)


def test_explain_reads_bucket_sizes_from_the_pass_records_even_for_a_step_built_by_hand() -> None:
    """A ``CapturedStep`` built without a tracer names no collective owners; the pass still saw every bucket's
    all-gathers, so the report's sizes are the model's (before: 0 bytes, read from the missing owner list)."""
    step = captured_step(LAYERS)
    layer_bytes = forward_graph(LAYERS).layer_bytes
    report = explain(step, CFG)
    for i, nbytes in enumerate(layer_bytes):
        bucket = report.bucket(f"layers.{i}")
        assert bucket.param_count == len(LAYERS[i])
        assert bucket.unsharded_bytes == nbytes
        assert bucket.numel == nbytes // 4 == sum(2 * rows * DIM for rows in LAYERS[i])
        assert bucket.sharded_bytes == nbytes // 2

"""Negative controls for ``overlapcfg.graph.verify``: hand-made breakages of correctly bucketed graphs are each
rejected with a message naming the node, parameter or gradient at fault, and every valid bucket mode is accepted.

Each breakage starts from a fresh copy of a graph the pass produced (and verified) and changes one thing a buggy
bucketer or scheduler could: a group name, a group size, a reduce op, a dtype, which parameter fills a slot of a
merged buffer, which slice a consumer reads, a wait, a duplicated or dropped collective; and writes: an in-place
copy into a gathered slice or a parameter shard, an in-place op (by schema) into a slice, a reader moved past an
in-place write (and a write moved before a reader), graph inputs swapped under their old names, an index dropped
from the copy-in's ``foreach_group_indices``, the next bucket's all-gather filling a buffer still being read, a
gradient written while its reduce-scatter is in flight. The ``stepped`` graphs carry an optimizer-like in-place
update of two parameters (``with_in_place_updates``) before the pass, as whole-step graphs do. The traces are the
session's (``tests.support.traces``), the breakages ``tests.support.breakages``'s; each good graph is built once per
module and deep-copied per breakage.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.demo.tracing import TracedStep
from overlapcfg.errors import OverlapVerificationError
from overlapcfg.graph.verify import summarize, verify
from tests.support import breakages as B
from tests.support.breakages import BREAKAGES, Breaker
from tests.support.in_place import with_in_place_updates
from tests.support.traces import apply_to

pytestmark = pytest.mark.slow  # every test here uses the traced demo step (dynamo)

_aten = torch.ops.aten
MERGED = {"plan": "llama_layers"}
PARTIAL = {"plan": {"buckets": ["layers.*"]}}
"""tok_embeddings, norm and output stay outside the plan: their collectives stay plain (unmerged)."""
COALESCED = {"plan": "llama_layers", "policy": {"bucket_mode": "coalesced"}}
_CONFIGS = {"merged": MERGED, "partial": PARTIAL, "coalesced": COALESCED, "stepped": MERGED}

def stepped(step: TracedStep) -> TracedStep:
    """``step`` with ``with_in_place_updates`` applied to copies of both graphs (everything else shared)."""
    graphs = {g: with_in_place_updates(copy.deepcopy(step.graph(g))) for g in ("forward", "backward")}
    return dataclasses.replace(step, forward=graphs["forward"], backward=graphs["backward"])


@pytest.fixture(scope="module")
def good(traced_2l_reshard: TracedStep) -> Callable[[str, str], tuple[fx.GraphModule, fx.GraphModule]]:
    """``good(graph, config)``: (the graph the pass was given, a fresh deep copy of its verified output), on the
    2-layer reshard trace (with in-place updates for ``stepped``)."""
    built: dict[tuple[str, str], tuple[fx.GraphModule, fx.GraphModule]] = {}
    updated = stepped(traced_2l_reshard)

    def fresh(graph: str, config: str) -> tuple[fx.GraphModule, fx.GraphModule]:
        if (graph, config) not in built:
            step = updated if config == "stepped" else traced_2l_reshard
            built[(graph, config)] = (step.graph(graph), apply_to(step, graph, _CONFIGS[config]))  # type: ignore[arg-type]
        before, after = built[(graph, config)]
        return before, copy.deepcopy(after)

    return fresh


@pytest.mark.parametrize(("graph", "config", "breaker"), BREAKAGES,
                         ids=[f"{b.__name__}-{g}" for g, _, b in (getattr(p, "values", p) for p in BREAKAGES)])
def test_breakage_is_rejected_naming_the_culprit(good: Any, graph: str, config: str, breaker: Breaker) -> None:
    before, gm = good(graph, config)
    expected = breaker(gm)
    assert expected, f"{breaker.__name__} names nothing to expect"
    with pytest.raises(OverlapVerificationError) as info:
        verify(before, gm, direction=graph)
    problems = "\n".join(info.value.problems)
    for pattern in expected:
        assert re.search(pattern, problems), f"{pattern!r} not in:\n{problems}"


MESH_BREAKAGES: list[Any] = [
    ("forward", B.copy_into_a_gathered_slice),
    ("forward", B.in_place_op_into_a_gathered_slice),
    ("forward", B.copy_into_a_parameter_shard),
    ("forward", B.inputs_swapped_under_their_names),
    ("forward", B.foreach_group_index_dropped),
    ("forward", B.next_all_gather_into_a_buffer_still_read),
    ("backward", B.gradient_written_while_its_reduce_scatter_is_in_flight),
    ("forward", B.reader_moved_after_an_in_place_write),
    ("forward", B.in_place_write_moved_before_the_gather),
]
"""The write and identity breakages, on HSDP (both chain orders) and FSDP + TP pass outputs; the last two on the
graphs with in-place updates. Forward graphs where a breakage needs all-gathers: the reduce-scatter-first HSDP
variant keeps parameters gathered (no backward all-gathers)."""


@pytest.mark.parametrize("variant", ["hsdp_all_reduce_first", "hsdp_reduce_scatter_first", "tp"])
def test_write_and_identity_breakages_of_mesh_graphs_are_rejected(variant: str) -> None:
    from overlapcfg import load_config
    from overlapcfg.passes import apply
    from tests.support.fuzz import trace_variant

    step = trace_variant(variant)
    updated = stepped(step)
    for graph, breaker in MESH_BREAKAGES:
        source = updated if breaker in (B.reader_moved_after_an_in_place_write,
                                        B.in_place_write_moved_before_the_gather) else step
        before = source.graph(graph)
        with source.process_groups():
            gm = apply(copy.deepcopy(before), load_config(MERGED), module_fqn_fn=source.module_fqn_fn(graph),
                       module_fqns=source.module_fqns, graph_kind=graph)
        expected = breaker(gm)
        with pytest.raises(OverlapVerificationError) as info:
            verify(before, gm, direction=graph)
        problems = "\n".join(info.value.problems)
        for pattern in expected:
            assert re.search(pattern, problems), f"{breaker.__name__}: {pattern!r} not in:\n{problems}"


# --- valid graphs are never rejected --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["default", "custom_ops", "custom_ops_multidtype", "coalesced"])
@pytest.mark.parametrize("reshard", [False, True], ids=["keep", "reshard"])
@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_every_bucket_mode_verifies(traced_2l: TracedStep,
                                    traced_2l_reshard: TracedStep, mode: str, reshard: bool, graph: str) -> None:
    step = traced_2l_reshard if reshard else traced_2l
    before = summarize(step.graph(graph), direction=graph)  # type: ignore[arg-type]
    for strategy in ("manual", "torch_manual"):
        gm = apply_to(step, graph, {"strategy": strategy, "plan": "llama_layers",  # type: ignore[arg-type]
                                    "policy": {"bucket_mode": mode}, "verify": False})
        assert verify(before, gm, direction=graph) is None


@pytest.mark.parametrize("mode", ["default", "custom_ops", "coalesced"])
@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_in_place_updates_the_original_made_verify_in_every_bucket_mode(traced_2l_reshard: TracedStep, mode: str,
                                                                        graph: str) -> None:
    """A whole-step graph writes parameters in place after reading them: the pass keeps every read on its side of
    the write, and the verifier sees the same writes in the same order, so it raises nothing."""
    step = stepped(traced_2l_reshard)
    for strategy in ("manual", "torch_manual"):
        for policy in ({"bucket_mode": mode}, {"bucket_mode": mode, "forward_prefetch": 2, "backward_prefetch": 2,
                                                "insert_overlap_deps": True}):
            if strategy == "torch_manual" and "forward_prefetch" in policy:
                continue
            gm = apply_to(step, graph, {"strategy": strategy, "plan": "llama_layers",  # type: ignore[arg-type]
                                        "policy": policy, "verify": False})
            assert verify(step.graph(graph), gm, direction=graph) is None  # type: ignore[arg-type]


def test_control_deps_wrapped_waits_verify(traced_2l_reshard: TracedStep) -> None:
    for graph in ("forward", "backward"):
        gm = apply_to(traced_2l_reshard, graph, {"plan": "llama_layers",  # type: ignore[arg-type]
                                                 "policy": {"insert_overlap_deps": True}, "verify": False})
        assert any(n.target is not compat.unwrap_control_deps(n)[0] for n in gm.graph.nodes)
        assert verify(traced_2l_reshard.graph(graph), gm, direction=graph) is None  # type: ignore[arg-type]


def test_a_graph_verifies_against_itself_and_its_summary(traced_2l_reshard: TracedStep) -> None:
    for graph in ("forward", "backward"):
        gm = traced_2l_reshard.graph(graph)  # type: ignore[arg-type]
        assert verify(gm, gm, direction=graph) is None
        assert verify(summarize(gm, direction=graph), gm, direction=graph) is None

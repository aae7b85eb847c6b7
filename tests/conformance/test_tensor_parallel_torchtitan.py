"""FSDP + tensor parallel on torchtitan's own graphs (torchtitan 0.3.0 Llama3, ``model.parallelize`` then SimpleFSDP
``data_parallel`` on a 2 x 2 ("fsdp", "tp") mesh, 4 fake ranks), through ``overlapcfg.backend``:

- tensor-parallel collectives (sequence-parallel gathers and reduce-scatters, row-parallel all-reduces, the
  tp-group reductions of weight gradients) keep their names, ops, inputs and relative order;
- only the dp group's collectives are bucketed: 17 forward all-gathers -> 4, 17 gradient reduce-scatters -> 4;
- without sequence parallel, the tp-group reduce-scatter of a row-parallel weight's gradient (followed by the
  dp-group one) is tensor parallel's, not FSDP's (torch's ``is_fsdp_reduce_scatter`` accepts both);
- the norm weights' tp all-reduce -> dp reduce-scatter chain looks like HSDP but runs on a group that carries
  activations: left alone;
- with reshard-after-forward, the backward re-gathers forward-saved *views* of the parameters (no aot descriptor
  on those placeholders): the backend reads them from the forward graph and buckets them; ``apply`` on the
  backward graph alone cannot tell: it leaves them, counts them as uncovered and says why.

Evidence and per-collective dumps: ``python -m tests.thirdparty.dump_tp``.

It runs with the rest of the suite, whatever ran before: it used to need an interpreter of its own, because DTensor's
sharding caches carried the device mesh of a TP model traced earlier in the process into this one (two meshes met
in one ``add``, mis-shaped); overlapcfg now clears them around every capture
(``tests/capture/test_one_process_many_traces.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.errors import OverlapConfigError
from overlapcfg.graph.attribution import module_fqn
from overlapcfg.graph.collectives import find_collectives, group_name, is_collective_start
from overlapcfg.passes import apply
from tests.thirdparty import conformance as C
from tests.thirdparty import models as M

pytestmark = pytest.mark.slow

GRAPHS = ("forward", "backward")
CFG = C.Case("tt_fsdp_tp", 4, "torchtitan_layers", C._tt_bucket, torchtitan="fsdp_tp").config(1)


def _compile(mode: str, reshard: bool) -> dict[str, Any]:
    with M.fake_process_group(4):
        model, make_batch = M.torchtitan_llama3(mode, reshard_after_forward=reshard)
        mesh = next(model.parameters()).device_mesh
        groups = {dim: mesh.get_group(dim).group_name for dim in mesh.mesh_dim_names}
        be, dynamo, pre = overlapcfg.backend(dict(CFG)), [], {}
        inputs, loss_fn = make_batch()
        compat.dynamo_reset()
        try:
            compiled = torch.compile(model, backend=C.spied_backend(be, dynamo, pre), fullgraph=True)
            loss_fn(compiled(*inputs)).backward()
        finally:
            compat.dynamo_reset()
        # apply on the bare backward graph, as a user holding only that graph would (nothing overlapcfg stamped)
        bare = M.copy_graph_module(pre["backward"])
        for node in bare.graph.nodes:
            node.meta = {k: v for k, v in node.meta.items() if k != "overlapcfg"}
        refused: Exception | None = None
        try:  # torchtitan_layers requires full coverage
            apply(M.copy_graph_module(bare), overlapcfg.load_config(CFG), graph_kind="backward")
        except OverlapConfigError as err:
            refused = err
        lenient = {**CFG, "plan": {"buckets": ["tok_embeddings", "layers.*", ["norm", "lm_head"]]}}
        alone = apply(bare, overlapcfg.load_config(lenient), graph_kind="backward")
    return {"pre": pre, "final": be.graphs, "groups": groups, "alone": alone, "refused": refused}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, dict[str, Any]]]:
    yield {"sp_reshard": _compile("fsdp_tp", reshard=True), "no_sp": _compile("fsdp_tp_no_sp", reshard=False)}


def _on(gm: fx.GraphModule, group: str) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n.name, str(n.target), tuple(a.name for a in n.all_input_nodes)) for n in gm.graph.nodes
            if is_collective_start(n) and group_name(n) == group]


def _counts(gm: fx.GraphModule, group: str) -> Counter[str]:
    return Counter(str(n.target).split(".")[1] for n in gm.graph.nodes
                   if is_collective_start(n) and group_name(n) == group)


@pytest.mark.parametrize("variant", ["sp_reshard", "no_sp"])
def test_tensor_parallel_collectives_are_untouched(runs: dict[str, dict[str, Any]], variant: str) -> None:
    run = runs[variant]
    tp = run["groups"]["tp"]
    for graph in GRAPHS:
        want = _on(run["pre"][graph], tp)
        assert want, f"{variant} {graph}: no tp collectives traced"
        assert _on(run["final"][graph], tp) == want
        roles = {c.role for c in find_collectives(run["final"][graph].graph, module_fqn) if c.group == tp}
        assert roles == {"other"}


@pytest.mark.parametrize("variant", ["sp_reshard", "no_sp"])
def test_only_the_dp_groups_collectives_are_bucketed(runs: dict[str, dict[str, Any]], variant: str) -> None:
    run = runs[variant]
    fsdp = run["groups"]["fsdp"]
    forward, backward = run["final"]["forward"], run["final"]["backward"]
    assert _counts(run["pre"]["forward"], fsdp) == {"all_gather_into_tensor": 17}
    assert sum(_counts(forward, fsdp).values()) == 4
    assert _counts(run["pre"]["backward"], fsdp)["reduce_scatter_tensor"] == 17
    assert _counts(backward, fsdp)["reduce_scatter_tensor"] == 4
    record = backward.meta["overlapcfg"]
    assert record.before.get("backward", "reduce_scatter") == 17  # not 21: tp halves are not FSDP's
    assert record.before.get("backward", "all_reduce") == 0  # the norm weights' tp all-reduces are not HSDP
    assert record.uncovered == ()


def test_backward_regathers_of_saved_parameter_views_are_bucketed_by_the_backend(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["sp_reshard"]
    fsdp = run["groups"]["fsdp"]
    before = _counts(run["pre"]["backward"], fsdp)
    assert before["all_gather_into_tensor"] == 16  # 11 of them read a forward-saved view, no descriptor
    after = run["final"]["backward"].meta["overlapcfg"]
    assert (after.before.get("backward", "all_gather"), after.after.get("backward", "all_gather")) == (16, 3)


def test_apply_on_the_backward_alone_counts_saved_view_gathers_as_uncovered_and_says_why(
        runs: dict[str, dict[str, Any]]) -> None:
    """The backward graph alone cannot tell a forward-saved parameter view from a saved activation: the 11
    re-gathers of such views are left alone, counted as uncovered (so ``require_full_coverage`` refuses the graph)
    and the cause is named. The tp group's sequence-parallel gathers are not FSDP-shaped traffic: not counted."""
    run = runs["sp_reshard"]
    record = run["alone"].meta["overlapcfg"]
    assert record.before.get("backward", "all_gather") == 5
    assert len(record.uncovered) == 11 and all(u.owner is None for u in record.uncovered)
    assert any("11 all-gathers look like FSDP parameter gathers" in note and "no aot descriptor" in note
               and "overlapcfg.backend" in note for note in record.notes)
    assert isinstance(run["refused"], OverlapConfigError)
    assert "require_full_coverage: 11 all-gather(s) look like FSDP parameter gathers" in str(run["refused"])

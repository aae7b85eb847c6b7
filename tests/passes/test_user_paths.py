"""The graph pass names a config's settings where the user put it: in its faults and its notes, from the config's
own ``mount`` (``load_config(..., root=...)``, ``from_hydra``), never from an argument passed down to it."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest
from torch import fx

import overlapcfg
from overlapcfg import OverlapConfigError, compat
from overlapcfg.passes import PassOptions, apply
from tests.support.synthetic import Synthetic, forward_graph

LAYERS = [[1], [2], [1, 3]]


def _apply(syn: Synthetic, cfg: overlapcfg.OverlapConfig) -> fx.GraphModule:
    with compat.fake_process_group(syn.world_size, 0):
        return apply(copy.deepcopy(syn.gm), cfg, module_fqns=syn.module_fqns, graph_kind="forward")


def _mounted(data: dict[str, Any], mount: str = "trainer.overlap") -> overlapcfg.OverlapConfig:
    return overlapcfg.load_config(data, root=mount)


def test_a_plan_fault_names_the_path_where_the_config_was_mounted() -> None:
    syn = forward_graph(LAYERS)
    with pytest.raises(OverlapConfigError) as err:
        _apply(syn, _mounted({"plan": {"buckets": ["layers.0", "layer.*"]}}))
    assert type(err.value) is OverlapConfigError
    assert [f.path for f in err.value.faults] == ["trainer.overlap.plan.buckets[1]"]
    assert "did you mean 'layers.*'" in str(err.value)


def test_a_config_read_from_a_file_is_named_with_the_faults_the_pass_finds(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("plan:\n  buckets: [layer.*]\n")
    with pytest.raises(OverlapConfigError) as err:
        _apply(forward_graph(LAYERS), overlapcfg.load_config(path))
    assert [f.path for f in err.value.faults] == ["overlap.plan.buckets[0]"]
    assert str(path) in str(err.value).splitlines()[0]


def test_notes_about_settings_name_them_where_the_config_was_mounted() -> None:
    syn = forward_graph(LAYERS)
    gm = _apply(syn, _mounted({"strategy": "none", "plan": {"buckets": ["layers.*"]},
                               "policy": {"forward_prefetch": 3}}))
    assert gm.meta["overlapcfg"].notes == ("trainer.overlap.plan is ignored: strategy 'none' does not bucket by plan",
                                           "trainer.overlap.policy is ignored: strategy 'none' reads no policy")
    gm = _apply(syn, _mounted({"plan": {"buckets": [{"modules": ["layers.*"], "reshard_after_forward": False}]}}))
    assert gm.meta["overlapcfg"].notes == (
        "trainer.overlap.plan.buckets[0].reshard_after_forward is ignored: aot's separate forward graph cannot reach "
        "the other graph's gathered parameters (it applies to whole-step graphs and to overlapcfg.fully_shard)",)


def test_the_record_is_the_same_wherever_the_config_was_mounted_but_for_its_notes() -> None:
    """Where each depth came from is a path from the config node (``overrides[0]``, like ``policy``): two users
    mounting one config at different places get equal buckets."""
    syn = forward_graph(LAYERS)
    data = {"plan": {"buckets": ["layers.*"]}, "overrides": [{"match": "layers.1", "forward_prefetch": 0}]}
    records = [_apply(syn, _mounted(data, mount)).meta["overlapcfg"] for mount in ("overlap", "trainer.overlap")]
    assert records[0].buckets == records[1].buckets
    assert records[0].buckets[1].origin("forward_prefetch") == "overrides[0]"


def test_apply_takes_six_parameters_each_documented() -> None:
    """Issue 38: it took eleven, four of them optimisations for particular callers (now ``PassOptions``), and
    ``config_root``, which the config carries."""
    params = inspect.signature(apply).parameters
    assert list(params) == ["gm", "cfg", "graph_kind", "module_fqns", "module_fqn_fn", "options"]
    doc = inspect.getdoc(apply) or ""
    assert all(f"``{name}``" in doc for name in params)
    fields = inspect.signature(PassOptions).parameters
    assert all(f"``{name}``" in doc for name in fields)


def test_a_hydra_node_given_as_it_is_names_faults_at_its_own_path() -> None:
    """``explain(step, cfg.trainer.overlap)``, ``backend(cfg.trainer.overlap)``: the entry points load a node with
    ``load_config``, which read ``overlap.plan...`` whatever the node's place; the node says where it sits."""
    from omegaconf import OmegaConf

    node = OmegaConf.create({"trainer": {"overlap": {"plan": {"buckets": ["layers.0", "layer.*"]}}}}).trainer.overlap
    assert overlapcfg.load_config(node).mount.path == "trainer.overlap"
    with pytest.raises(OverlapConfigError) as err:
        _apply(forward_graph(LAYERS), overlapcfg.load_config(node))
    assert [f.path for f in err.value.faults] == ["trainer.overlap.plan.buckets[1]"]
    bad = OmegaConf.create({"trainer": {"overlap": {"plan": "llama_layers", "policy": {"forward_prefetch": -1}}}})
    with pytest.raises(OverlapConfigError) as err:
        overlapcfg.load_config(bad.trainer.overlap)
    assert [f.path for f in err.value.faults] == ["trainer.overlap.policy.forward_prefetch"]
    assert overlapcfg.load_config(node, root="mine").mount.path == "mine"  # a root given still wins

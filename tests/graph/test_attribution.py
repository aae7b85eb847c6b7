"""Attribution that does not depend on who traced the graph: paths of any dynamo root, wrapper noise, descriptors,
and disagreement as an error. Fast: hand-built nodes and descriptors, no tracing."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._functorch._aot_autograd.descriptors import (  # the descriptors aot writes on graph inputs/outputs
    GradAOTOutput,
    PlainAOTInput,
    SubclassGetAttrAOTInput,
    SubclassGetAttrAOTOutput,
)

from overlapcfg.graph import attribution
from overlapcfg.graph.attribution import (
    AttributionError,
    annotate_owners,
    clean_path,
    custom_module_fqn,
    module_fqn,
    stack_module_fqn,
)


@pytest.mark.parametrize("path, fqn", [
    ("L['self'].layers.0.attention", "layers.0.attention"),
    # Hugging Face: a decorated forward taking *args makes the root L['args'][0]
    ("L['args'][0].model.layers.0.self_attn", "model.layers.0.self_attn"),
    ("L['kwargs']['model'].layers.3.mlp", "layers.3.mlp"),
    ("G['model'].layers.1", "layers.1"),
    # torchtitan's annotate_fn wraps forward in a closure
    ("L['self'].layers.0.forward.__closure__[1].cell_contents.__self__.attention", "layers.0.attention"),
    # dynamo sources of parameters
    ("L['self']._modules['layers']._modules['0']._modules['wq']._parameters['weight']", "layers.0.wq.weight"),
    ("L['args'][0]._modules['model']._modules['embed_tokens']._modules['parametrizations']._modules['weight']"
     "._parameters['original']", "model.embed_tokens.weight"),
    # wrappers and parametrization modules
    ("L['self']._orig_mod.layers.0._checkpoint_wrapped_module.attention", "layers.0.attention"),
    ("L['args'][0].model.layers.0.self_attn.q_proj.parametrizations.weight.0", "model.layers.0.self_attn.q_proj"),
    ("L['self']", ""),
])
def test_clean_path_accepts_any_dynamo_root_and_strips_wrapper_noise(path: str, fqn: str) -> None:
    assert clean_path(path) == fqn


@pytest.mark.parametrize("path", [
    # torchtitan's class-property parametrization: names the FIRST module of the class, not this one
    "dict(type(L['self'].layers.0.attention.qkv_linear.wqkv).__dict__)['weight'].fget.__closure__[0].cell_contents",
    "getattr(L['self'], 'x').y",
])
def test_clean_path_refuses_what_is_not_a_module_path(path: str) -> None:
    assert clean_path(path) is None


def _node(graph: fx.Graph, name: str, **meta: object) -> fx.Node:
    node = graph.call_function(torch.ops.aten.relu.default, ())
    node.name = name
    node.meta.update(meta)
    return node


def test_stack_attribution_skips_entries_that_are_not_module_paths() -> None:
    graph = fx.Graph()
    stack = {
        "1": ("L['self'].layers.0", object),
        "2": ("L['self'].layers.0.forward.__closure__[1].cell_contents.__self__.attention", object),
        "3": ("dict(type(L['self'].layers.0.attention.wq).__dict__)['weight'].fget", object),
    }
    node = _node(graph, "ag", nn_module_stack=stack)
    assert stack_module_fqn(node) == "layers.0.attention"


def test_backward_nodes_read_the_forward_stack() -> None:
    node = _node(fx.Graph(), "rs", fwd_nn_module_stack={"1": ("L['args'][0].lm_head", object)})
    assert stack_module_fqn(node) == "lm_head"


def test_custom_module_fqn_wins_over_the_stack() -> None:
    node = _node(fx.Graph(), "ag", custom={"module_fqn": "layers.1.feed_forward"},
                 nn_module_stack={"1": ("L['self'].layers.0", object)})
    assert custom_module_fqn(node) == "layers.1.feed_forward"
    assert module_fqn(node) == "layers.1.feed_forward"


def test_no_evidence_is_none_not_a_guess() -> None:
    assert module_fqn(_node(fx.Graph(), "ag")) is None


def _gather_graph(desc: object, custom: str | None = None) -> fx.GraphModule:
    """``primal -> all_gather -> wait -> output`` with ``desc`` on the primal (as aot writes it)."""
    graph = fx.Graph()
    primal = graph.placeholder("primals_1")
    primal.meta["desc"] = desc
    primal.meta["val"] = torch.empty(4, 8)
    ag = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (primal, 2, "0"))
    if custom is not None:
        ag.meta["custom"] = {"module_fqn": custom}
    wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ag,))
    graph.output((wait,))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_dtensor_shards_are_mapped_through_their_subclass_descriptor_to_the_dynamo_input() -> None:
    """Each DTensor parameter is two flat aot inputs; the descriptor's base index is the dynamo input's."""
    desc = SubclassGetAttrAOTInput(base=PlainAOTInput(idx=3), attr="_local_tensor")
    gm = _gather_graph(desc)
    inputs = (None, "tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wo.weight")
    (owner,) = annotate_owners(gm, "forward", inputs)
    assert (owner.param_fqn, owner.module_fqn) == ("layers.0.attention.wo.weight", "layers.0.attention.wo")
    assert module_fqn(next(n for n in gm.graph.nodes if n.name == owner.node)) == "layers.0.attention.wo"


def test_a_descriptor_contradicted_by_custom_metadata_is_an_error_naming_both() -> None:
    gm = _gather_graph(PlainAOTInput(idx=1), custom="layers.7.feed_forward")
    with pytest.raises(AttributionError, match=r"'layers.0.attention.wq'.*'layers.7.feed_forward'"):
        annotate_owners(gm, "forward", (None, "layers.0.attention.wq.weight"))


def test_collectives_the_descriptors_do_not_tie_to_a_parameter_are_left_unannotated() -> None:
    """A gather of a non-parameter input (an activation in tensor parallelism) is not ours to attribute."""
    gm = _gather_graph(PlainAOTInput(idx=0))
    assert annotate_owners(gm, "forward", (None, "w")) == ()


def test_gradient_outputs_are_unwrapped_like_inputs() -> None:
    out = SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=PlainAOTInput(idx=2)), attr="_local_tensor")
    assert attribution._grad_root_index(out) == 2

"""One compile serving an untransformed reference and any number of configs: the parity harness.

The parity tests (``tests/multiprocess/test_parity.py``, the mixed-precision parity, the mesh parity) compare the
step the pass produced with the step torch traced, bit for bit, on real gloo ranks. What they prove is about the
rewritten graphs, so every config is applied to its own copy of one capture (``Variants``) instead of compiling the
model again per config: dynamo's trace and aot's capture are most of a compile, and they were most of the suite's
time. The production route, ``overlapcfg.backend(cfg)`` compiling the model per config, keeps its own bitwise gloo
parity in the conformance suite (``tests/thirdparty/conformance.parity_worker``, Hugging Face and torchtitan models).

A harness that switches graphs must prove it runs the one it says: ``TAMPERED`` is the reference with one
forward output doubled, so a step run under it must differ from the reference (``assert_tampered_differs``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.config import OverlapConfig
from overlapcfg.passes import apply
from overlapcfg.passes.backend import GraphBackend, GraphName

__all__ = ["REFERENCE", "TAMPERED", "Variants", "assert_tampered_differs"]

REFERENCE = "reference"
TAMPERED = "tampered"
"""The reference graphs with the forward's first output (the model's output) doubled: a step that must differ."""


@dataclass(slots=True)
class Variants:
    """A ``torch.compile`` backend that traces once and can run the untransformed graphs or any config's.

    aot's forward and backward graphs (owners stamped, as ``overlapcfg.passes.compile.backend`` hands them to the
    pass) are kept as the reference; each config is applied to its own copy with ``overlapcfg.passes.apply``
    exactly as that backend does (``module_fqns`` of the compiled region, eager compiler). The compiled step runs
    the graphs of ``selected``. Forward and backward of one variant share their saved-tensor layout (the pass keeps
    outputs), so a step run under one ``selected`` is that variant's step. Parity then compares the pass against
    the same aot graphs, and a spawned rank pays one compile for all configs. ``graphs[graph][name]`` holds each
    variant's graph (with its ``PassRecord`` in ``meta["overlapcfg"]``) once the step has run.
    """

    configs: Mapping[str, Any]
    selected: str = REFERENCE
    graphs: dict[GraphName, dict[str, fx.GraphModule]] = field(default_factory=dict)
    backend: GraphBackend = field(init=False)
    _loaded: dict[str, OverlapConfig] = field(init=False)

    def __post_init__(self) -> None:
        if REFERENCE in self.configs or TAMPERED in self.configs:
            raise ValueError(f"Variants: {REFERENCE!r} and {TAMPERED!r} are the harness's own variants")
        self._loaded = {name: load_config(cfg) for name, cfg in self.configs.items()}
        self.backend = GraphBackend(fw_pass=self._pass("forward"), bw_pass=self._pass("backward"),
                                    compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"))

    def _pass(self, name: GraphName) -> Any:
        def run(gm: fx.GraphModule) -> fx.GraphModule:
            variants = {REFERENCE: gm, TAMPERED: _doubled_first_output(gm) if name == "forward" else gm}
            for label, cfg in self._loaded.items():
                variants[label] = apply(copy.deepcopy(gm), cfg, graph_kind=name, module_fqns=self.backend.module_fqns)
            self.graphs[name] = variants
            return gm

        return run

    def _compiler(self, name: GraphName) -> Any:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Any:
            variants = self.graphs[name]

            def run(*args: Any) -> Any:  # looks ``selected`` up at each call
                return variants[self.selected].forward(*args)

            return compat.make_boxed_func(run)

        return compile_graph


def _doubled_first_output(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of aot's forward graph whose first output (the model's own output; the saved tensors follow it) is
    doubled (not shifted: a softmax loss ignores a shift), so its backward inputs keep their layout."""
    doubled = copy.deepcopy(gm)
    output = doubled.graph.output_node()
    outputs = list(output.args[0])
    with doubled.graph.inserting_before(output):
        outputs[0] = doubled.graph.call_function(torch.ops.aten.mul.Tensor, (outputs[0], 2))
    output.args = (type(output.args[0])(outputs),)
    doubled.recompile()
    return doubled


def assert_tampered_differs(tampered_loss: torch.Tensor, reference_loss: torch.Tensor) -> None:
    """The harness ran the graphs it selected: a step under ``TAMPERED`` did not compute the reference's loss."""
    assert not torch.equal(tampered_loss, reference_loss), (
        "the step run under the tampered variant computed the reference's loss: the harness is not running the "
        "selected graphs, so its parity checks prove nothing")

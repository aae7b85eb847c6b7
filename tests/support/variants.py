"""One compile serving an untransformed reference and any number of configs: the parity harness.

The parity tests (``tests/multiprocess/test_parity.py``, the mixed-precision parity, the mesh parity) compare the
step the pass produced with the step torch traced, bit for bit, on real gloo ranks. What they prove is about the
rewritten graphs, so every config is applied to its own copy of one capture (``Variants``) instead of compiling the
model again per config: dynamo's trace and aot's capture are most of a compile, and they were most of the suite's
time. The production route, ``overlapcfg.backend(cfg)`` compiling the model per config, keeps its own bitwise gloo
parity in the conformance suite (``tests/thirdparty/conformance.parity_worker``, Hugging Face and torchtitan models).

A harness that switches graphs must prove it runs the one it says, and that nothing carries over from one variant's
step to the next: ``Variants.runs()`` ends with ``TAMPERED`` (the reference with the forward's output doubled and
the backward's first gradient zeroed) and the reference once more, and ``assert_harness_ran_what_it_selected``
checks that the tampered step differs in both graphs and the second reference equals the first, bit for bit.
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
from overlapcfg.kinds import Direction
from overlapcfg.passes import apply
from overlapcfg.passes.backend import GraphBackend

__all__ = ["REFERENCE", "REFERENCE_AGAIN", "TAMPERED", "Variants", "assert_harness_ran_what_it_selected"]

REFERENCE = "reference"
TAMPERED = "tampered"
"""The reference graphs with the forward's first output (the model's output) doubled and the backward's first
gradient zeroed: a step that must differ from the reference in its loss and in that gradient."""
REFERENCE_AGAIN = "reference_again"
"""The reference run once more, after every other variant: it must equal the first run."""


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
    graphs: dict[Direction, dict[str, fx.GraphModule]] = field(default_factory=dict)
    backend: GraphBackend = field(init=False)
    _loaded: dict[str, OverlapConfig] = field(init=False)

    def __post_init__(self) -> None:
        if REFERENCE in self.configs or TAMPERED in self.configs:
            raise ValueError(f"Variants: {REFERENCE!r} and {TAMPERED!r} are the harness's own variants")
        self._loaded = {name: load_config(cfg) for name, cfg in self.configs.items()}
        self.backend = GraphBackend(fw_pass=self._pass("forward"), bw_pass=self._pass("backward"),
                                    compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"))

    def _pass(self, name: Direction) -> Any:
        def run(gm: fx.GraphModule) -> fx.GraphModule:
            variants = {REFERENCE: gm, TAMPERED: _scaled_first_output(gm, 2 if name == "forward" else 0)}
            for label, cfg in self._loaded.items():
                variants[label] = apply(copy.deepcopy(gm), cfg, graph_kind=name, module_fqns=self.backend.module_fqns)
            self.graphs[name] = variants
            return gm

        return run

    def runs(self) -> tuple[tuple[str, str], ...]:
        """``(result key, variant to select)`` in the order to run them: the reference, each config, the tampered
        step and the reference again."""
        return ((REFERENCE, REFERENCE), *((name, name) for name in self.configs), (TAMPERED, TAMPERED),
                (REFERENCE_AGAIN, REFERENCE))

    def _compiler(self, name: Direction) -> Any:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Any:
            variants = self.graphs[name]

            def run(*args: Any) -> Any:  # looks ``selected`` up at each call
                return variants[self.selected].forward(*args)

            return compat.make_boxed_func(run)

        return compile_graph


def _scaled_first_output(gm: fx.GraphModule, factor: int) -> fx.GraphModule:
    """A copy of one of aot's graphs with its first output multiplied by ``factor``: the forward's is the model's
    own output (the saved tensors follow it; doubled, not shifted, since a softmax loss ignores a shift), the
    backward's a parameter's gradient (zeroed). Outputs keep their layout, so the other graph still fits."""
    scaled = copy.deepcopy(gm)
    output = scaled.graph.output_node()
    outputs = list(output.args[0])
    first = next(i for i, out in enumerate(outputs) if isinstance(out, fx.Node))
    with scaled.graph.inserting_before(output):
        outputs[first] = scaled.graph.call_function(torch.ops.aten.mul.Tensor, (outputs[first], factor))
    output.args = (type(output.args[0])(outputs),)
    scaled.recompile()
    return scaled


Step = tuple[torch.Tensor, Mapping[str, torch.Tensor]]
"""``(loss, {parameter: local gradient})``, as ``overlapcfg.demo.tracing.train_step`` returns them."""


def assert_harness_ran_what_it_selected(reference: Step, again: Step, tampered: Step) -> None:
    """The harness ran the graphs it selected, in both graphs, and no step changed what the next one computes."""
    (loss, grads), (again_loss, again_grads), (bad_loss, bad_grads) = reference, again, tampered
    assert torch.equal(again_loss, loss) and list(again_grads) == list(grads), "the reference changed between runs"
    for param, grad in grads.items():
        assert torch.equal(again_grads[param], grad), f"the reference's {param} gradient changed between runs"
    assert not torch.equal(bad_loss, loss), (
        "the step run under the tampered variant computed the reference's loss: the harness is not running the "
        "selected forward graph, so its parity checks prove nothing")
    zeroed = [param for param, grad in bad_grads.items() if not grad.any() and grads[param].any()]
    assert zeroed, ("no gradient of the tampered step was zeroed: the harness is not running the selected backward "
                    "graph, so its parity checks prove nothing")

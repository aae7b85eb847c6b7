"""Helpers for the mesh tests (HSDP, FSDP + TP): one trace serving a reference and several configs, and graph
summaries by mesh dimension that read only the final FX graph (op, group name, inputs), not the pass record.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.config import OverlapConfig
from overlapcfg.graph.ops import collective_kind, data_inputs, group_name, started_by
from overlapcfg.passes import apply
from overlapcfg.passes.backend import GraphBackend, GraphName

__all__ = ["REFERENCE", "Variants", "counts_by_dim", "group_signature"]

REFERENCE = "reference"


@dataclass(slots=True)
class Variants:
    """A ``torch.compile`` backend that traces once and can run the untransformed graphs or any config's.

    aot's forward and backward graphs (owners stamped, as ``overlapcfg.passes.compile.backend`` hands them to the
    pass) are kept as the reference; each config is applied to its own copy with ``overlapcfg.passes.apply``
    exactly as that backend does (``module_fqns`` of the compiled region). The compiled step runs the graphs of
    ``selected``. Forward and backward of one variant share their saved-tensor layout (the pass keeps outputs), so
    a step run under one ``selected`` is that variant's step. Parity then compares the pass against the same
    aot graphs, and a spawned rank pays one compile for all configs.
    """

    configs: Mapping[str, Any]
    selected: str = REFERENCE
    graphs: dict[GraphName, dict[str, fx.GraphModule]] = field(default_factory=dict)
    backend: GraphBackend = field(init=False)
    _loaded: dict[str, OverlapConfig] = field(init=False)

    def __post_init__(self) -> None:
        self._loaded = {name: load_config(cfg) for name, cfg in self.configs.items()}
        self.backend = GraphBackend(fw_pass=self._pass("forward"), bw_pass=self._pass("backward"),
                                    compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"))

    def _pass(self, name: GraphName) -> Any:
        def run(gm: fx.GraphModule) -> fx.GraphModule:
            variants = {REFERENCE: gm}
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


def counts_by_dim(gm: fx.GraphModule, dims_of: Mapping[str, str]) -> Counter[tuple[str, str]]:
    """``(kind, mesh dimension)`` -> number of collective starts; groups not in ``dims_of`` count as ``"?"``."""
    return Counter((str(collective_kind(n)), dims_of.get(group_name(n), "?"))
                   for n in gm.graph.nodes if collective_kind(n) is not None)


def group_signature(gm: fx.GraphModule, group: str) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]:
    """The collectives of ``group`` in graph order: ``(start, kind, inputs it reads, readers of its waits)``.

    Node names survive the pass for everything it does not merge, so equal signatures before and after mean the
    same collectives, in the same relative order, reading the same values and read by the same consumers.
    """
    out = []
    for node in gm.graph.nodes:
        if collective_kind(node) is None or group_name(node) != group:
            continue
        waits = [u for u in node.users if started_by(u) is node]
        readers = sorted(r.name for w in waits for r in w.users)
        out.append((node.name, str(collective_kind(node)), tuple(n.name for n in data_inputs(node)), tuple(readers)))
    return tuple(out)

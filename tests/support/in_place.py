"""Graphs that write their inputs in place, as whole-step graphs do (an optimizer step traced in): the
verifier's valid-rewrite and negative suites and the config fuzz run the pass on them."""

from __future__ import annotations

import torch
from torch import fx

from overlapcfg import compat

__all__ = ["with_in_place_updates"]

_aten = torch.ops.aten


def with_in_place_updates(gm: fx.GraphModule, count: int = 2) -> fx.GraphModule:
    """``gm`` (changed in place) as a whole-step graph ends: for the first ``count`` parameters it all-gathers, a
    reader of the shard (``decay_i = mul(p, 2)``, returned as an extra output) and then an in-place update of it
    (``update_0 = mul_(p, 0.5)``, then ``_foreach_mul_([p], 0.5)`` as optimizers' foreach kernels write), just
    before the output. Applied to the graph *before* the pass: the writes are the original's, and valid rewrites
    must keep each read on its side of them."""
    params = []
    for start in gm.graph.find_nodes(op="call_function", target=compat.ALL_GATHER_INTO_TENSOR):
        source = start.args[0]
        if source.op == "placeholder" and source not in params:
            params.append(source)
    output = next(iter(gm.graph.find_nodes(op="output")))
    extra = []
    for i, p in enumerate(params[:count]):
        with gm.graph.inserting_before(output):
            reader = gm.graph.call_function(_aten.mul.Tensor, (p, 2.0))
            writer = gm.graph.call_function(_aten.mul_.Tensor, (p, 0.5)) if i == 0 else \
                gm.graph.call_function(_aten._foreach_mul_.Scalar, ([p], 0.5))
        reader.name, writer.name = f"decay_{i}", f"update_{i}"
        reader.meta["val"] = p.meta["val"]
        writer.meta["val"] = p.meta["val"] if i == 0 else None
        extra.append(reader)
    outs = output.args[0]
    output.args = ((*outs, *extra) if isinstance(outs, (list, tuple)) else (outs, *extra),)
    gm.recompile()
    return gm

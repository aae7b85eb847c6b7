"""What a graph compiled by ``overlapcfg.backend`` leaves in a ``torch.profiler`` trace, so that a diagnosis read
from the trace alone (``overlapcfg mode=diagnose``) can tell which bucket each collective belongs to.

A compiled graph's collectives reach a trace as bare ``_c10d_functional::all_gather_into_tensor`` ops: no module
path, no bucket. Two things are added, and nothing changes in the graph itself:

- each call of a compiled graph runs inside a ``record_function`` range ``overlapcfg.graph::<id>/<graph>`` (``id``
  counts the graphs compiled in this process), so the trace shows which graph issued a collective and in which
  position: the graph's collectives always run in graph order;
- while a profiler records, the graph's collectives in that order (kind, full-size elements, dtype, bucket,
  direction) and each bucket's modules are put at the top level of the trace under the same name
  (``compat.add_trace_metadata``), from the pass's own record (``gm.meta["overlapcfg"]``) and the bucket marks
  merging wrote on the nodes.

With no profiler running the range costs what an inactive ``record_function`` costs (a flag check) and the record
is not written. ``overlapcfg.diagnose`` reads both.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.profiler import record_function

from overlapcfg import compat
from overlapcfg.graph.meta import merged_mark, owner, pass_record
from overlapcfg.graph.ops import collective_kind, is_collective_start
from overlapcfg.kinds import GRAPH_REGION
from overlapcfg.module_paths import ancestors

__all__ = ["GRAPH_REGION", "graph_collectives", "labelled"]

_IDS = itertools.count()


def _numel(node: fx.Node) -> tuple[int | None, str | None]:
    """Elements and dtype of the largest tensor a collective start reads or makes (its full size)."""
    values: list[Any] = [node.meta.get("val")]
    values += [a.meta.get("val") for a in node.all_input_nodes]
    best: tuple[int | None, str | None] = (None, None)
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and (best[0] is None or t.numel() > best[0]):
                best = (int(t.numel()), str(t.dtype).removeprefix("torch."))
    return best


def graph_collectives(gm: fx.GraphModule) -> list[dict[str, object]]:
    """The collective starts of ``gm`` in graph order: kind, full-size ``numel``, ``dtype``, ``bucket`` (the pass
    record's name, or None where no bucket holds it) and ``direction``."""
    record = pass_record(gm)
    names = [b.name for b in record.buckets] if record is not None else []
    by_module = {m: b.name for b in (record.buckets if record is not None else ()) for m in b.modules}
    out: list[dict[str, object]] = []
    for node in gm.graph.nodes:
        if not is_collective_start(node):
            continue
        numel, dtype = _numel(node)
        bucket = None
        mark = merged_mark(node)
        if mark is not None and 0 <= mark.bucket < len(names):
            bucket = names[mark.bucket]
        else:
            found = owner(node)
            if found is not None:
                bucket = next((by_module[m] for m in (found.module_fqn, *reversed(ancestors(found.module_fqn)))
                               if m in by_module), None)
        out.append({"kind": collective_kind(node) or "other", "numel": numel, "dtype": dtype, "bucket": bucket,
                    "direction": record.graph_kind if record is not None else None})
    return out


def labelled(compiled: Callable[..., object], gm: fx.GraphModule, graph: str) -> Callable[..., object]:
    """``compiled`` (aot's boxed calling convention) run inside its graph's range, leaving the graph's record in a
    trace being recorded (see the module docstring)."""
    name = f"{GRAPH_REGION}{next(_IDS)}/{graph}"
    found = pass_record(gm)
    buckets = {b.name: list(b.modules) for b in found.buckets} if found is not None else {}
    record = json.dumps({"graph": graph, "buckets": buckets, "collectives": graph_collectives(gm)})

    boxed = hasattr(compiled, "_boxed_call")  # as aot_autograd reads it (inductor declares it on the class)

    def run(args: list[object]) -> object:
        if compat.profiler_active():
            compat.add_trace_metadata(name, record)
        with record_function(name):
            return compiled(args) if boxed else compiled(*args)

    run._boxed_call = True  # type: ignore[attr-defined]  # aot calls it with one list of arguments
    return run

"""Dump every collective of torchtitan's FSDP + TP Llama3 graphs and what overlapcfg makes of them (issue 13).

Run from the repository root: ``.venv/bin/python -m tests.thirdparty.dump_tp [OUT.txt]`` (about 60 s on 2 cores;
default output: stdout). To see how another ``overlapcfg`` classifies the same graphs (``-m`` puts the current
directory first on ``sys.path``): ``git archive HEAD overlapcfg conf | tar -x -C DIR``, then from ``DIR`` run
``PYTHONPATH=DIR:<repo> <repo>/.venv/bin/python -m tests.thirdparty.dump_tp OUT.txt``.

For each case (``tests/thirdparty/models.py``: ``torchtitan_llama3("fsdp_tp")`` with sequence parallel,
``"fsdp_tp_no_sp"`` without, and ``"fsdp_tp"`` with ``reshard_after_forward=True``; a 2 x 2 ``("fsdp", "tp")``
mesh, 4 fake ranks), for each collective of aot's forward and backward graphs: op, process group (name, size, mesh
dimension), dtype and shapes; what its input reads (the op chains back to a placeholder and that placeholder's aot
descriptor, or to the first other op; for a backward placeholder the forward saved, the forward node it stands
for); where its waited result goes; and overlapcfg's view of it: ``find_collectives`` with
``attribution.module_fqn`` (the ``apply`` route of ``tests/conformance/test_conformance.py``),
``is_parameter_gather``, the aot-descriptor owner ``annotate_owners`` stamps (the ``backend`` route). Then what
``overlapcfg.apply`` (manual, ``torchtitan_layers``) and ``overlapcfg.backend`` do with the graphs: counts per group
before and after, whether the tp-group collectives changed.
"""

from __future__ import annotations

import collections
import contextlib
import io
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

import overlapcfg
from overlapcfg.graph import attribution, collectives, gradients, ops, parameters
from tests.thirdparty import conformance as C
from tests.thirdparty import models as M

CASES = (("fsdp_tp", False), ("fsdp_tp_no_sp", False), ("fsdp_tp", True))  # (mode, reshard_after_forward)
GRAPHS = ("forward", "backward")
CFG = C.Case("tt_fsdp_tp", 4, "torchtitan_layers", C._tt_bucket, torchtitan="fsdp_tp").config(1)
WAIT = torch.ops._c10d_functional.wait_tensor.default


def op(n: fx.Node) -> str:
    if n.op != "call_function":
        return n.op
    schema = getattr(n.target, "_schema", None)
    return schema.name.split("::")[-1] + ("." + schema.overload_name if schema and schema.overload_name else "") \
        if schema else getattr(n.target, "__name__", str(n.target))


def val(n: Any) -> str:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    return type(v).__name__


def group_args(start: fx.Node) -> tuple[int | None, str]:
    name = ops.group_name(start)
    size = start.args[1] if "all_gather" in op(start) else start.args[2] if "reduce_scatter" in op(start) else None
    return (size if isinstance(size, int) else None), name


def input_walk(start: fx.Node, dyn: fx.GraphModule, forward: fx.GraphModule | None = None) -> list[str]:
    """Every path back from the collective's input through overlapcfg-transparent ops, ending at a placeholder
    (with its descriptor and the parameter it names) or at the first other op (named, with its op). A backward
    placeholder without a descriptor is a tensor the forward saved: aot names it after the forward node, so
    ``forward`` (the forward graph) shows what that node is (its own input walk) and its output descriptor."""
    lines: list[str] = []

    def walk(node: fx.Node, path: list[str], depth: int) -> None:
        label = f"{node.name}:{op(node)} {val(node)}"
        if node.op == "placeholder":
            desc = node.meta.get("desc")
            fqn = _primal_fqn(node, dyn)
            lines.append(" <- ".join([*path, f"PLACEHOLDER {node.name} {val(node)} desc={desc!r}"
                                      + (f" param={fqn}" if fqn else "")
                                      + f" is_parameter_placeholder={parameters.is_parameter_placeholder(node)}"]))
            saved = _forward_node(forward, node.name) if desc is None and forward is not None else None
            if saved is not None:
                out = next(n for n in forward.graph.nodes if n.op == "output")  # type: ignore[union-attr]
                descs = out.meta.get("desc") or []
                where = [f"{i} desc={descs[i]!r}" for i, v in enumerate(out.args[0]) if v is saved and i < len(descs)]
                lines.append(f"    = forward node {saved.name}:{op(saved)} saved as forward OUTPUT[{', '.join(where)}]")
                lines.extend(f"      forward: {saved.name} <- {line}" for line in input_walk_node(saved, dyn))
            return
        transparent = node.op == "get_attr" or ops.is_transparent(node)
        if not transparent or depth > 12:
            ins = ", ".join(f"{i.name}:{op(i)}" for i in node.all_input_nodes[:4])
            lines.append(" <- ".join([*path, f"STOP at {label} (non-transparent; reads {ins})"]))
            return
        for i in node.all_input_nodes:
            walk(i, [*path, label], depth + 1)

    for i in ops.data_inputs(start):
        walk(i, [], 0)
    return lines


def input_walk_node(node: fx.Node, dyn: fx.GraphModule) -> list[str]:
    """``input_walk`` from ``node`` itself (a forward node a backward placeholder stands for)."""
    if node.op == "placeholder":
        return [f"PLACEHOLDER {node.name} desc={node.meta.get('desc')!r} param={_primal_fqn(node, dyn)}"]
    return input_walk(node, dyn)


def _forward_node(forward: fx.GraphModule | None, name: str) -> fx.Node | None:
    if forward is None:
        return None
    return next((n for n in forward.graph.nodes if n.name == name and n.op != "placeholder"), None)


def _primal_fqn(ph: fx.Node, dyn: fx.GraphModule) -> str | None:
    try:
        idx, attr = C._plain_index(ph.meta.get("desc"))
    except AssertionError:
        return None
    if attr not in (None, "_local_tensor"):
        return None
    dyn_inputs = C._dynamo_inputs(dyn)
    return C.source_fqn(C._source_name(dyn_inputs[idx])) if idx < len(dyn_inputs) else None


def result_flow(wait: fx.Node) -> list[str]:
    """Where the waited result goes: each user chain followed through single-user ops (8 hops), to the output
    (with its descriptor) or to the first op with several users or more than two inputs."""
    out: list[str] = []
    for user in wait.users:
        path, last, cur = [], wait, user
        for _ in range(8):
            if cur.op == "output":
                descs = cur.meta.get("desc") or []
                positions = [i for i, v in enumerate(cur.args[0]) if v is last]
                path.append("OUTPUT[" + ", ".join(f"{i} desc={descs[i]!r}" if i < len(descs) else str(i)
                                                  for i in positions) + "]")
                break
            path.append(f"{cur.name}:{op(cur)} {val(cur)}")
            users = list(cur.users)
            if len(users) != 1 or len(cur.all_input_nodes) > 2:
                if users:
                    path.append(f"... ({len(users)} users: {', '.join(u.name for u in users[:4])})")
                break
            last, cur = cur, users[0]
        out.append(" -> ".join(path))
    return out


def process_groups() -> dict[str, str]:
    world = dist.distributed_c10d._world
    out = {}
    for pg, name in world.pg_names.items():
        ranks = sorted(world.pg_group_ranks.get(pg, {}))
        out[name] = f"{getattr(pg, 'group_desc', '')} ranks {ranks}"
    return out


def mesh_dims(model: torch.nn.Module) -> dict[str, str]:
    """Process-group name -> mesh dimension name, from a parameter's DTensor mesh."""
    p = next(model.parameters())
    mesh = p.device_mesh
    return {mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names}


def classify(gm: fx.GraphModule, graph: str, dyn: fx.GraphModule) -> tuple[dict[str, Any], dict[str, Any]]:
    """``find_collectives`` as the apply route sees it, and the owners the backend route's descriptors give."""
    found = {c.start.name: c for c in collectives.find_collectives(gm.graph, attribution.module_fqn,
                                                                     direction=graph)}  # type: ignore[arg-type]
    copy = M.copy_graph_module(gm)
    owners = {o.node: o for o in attribution.annotate_owners(copy, graph,
                                                             attribution.dynamo_parameter_inputs(dyn))}
    return found, owners


def dump_graph(w: io.StringIO, graph: str, gm: fx.GraphModule, dyn: fx.GraphModule, dims: dict[str, str],
               forward: fx.GraphModule | None = None) -> None:
    starts = [n for n in gm.graph.nodes if ops.is_collective_start(n)]
    per = collections.Counter((op(s), dims.get(group_args(s)[1], group_args(s)[1])) for s in starts)
    w.write(f"\n== {graph}: {len(gm.graph.nodes)} nodes, {len(starts)} collectives: "
            + ", ".join(f"{n} x {o} on {g}" for (o, g), n in sorted(per.items())) + "\n")
    try:
        found, owners = classify(gm, graph, dyn)
    except Exception as err:  # the dump reports it
        w.write(f"   !! classification raised {type(err).__name__}: {err}\n")
        found, owners = {}, {}
    for i, s in enumerate(starts):
        size, name = group_args(s)
        wait = ops.wait_of(s)
        custom = (s.meta.get("custom") or {}).get("module_fqn")
        w.write(f"\n[{graph} #{i}] {s.name} = {op(s)}  group {name!r} ({dims.get(name, '?')}, size {size})  "
                f"in {val(s.args[0])} out {val(s)}  wait={wait.name if wait else None}\n")
        w.write(f"   meta: custom.module_fqn={custom!r} stack={attribution.stack_module_fqn(s)!r} "
                f"autograd_backward={s.meta.get('autograd_backward', 'absent')}\n")
        for line in input_walk(s, dyn, forward):
            w.write(f"   input: {line}\n")
        if wait is not None:
            for line in result_flow(wait):
                w.write(f"   result: {line}\n")
        c = found.get(s.name)
        if c is not None:
            w.write(f"   overlapcfg find_collectives: kind={c.kind} fsdp={c.fsdp} module_fqn={c.module_fqn!r} "
                    f"params={c.params} direction={c.direction} bytes={c.unsharded_bytes}\n")
        extra = []
        if "all_gather" in op(s):
            srcs = parameters.placeholder_sources(s)
            extra.append(f"placeholder_sources={None if srcs is None else [n.name for n in srcs]}")
            verdicts = [parameters.graph_inputs(s.graph, backward=graph == "backward").verdict(n) for n in srcs or ()]
            extra.append(f"input verdicts={verdicts}")
        if "reduce_scatter" in op(s) and wait is not None:
            from overlapcfg import compat

            extra.append(f"torch is_fsdp_reduce_scatter={compat.is_fsdp_reduce_scatter(s)}")
            extra.append(f"is_partial_gradient_scatter={gradients.is_partial_gradient_scatter(s, (wait,))}")
        o = owners.get(s.name)
        extra.append(f"descriptor owner (backend route)={o.param_fqn if o else None}")
        w.write("   overlapcfg checks: " + ", ".join(extra) + "\n")


def tp_signature(gm: fx.GraphModule, tp_group: str) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n.name, op(n), tuple(a.name for a in n.all_input_nodes)) for n in gm.graph.nodes
            if ops.is_collective_start(n) and ops.group_name(n) == tp_group]


def per_group(gm: fx.GraphModule, dims: dict[str, str]) -> dict[str, int]:
    counts = collections.Counter(f"{op(n)}@{dims.get(ops.group_name(n), ops.group_name(n))}"
                                 for n in gm.graph.nodes if ops.is_collective_start(n))
    return dict(sorted(counts.items()))


def dump_apply(w: io.StringIO, g: M.CapturedGraphs, dims: dict[str, str]) -> None:
    tp_group = next(k for k, v in dims.items() if v == "tp")
    cfg = overlapcfg.load_config(CFG)
    w.write(f"\n== overlapcfg.apply({CFG}) on each graph (copy)\n")
    for graph in GRAPHS:
        gm = M.copy_graph_module(getattr(g, graph))
        before, tp_before = per_group(gm, dims), tp_signature(gm, tp_group)
        try:
            with _captured_warnings() as warned:
                out = overlapcfg.apply(gm, cfg, graph_kind=graph)  # type: ignore[attr-defined]
        except Exception as err:  # the dump reports it
            w.write(f"   {graph}: RAISED {type(err).__name__}: {str(err)[:1500]}\n")
            w.write("   " + "".join(traceback.format_exception(err)[-3:]).replace("\n", "\n   ") + "\n")
            continue
        rec = out.meta["overlapcfg"]
        tp_after = tp_signature(out, tp_group)
        w.write(f"   {graph}: before {before}\n   {graph}: after  {per_group(out, dims)}\n")
        w.write(f"   {graph}: tp-group collectives unchanged (names, ops, inputs, order): {tp_before == tp_after}\n")
        if tp_before != tp_after:
            gone = [s for s in tp_before if s not in tp_after]
            new = [s for s in tp_after if s not in tp_before]
            w.write(f"      tp removed: {gone}\n      tp added: {new}\n")
        w.write(f"   {graph}: record before.fsdp={rec.before.fsdp} other={rec.before.other}; after.fsdp="
                f"{rec.after.fsdp} other={rec.after.other}; non_fsdp={list(rec.non_fsdp)}; "
                f"uncovered={[u.node for u in rec.uncovered]}\n")
        for b in rec.buckets:
            w.write(f"      bucket {b.name}: params={list(b.params)} collectives="
                    f"{[(c.kind, c.before, c.after) for c in b.collectives]}\n")
        for msg in warned:
            w.write(f"   {graph}: warning: {msg[:400]}\n")


@contextlib.contextmanager
def _captured_warnings() -> Iterator[list[str]]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages.extend(str(c.message) for c in caught)


def dump_backend(w: io.StringIO, model: torch.nn.Module, make_batch: Any, dims: dict[str, str]) -> None:
    w.write(f"\n== overlapcfg.backend({CFG}): one compiled forward + backward\n")
    be, dynamo, pre = overlapcfg.backend(dict(CFG)), [], {}  # type: ignore[attr-defined]
    inputs, loss_fn = make_batch()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=C.spied_backend(be, dynamo, pre), fullgraph=True)
        loss_fn(compiled(*inputs)).backward()
    except Exception as err:  # the dump reports it
        w.write(f"   RAISED {type(err).__name__}: {str(err)[:1500]}\n")
        return
    finally:
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
    tp_group = next(k for k, v in dims.items() if v == "tp")
    for graph in GRAPHS:
        final, rec = be.graphs[graph], be.graphs[graph].meta["overlapcfg"]
        w.write(f"   {graph}: before {per_group(pre[graph], dims)}\n   {graph}: after  {per_group(final, dims)}\n")
        w.write(f"   {graph}: tp-group collectives unchanged: "
                f"{tp_signature(pre[graph], tp_group) == tp_signature(final, tp_group)}; non_fsdp="
                f"{list(rec.non_fsdp)}; owners (descriptor)={[(o.node, o.param_fqn) for o in be.collectives[graph]]}\n")


def main(argv: list[str]) -> None:
    w = io.StringIO()
    w.write(f"overlapcfg imported from {overlapcfg.__file__}\ntorch {torch.__version__}\n")
    for mode, reshard in CASES:
        w.write(f"\n\n######## torchtitan_llama3({mode!r}, reshard_after_forward={reshard}) ########\n")
        with M.fake_process_group(4):
            model, make_batch = M.torchtitan_llama3(mode, reshard_after_forward=reshard)
            dims = mesh_dims(model)
            groups = process_groups()
            w.write("process groups: " + "; ".join(f"{k!r} = {v}" for k, v in groups.items()) + "\n")
            w.write(f"mesh dims of the parameters: {dims}\n")
            for name, p in model.named_parameters():
                w.write(f"   param {name}: global {list(p.shape)} local {list(p.to_local().shape)} "
                        f"placements {p.placements}\n")
            g = M.capture_graphs(model, *make_batch(), world_size=4)
            w.write(f"capture {g.seconds:.1f} s; extra graphs {[n for n, _ in g.extra_graphs]}\n")
            for graph in GRAPHS:
                saved_from = g.forward if graph == "backward" else None
                dump_graph(w, graph, getattr(g, graph), g.dynamo_graph, dims, saved_from)
            dump_apply(w, g, dims)
            dump_backend(w, model, make_batch, dims)
    text = w.getvalue()
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv)

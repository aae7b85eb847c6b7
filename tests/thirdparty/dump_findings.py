"""Capture every third-party fixture and write the metadata its graphs carry to FINDINGS.md (beside this file).

Run: ``.venv/bin/python -m tests.thirdparty.dump_findings [OUT.md]`` from the repository root (about 45 s on
2 cores). Uses only ``tests/thirdparty/models.py`` (no overlapcfg). Only the part of FINDINGS.md between the
BEGIN/END GENERATED markers is rewritten; the hand-written summary above it is kept.
"""

from __future__ import annotations

import collections
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from tests.thirdparty import models as M

C10D = torch.ops._c10d_functional
WAIT = C10D.wait_tensor.default
STARTS = {
    C10D.all_gather_into_tensor.default: "all_gather_into_tensor",
    C10D.reduce_scatter_tensor.default: "reduce_scatter_tensor",
    C10D.all_reduce.default: "all_reduce",
    C10D.all_to_all_single.default: "all_to_all_single",
}
# group_size / group_name positions in the op schemas
GROUP_ARGS = {
    "all_gather_into_tensor": (1, 2),  # (input, group_size, group_name)
    "reduce_scatter_tensor": (2, 3),  # (input, reduce_op, group_size, group_name)
    "all_reduce": (None, 2),  # (input, reduce_op, group_name)
    "all_to_all_single": (None, 3),
}


# --- the descriptor -> parameter FQN algorithm (the crux; verified below for every all-gather) ------------------

_SEG = re.compile(r"\._(modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z_0-9]*)|\[(\d+)\]|\['([^']+)'\]")


def source_to_fqn(source_name: str) -> tuple[str, str]:
    """``L['args'][0]._modules['model']._modules['embed_tokens']._modules['parametrizations']._modules['weight']
    ._parameters['original']`` -> (``"L['args'][0]"``, ``"model.embed_tokens.weight"``).

    The root is the local the compiled module arrived in: ``L['self']`` (plain ``nn.Module.forward``) or
    ``L['args'][0]`` (HF Llama/Qwen2: ``forward`` wrapped by a decorator taking ``*args``). The remaining
    ``._modules[..]`` / ``._parameters[..]`` / ``._buffers[..]`` segments are the attribute path; parametrize's
    ``parametrizations.<name>.original`` collapses to ``<name>``.
    """
    m = re.match(r"L\['[^']+'\](\[\d+\])?", source_name)
    if not m:
        return "", source_name
    root, rest = m.group(0), source_name[m.end():]
    parts = [g[1] or g[2] or g[3] or g[4] for g in _SEG.findall(rest)]
    return root, M.user_fqn(".".join(parts))


def dynamo_inputs(dynamo_gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]


def base_plain_index(desc: Any) -> tuple[int | None, str | None]:
    """Unwrap ``SubclassGetAttrAOTInput(base=..., attr=...)`` (nested for nested subclasses) to the
    ``PlainAOTInput.idx`` of the dynamo input it came from; also return the innermost attr (``_local_tensor``...)."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput, SubclassGetAttrAOTInput

    attr = None
    while isinstance(desc, SubclassGetAttrAOTInput):
        attr = attr or desc.attr
        desc = desc.base
    if isinstance(desc, PlainAOTInput):
        return desc.idx, attr
    return None, attr


def primal_fqn(placeholder: fx.Node, dynamo_gm: fx.GraphModule) -> str | None:
    """Forward/backward primal placeholder -> parameter FQN as the user names it.

    1. ``d = placeholder.meta["desc"]`` (an ``AOTInput``); peel ``SubclassGetAttrAOTInput.base`` until a
       ``PlainAOTInput`` (a DTensor parameter gives ``attr='_local_tensor'`` for the shard and ``'device_mesh'``
       for its mesh: two flat inputs per parameter; only ``_local_tensor`` is a parameter).
    2. ``idx = d.idx`` indexes dynamo's graph inputs: the k-th ``placeholder`` node of the dynamo GraphModule
       (aot's ``example_inputs`` are exactly those, in order).
    3. ``src = that_placeholder.meta["grapharg"].source.name`` (a property in torch 2.13; a method before).
    4. ``source_to_fqn(src)`` strips the root and ``_modules/_parameters/_buffers`` wrappers and parametrize's
       ``parametrizations.X.original``.
    """
    idx, attr = base_plain_index(placeholder.meta.get("desc"))
    if idx is None or attr not in (None, "_local_tensor"):
        return None
    dyn = dynamo_inputs(dynamo_gm)[idx]
    grapharg = dyn.meta.get("grapharg")
    if grapharg is None:
        return None
    name = grapharg.source.name
    name = name() if callable(name) else name
    return source_to_fqn(name)[1]


# --- graph walking --------------------------------------------------------------------------------------------


def collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in STARTS]


def wait_of(start: fx.Node) -> fx.Node | None:
    return next((u for u in start.users if u.target is WAIT), None)


def op_name(n: fx.Node) -> str:
    if n.op == "call_function":
        t = n.target
        name = getattr(t, "__name__", str(t))
        ns = getattr(getattr(t, "_schema", None), "name", "")
        return ns.split("::")[-1] if ns else name
    return n.op


def chain_to_placeholder(start: fx.Node) -> tuple[list[str], fx.Node | None]:
    """Follow the first tensor argument back from the collective to a placeholder (ops passed, placeholder)."""
    chain, n = [], start.args[0]
    while isinstance(n, fx.Node) and n.op != "placeholder":
        chain.append(op_name(n))
        n = next((a for a in n.all_input_nodes), None)
    return chain, n if isinstance(n, fx.Node) else None


def placeholder_ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack, phs = set(), [node], set()
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                (phs.add(a) if a.op == "placeholder" else stack.append(a))
    return phs


def flow_to_output(start: fx.Node) -> list[tuple[list[str], int]]:
    """Paths from the collective to the graph output: (ops on the way, output position)."""
    out = next(n for n in start.graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    results: list[tuple[list[str], int]] = []

    def walk(n: fx.Node, path: list[str], depth: int) -> None:
        if depth > 12:
            return
        for u in n.users:
            if u.op == "output":
                results.extend((path, i) for i, v in enumerate(flat) if v is n)
            else:
                walk(u, [*path, op_name(u)], depth + 1)

    walk(start, [], 0)
    return results


def stack_ends(stack: dict[str, Any] | None) -> str:
    if not stack:
        return "—"
    items = list(stack.items())
    (k0, v0), (k1, v1) = items[0], items[-1]
    name = lambda v: v[0] if isinstance(v, (tuple, list)) else v  # noqa: E731
    if len(items) == 1:
        return f"`{k0}`→`{name(v0)}` (1 entry)"
    return f"outer `{k0}`→`{name(v0)}`; inner `{k1}`→`{name(v1)}` ({len(items)} entries)"


def meta_summary(n: fx.Node) -> dict[str, str]:
    return {
        "nn_module_stack": stack_ends(n.meta.get("nn_module_stack")),
        "fwd_nn_module_stack": stack_ends(n.meta.get("fwd_nn_module_stack")),
        "custom": f"`{n.meta.get('custom')}`" if n.meta.get("custom") is not None else "—",
        "autograd_backward": f"`{n.meta.get('autograd_backward')}`" if "autograd_backward" in n.meta else "absent",
    }


def val_str(n: fx.Node) -> str:
    v = n.meta.get("val")
    return f"{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else str(v)


# --- the models -----------------------------------------------------------------------------------------------


def capture(name: str, reshard: bool = True) -> tuple[M.CapturedGraphs, dict[str, str]]:
    groups: dict[str, str] = {}
    if name.startswith("hf_"):
        model, make_batch = getattr(M, name)()
        M.shard_simple_fsdp(model, world_size=2, rank=0, reshard_after_forward=reshard)
        g = M.capture_graphs(model, *make_batch(), world_size=2)
        groups["0"] = "default group (WORLD, ranks 0-1)"
        return g, groups
    mode = name.split(" ")[1]
    ws = 2 if mode == "fully_shard" else 4
    with M.fake_process_group(ws):
        model, make_batch = M.torchtitan_llama3(mode)
        g = M.capture_graphs(model, *make_batch(), world_size=ws)
        world = dist.distributed_c10d._world
        for pg, pg_name in world.pg_names.items():
            ranks = world.pg_group_ranks.get(pg, {})
            desc = getattr(pg, "group_desc", "")
            groups[pg_name] = f"{desc} (global ranks {sorted(ranks)})"
    return g, groups


CASES = ["hf_llama", "hf_qwen2", "hf_mixtral", "hf_tied", "torchtitan fully_shard", "torchtitan hybrid_shard"]


_PARAM_CLASSES = ("GatherShard", "ParametrizationList", "ReplicateComputation")


def clean_stack_path(path: str) -> str:
    """nn_module_stack value[0] -> module FQN: strip the root (``L['self']``, ``L['args'][0]``), torchtitan's
    ``annotate_fn`` wrapper hops (``.forward.__closure__[1].cell_contents.__self__``), the class-property hop of
    its SimpleFSDP (``dict(type(X).__dict__)['weight'].fget.__closure__[0].cell_contents`` -> X) and parametrize's
    ``parametrizations.<name>[.0]``."""
    m = re.fullmatch(r"dict\(type\((.*)\)\.__dict__\)\['[^']+'\]\.fget\.__closure__\[\d+\]\.cell_contents", path)
    if m:
        path = m.group(1)
    path = re.sub(r"\.forward\.__closure__\[\d+\]\.cell_contents\.__self__", "", path)
    path = re.sub(r"^L\['[^']+'\](\[\d+\])?\.?", "", path)
    parts = path.split(".")
    if "parametrizations" in parts:
        parts = parts[: parts.index("parametrizations")]
    return ".".join(parts)


def owner_from_stack(stack: dict[str, Any] | None, skip_param_modules: bool) -> str | None:
    if not stack:
        return None
    entries = list(stack.values())
    if skip_param_modules:
        entries = [v for v in entries if getattr(v[1], "__name__", str(v[1])) not in _PARAM_CLASSES]
    return clean_stack_path(entries[-1][0]) if entries else None


def entry(stack: dict[str, Any] | None, i: int) -> str:
    if not stack:
        return "—"
    k, v = list(stack.items())[i]
    k = re.sub(r"^\d+", "<id>", k)
    cls = getattr(v[1], "__name__", str(v[1]))
    return f"`{k}`: `{v[0]}` ({cls})"


def describe(name: str, g: M.CapturedGraphs, groups: dict[str, str], lines: list[str],
             checks: collections.Counter[str], sample: int = 2) -> None:
    dyn = g.dynamo_graph
    n_fw_ph = sum(1 for n in g.forward.graph.nodes if n.op == "placeholder")
    lines.append(f"\n### {name}\n")
    lines.append(f"Capture {g.seconds:.2f} s. Process groups: "
                 + ", ".join(f"`{k}` = {v}" for k, v in groups.items())
                 + f". Forward placeholders {n_fw_ph}, dynamo inputs {len(dynamo_inputs(dyn))}.\n")
    for kind, gm in (("forward", g.forward), ("backward", g.backward)):
        colls = collectives(gm)
        counts = collections.Counter(STARTS[c.target] for c in colls)
        lines.append(f"**{kind}**: {len(gm.graph.nodes)} nodes; "
                     + (", ".join(f"{v}× {k}" for k, v in counts.items()) or "no collectives") + "\n")
        if not colls:
            continue
        out = next(n for n in gm.graph.nodes if n.op == "output")
        descs = out.meta.get("desc") or []
        facts: collections.Counter[str] = collections.Counter()
        rows, meta_rows = [], []
        shown: collections.Counter[str] = collections.Counter()
        for c in colls:
            op = STARTS[c.target]
            size_pos, name_pos = GROUP_ARGS[op]
            gsize = c.args[size_pos] if size_pos is not None else "—"
            gname = c.args[name_pos]
            w = wait_of(c)
            stack = c.meta.get("nn_module_stack") or c.meta.get("fwd_nn_module_stack")
            facts[f"{op}: group `{gname}`, size {gsize}, {str(c.meta['val'].dtype).replace('torch.', '')}"] += 1
            facts[f"{op}: wait meta == start meta: {bool(w) and meta_summary(w) == meta_summary(c)}"] += 1
            facts[f"{op}: has nn_module_stack={'nn_module_stack' in c.meta}, fwd_nn_module_stack="
                  f"{'fwd_nn_module_stack' in c.meta}, custom={c.meta.get('custom') is not None}, "
                  f"autograd_backward={c.meta.get('autograd_backward', 'absent')}"] += 1
            irregular = False
            if op == "all_gather_into_tensor":
                chain, ph = chain_to_placeholder(c)
                nph = len(placeholder_ancestors(c))
                fqn = primal_fqn(ph, dyn) if ph is not None else None
                facts[f"{op}: input chain `{' <- '.join(chain) or '(placeholder directly)'}`, placeholder ancestors "
                      f"{nph}, desc {type(ph.meta.get('desc')).__name__ if ph else None}"] += 1
                flow = f"{' ← '.join(chain) or '(direct)'} ← `{ph.name if ph else '?'}`"
                desc = f"`{ph.meta.get('desc') if ph else None}`"
                irregular = bool(chain) or nph != 1
            else:
                flows = flow_to_output(c)
                paths = [" → ".join(p) for p, _ in flows]
                facts[f"{op}: path to output `{' | '.join(paths) or 'none'}`"] += 1
                flow = "; ".join(f"→ {' → '.join(p)} → output[{i_}]" for p, i_ in flows) or "no path to output"
                desc = "; ".join(f"`{descs[i_]}`" for _, i_ in flows if i_ < len(descs))
                fqs = {_grad_fqn(descs[i_], dyn) for _, i_ in flows if i_ < len(descs)}
                fqn = next(iter(fqs)) if len(fqs) == 1 else None
                irregular = any(p not in ("wait_tensor", "wait_tensor → reduce_scatter_tensor → wait_tensor")
                                for p in paths) or len(flows) != 1
            owner = fqn.rpartition(".")[0] if fqn else None
            if owner is not None:
                for label, got in (
                    ("innermost nn_module_stack entry (raw) names the owner", owner_from_stack(stack, False)),
                    ("innermost non-parametrization nn_module_stack entry names the owner",
                     owner_from_stack(stack, True)),
                    ("custom['module_fqn'] names the owner", (c.meta.get("custom") or {}).get("module_fqn")),
                ):
                    if got is not None:
                        checks[f"{name} {kind} {op}: {label}: {got == owner}"] += 1
            if shown[op] < sample or irregular:
                shown[op] += 1
                rows.append(f"| `{c.name}` → `{w.name if w else '?'}` | {op} | `{gname}`, {gsize} | {val_str(c)} "
                            f"| {flow} | {desc} → **{fqn}** |")
                meta_rows.append(f"| `{c.name}` | {entry(stack, 0)} | {entry(stack, -1)} | "
                                 f"{'nn_module_stack' if 'nn_module_stack' in c.meta else 'fwd_nn_module_stack'} | "
                                 f"{meta_summary(c)['custom']} | {meta_summary(c)['autograd_backward']} |")
        lines.extend(f"- {k}: {v}" for k, v in sorted(facts.items()))
        lines.append("\n| start → wait | op | group name, size | out | input ← placeholder / → output | "
                     "desc → FQN |")
        lines.append("|---|---|---|---|---|---|")
        lines.extend(rows)
        lines.append("\n| start | outermost stack entry (key: value[0]) | innermost stack entry | stack field | custom "
                     "| autograd_backward |")
        lines.append("|---|---|---|---|---|---|")
        lines.extend(meta_rows)
        lines.append("")


def _grad_fqn(desc: Any, dyn: fx.GraphModule) -> str | None:
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, SubclassGetAttrAOTOutput

    while isinstance(desc, SubclassGetAttrAOTOutput):
        desc = desc.base
    if not isinstance(desc, GradAOTOutput):
        return None
    fake = fx.Node.__new__(fx.Node)  # primal_fqn only reads .meta
    fake.meta = {"desc": desc.grad_of}
    return primal_fqn(fake, dyn)


def dynamo_table(name: str, g: M.CapturedGraphs, lines: list[str], limit: int = 6) -> None:
    dyn = g.dynamo_graph
    fw_ph = [n for n in g.forward.graph.nodes if n.op == "placeholder"]
    by_idx: dict[int, list[str]] = collections.defaultdict(list)
    for p in fw_ph:
        idx, attr = base_plain_index(p.meta.get("desc"))
        if idx is not None:
            by_idx[idx].append(f"`{p.name}`" + (f".{attr}" if attr else ""))
    lines.append(f"\n**{name}** — dynamo placeholders (first {limit} of {len(dynamo_inputs(dyn))}):\n")
    lines.append("| k | dynamo placeholder | grapharg.source.name | example | FQN "
                 "| aot forward primals with base idx k |")
    lines.append("|---|---|---|---|---|---|")
    for k, n in enumerate(dynamo_inputs(dyn)[:limit]):
        src = n.meta["grapharg"].source.name
        ex = n.meta.get("example_value")
        lines.append(f"| {k} | `{n.name[:48]}{'…' if len(n.name) > 48 else ''}` | `{src}` | {type(ex).__name__} "
                     f"{tuple(ex.shape) if isinstance(ex, torch.Tensor) else ''} | {source_to_fqn(src)[1]} | "
                     f"{', '.join(by_idx.get(k, []))} |")


def main(out_path: str | None = None) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from importlib.metadata import version

    import torchtitan  # noqa: F401
    import transformers

    lines = [
        "# Third-party graphs: what metadata they carry",
        "",
        f"Generated by `tests/thirdparty/dump_findings.py` (torch {torch.__version__}, transformers "
        f"{transformers.__version__}, torchtitan {version('torchtitan')}, Python {platform.python_version()}). "
        "HF models are sharded by `models.shard_simple_fsdp(world_size=2, reshard_after_forward=True)`; torchtitan "
        "by its own `simple_fsdp.data_parallel` (fully_shard: 1-D mesh of 2; hybrid_shard: 2×2 mesh "
        "`(dp_replicate, fsdp)`). Captured by `models.capture_graphs` (aot_autograd, min-cut partitioner, rank 0).",
    ]
    checks: collections.Counter[str] = collections.Counter()
    results = {}
    for name in CASES:
        g, groups = capture(name)
        results[name] = (g, groups)
    # timing + reshard=False counts
    lines.append("\n## Summary\n")
    lines.append("| model | capture s | dynamo / fw / bw nodes | fw collectives | bw collectives |")
    lines.append("|---|---|---|---|---|")
    for name, (g, _) in results.items():
        fc = collections.Counter(STARTS[c.target] for c in collectives(g.forward))
        bc = collections.Counter(STARTS[c.target] for c in collectives(g.backward))
        lines.append(f"| {name} | {g.seconds:.2f} | {len(g.dynamo_graph.graph.nodes)} / {len(g.forward.graph.nodes)}"
                     f" / {len(g.backward.graph.nodes)} | {dict(fc)} | {dict(bc)} |")
    g0, _ = capture("hf_llama", reshard=False)
    lines.append(f"| hf_llama (reshard_after_forward=False) | {g0.seconds:.2f} | {len(g0.dynamo_graph.graph.nodes)}"
                 f" / {len(g0.forward.graph.nodes)} / {len(g0.backward.graph.nodes)} | "
                 f"{dict(collections.Counter(STARTS[c.target] for c in collectives(g0.forward)))} | "
                 f"{dict(collections.Counter(STARTS[c.target] for c in collectives(g0.backward)))} |")
    lines.append("\n## Dynamo inputs ↔ aot flat inputs\n")
    for name in ("hf_llama", "hf_mixtral", "torchtitan fully_shard"):
        dynamo_table(name, results[name][0], lines)
    lines.append("\n## Per model (2 sample rows per collective kind, plus every irregular one)\n")
    for name, (g, groups) in results.items():
        describe(name, g, groups, lines, checks)
    lines.append("\n## Cross-checks: owner from desc → FQN vs the node's module metadata (all collectives)\n")
    lines.extend(f"- {k}: {v}" for k, v in sorted(checks.items()))
    generated = "\n".join(lines[2:]) + "\n"  # drop the title: FINDINGS.md has its own
    path = Path(out_path) if out_path else Path(__file__).with_name("FINDINGS.md")
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        text = old[: old.index(BEGIN) + len(BEGIN)] + "\n" + generated + old[old.index(END):]
    else:
        text = "\n".join(lines[:2]) + "\n" + BEGIN + "\n" + generated + END + "\n"
    path.write_text(text)
    print(f"wrote {path} ({len(text)} chars; generated part between the markers)")


BEGIN = "<!-- BEGIN GENERATED by tests/thirdparty/dump_findings.py: do not edit below -->"
END = "<!-- END GENERATED -->"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)

"""Conformance helpers: the models as cases, an independent reader of final graphs, and the gloo parity worker.

Nothing here imports overlapcfg's scheduler, merger or attribution. The graph readers look only at the FX graph
(op targets, node order, ``meta["val"]`` shapes, aot's ``meta["desc"]`` and dynamo's ``grapharg`` sources), so a
bug in overlapcfg cannot hide behind an assumption shared with its own code. The one place overlapcfg is used is
``parity_worker``, which must compile with ``overlapcfg.backend`` to compare it against an untransformed run.

Depth semantics (as ``tests/support/checker.py`` documents them; FSDP2 ``set_modules_to_forward_prefetch``):

- all-gathers of one graph, merged buckets ``0..n-1`` in compute order (order of their waits), each asking for
  ``k``: the achieved depth of bucket ``j`` is the number of OTHER merged all-gathers started before ``j``'s wait
  and waited after it; expected ``min(k, n - 1 - j)``;
- reduce-scatters, merged buckets in issue order, each asking for ``d``: the achieved delay of bucket ``i`` is the
  number of later merged reduce-scatter starts before ``i``'s wait; expected ``min(d, n - 1 - i)``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from . import graph_trainer as G
from . import models as M

__all__ = [
    "CASES",
    "Case",
    "Coll",
    "build",
    "bucket_numels",
    "collectives",
    "compute_order_numels",
    "counts",
    "custom_module",
    "direction",
    "expected_depths",
    "gathered_param",
    "joint_apply",
    "merged",
    "of_direction",
    "param_shapes",
    "parity_worker",
    "prefetch_depths",
    "reduce_scatter_delays",
    "reduced_param",
    "signature",
    "summed_partials",
    "whole_step_bucket_numels",
    "source_fqn",
    "spied_backend",
]

_c10d = torch.ops._c10d_functional
_KIND = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.all_gather_into_tensor_out.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_reduce.default: "all_reduce",
}
_WAIT = _c10d.wait_tensor.default


# --- cases ----------------------------------------------------------------------------------------------------------

def _hf_bucket(fqn: str) -> str:
    """``hf_decoder_layers`` written out by hand: embedding, one bucket per decoder layer, ``[norm, lm_head]``."""
    parts = fqn.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"layers.{parts[2]}"
    if parts[:2] == ["model", "embed_tokens"]:
        return "embed"
    if parts[:2] == ["model", "norm"] or parts[0] == "lm_head":
        return "head"
    raise AssertionError(f"no bucket for {fqn}")


def _mixtral_bucket(fqn: str) -> str:
    """Mixtral with dense and experts in separate buckets per layer."""
    parts = fqn.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"layers.{parts[2]}.{'experts' if parts[3:5] == ['mlp', 'experts'] else 'dense'}"
    return _hf_bucket(fqn)


def _tt_bucket(fqn: str) -> str:
    """``torchtitan_layers`` by hand: ``tok_embeddings``, ``layers.N``, ``[norm, lm_head]``."""
    parts = fqn.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}"
    if parts[0] == "tok_embeddings":
        return "embed"
    if parts[0] in ("norm", "lm_head"):
        return "head"
    raise AssertionError(f"no bucket for {fqn}")


def _t5_bucket(fqn: str) -> str:
    """``T5_PLAN`` by hand. The shared embedding's owner is the module that uses it first (``encoder.embed_tokens``),
    whichever use a collective serves; ``decoder.embed_tokens`` and ``lm_head`` own nothing else."""
    parts = fqn.split(".")
    if parts[0] in ("shared", "lm_head") or parts[1:2] == ["embed_tokens"]:
        return "embed"
    if parts[1] == "block":
        return f"{parts[0]}.block.{parts[2]}"
    if fqn == "encoder.final_layer_norm":
        return "encoder.final_layer_norm"
    if fqn == "decoder.final_layer_norm":
        return "head"
    raise AssertionError(f"no bucket for {fqn}")


T5_PLAN: dict[str, Any] = {
    "buckets": ["encoder.embed_tokens", "encoder.block.*", "encoder.final_layer_norm", "decoder.block.*",
                ["decoder.final_layer_norm", "lm_head"]],
    "require_full_coverage": True,
}


NEOX_PLAN: dict[str, Any] = {
    "buckets": ["gpt_neox.embed_in", "gpt_neox.layers.*", ["gpt_neox.final_layer_norm", "lm_head"]],
}


def _neox_bucket(fqn: str) -> str:
    """``NEOX_PLAN`` by hand: embedding, one bucket per layer, the final norm with the output projection."""
    parts = fqn.split(".")
    if parts[:2] == ["gpt_neox", "layers"]:
        return f"layers.{parts[2]}"
    if parts[:2] == ["gpt_neox", "embed_in"]:
        return "embed"
    if parts[:2] == ["gpt_neox", "final_layer_norm"] or parts[0] == "lm_head":
        return "head"
    raise AssertionError(f"no bucket for {fqn}")


MIXTRAL_PLAN: dict[str, Any] = {
    "buckets": [
        "model.embed_tokens",
        {"modules": ["model.layers.*.self_attn", "model.layers.*.input_layernorm",
                     "model.layers.*.post_attention_layernorm", "model.layers.*.mlp.gate"],
         "per": "model.layers.*"},
        {"modules": ["model.layers.*.mlp.experts"], "per": "model.layers.*"},
        ["model.norm", "lm_head"],
    ],
    "require_full_coverage": True,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    world_size: int
    plan: str | Mapping[str, Any]
    bucket_of: Callable[[str], str]
    hf: str | None = None  # models.<hf> builder
    torchtitan: str | None = None  # data_parallel mode
    graph_trainer: str | None = None  # graph_trainer.build_model name (torchtitan's graph-trainer models)

    @property
    def needs_group(self) -> bool:
        """torchtitan's DeviceMesh binds the process group at shard time: build inside it."""
        return self.torchtitan is not None or self.graph_trainer is not None

    def config(self, depth: int, **extra: Any) -> dict[str, Any]:
        """A ``manual`` config asking for ``depth`` everywhere (prefetch both ways, reduce-scatter delay)."""
        policy = {"forward_prefetch": depth, "backward_prefetch": depth, "reduce_scatter_delay": depth}
        return {"strategy": "manual", "plan": self.plan, "policy": policy, **extra}


CASES: dict[str, Case] = {c.name: c for c in (
    Case("hf_llama", 2, "hf_decoder_layers", _hf_bucket, hf="hf_llama"),
    Case("hf_qwen2", 2, "hf_decoder_layers", _hf_bucket, hf="hf_qwen2"),
    Case("hf_mixtral", 2, MIXTRAL_PLAN, _mixtral_bucket, hf="hf_mixtral"),
    Case("hf_tied", 2, "hf_decoder_layers", _hf_bucket, hf="hf_tied"),
    Case("tt_fully_shard", 2, "torchtitan_layers", _tt_bucket, torchtitan="fully_shard"),
    Case("tt_hybrid_shard", 4, "torchtitan_layers", _tt_bucket, torchtitan="hybrid_shard"),
    Case("hf_t5", 2, T5_PLAN, _t5_bucket, hf="hf_t5"),
    Case("tt_qwen3_tied", 2, "torchtitan_layers", _tt_bucket, graph_trainer="qwen3_tied"),
    Case("hf_gpt_neox", 2, NEOX_PLAN, _neox_bucket, hf="hf_gpt_neox"),
)}


def build(case: Case, rank: int = 0) -> tuple[nn.Module, Callable[[], M.Batch]]:
    """The case's model sharded for ``rank`` (torchtitan: needs the default process group already open)."""
    if case.torchtitan is not None:
        return M.torchtitan_llama3(case.torchtitan)
    if case.graph_trainer is not None:
        model = G.build_model(case.graph_trainer)
        tokens, labels, _ = G.batch()

        def make_batch() -> M.Batch:
            return (tokens,), M._logits_loss(labels)

        return model, make_batch
    assert case.hf is not None
    model, make_batch = getattr(M, case.hf)()
    M.shard_simple_fsdp(model, world_size=case.world_size, rank=rank, reshard_after_forward=True)
    return model, make_batch


def param_shapes(model: nn.Module, world_size: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``user FQN -> (local shard shape, full shape)``, every name of a shared parameter included (dynamo names a
    shared weight by its first access: T5's ``encoder.embed_tokens.weight``, not ``shared.weight``). DTensor
    parameters know both shapes; ``shard_simple_fsdp`` shards are dim-0 chunks of ``world_size``."""
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        to_local = getattr(p, "to_local", None)
        if to_local is not None:  # DTensor
            out[name] = (tuple(to_local().shape), tuple(p.shape))
        else:
            shard = tuple(p.shape)
            out[M.user_fqn(name)] = (shard, (shard[0] * world_size, *shard[1:]))
    return out


# --- reading a graph ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Coll:
    kind: str
    start: fx.Node
    wait: fx.Node

    @property
    def numel(self) -> int:
        """All-gather: output elements; reduce-scatter / all-reduce: input elements (the full-size side)."""
        node = self.start if self.kind == "all_gather" else self.start.args[0]
        return int(node.meta["val"].numel())


def collectives(gm: fx.GraphModule) -> list[Coll]:
    """Every ``_c10d_functional`` all-gather / reduce-scatter / all-reduce start with its single wait, graph order."""
    out = []
    for node in gm.graph.nodes:
        kind = _KIND.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        waits = [u for u in node.users if u.target is _WAIT]
        if len(waits) != 1:
            raise AssertionError(f"{node.name}: {len(waits)} waits")
        out.append(Coll(kind, node, waits[0]))
    return out


def start_counts(gm: fx.GraphModule) -> dict[str, int]:
    """``counts`` for a graph as torch made it, where a collective may be waited more than once (the tracer's CSE
    of two equal reduce-scatters leaves one wait per use: GPT-NeoX's parallel blocks)."""
    return dict(Counter(_KIND[n.target] for n in gm.graph.nodes if n.op == "call_function" and n.target in _KIND))


def counts(gm: fx.GraphModule) -> dict[str, int]:
    return dict(Counter(c.kind for c in collectives(gm)))


def signature(c: Coll) -> tuple[str, str, tuple[str, ...]]:
    return (c.start.name, str(c.start.target), tuple(a.name for a in c.start.all_input_nodes))


def merged(final: fx.GraphModule, original: fx.GraphModule, kind: str) -> list[Coll]:
    """Collectives of ``kind`` in ``final`` that are not an original one left as it was (same name, op, inputs)."""
    kept = {signature(c) for c in collectives(original)}
    return [c for c in collectives(final) if c.kind == kind and signature(c) not in kept]


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def prefetch_depths(gm: fx.GraphModule, ags: Sequence[Coll]) -> list[int]:
    """Per all-gather in compute order (wait order): other all-gathers started before its wait, waited after."""
    pos = _positions(gm)
    ordered = sorted(ags, key=lambda c: pos[c.wait])
    return [sum(1 for o in ordered if o is not c and pos[o.start] < pos[c.wait] < pos[o.wait]) for c in ordered]


def compute_order_numels(gm: fx.GraphModule, ags: Sequence[Coll]) -> list[int]:
    pos = _positions(gm)
    return [c.numel for c in sorted(ags, key=lambda c: pos[c.wait])]


def reduce_scatter_delays(gm: fx.GraphModule, rss: Sequence[Coll]) -> list[int]:
    """Per reduce-scatter in issue order: later reduce-scatter starts placed before its wait."""
    pos = _positions(gm)
    ordered = sorted(rss, key=lambda c: pos[c.start])
    return [sum(1 for later in ordered[i + 1:] if pos[later.start] < pos[c.wait]) for i, c in enumerate(ordered)]


def expected_depths(k: int, n: int) -> list[int]:
    return [min(k, n - 1 - j) for j in range(n)]


# --- whole-step graphs: both directions in one graph -----------------------------------------------------------------

def direction(node: fx.Node) -> str:
    """``backward`` for nodes autograd (or torchtitan's remat pass, for recomputed forward ops) tagged
    ``autograd_backward``, else ``forward``; merged collectives inherit the tag of what they merge."""
    return "backward" if node.meta.get("autograd_backward", False) else "forward"


def of_direction(colls: Sequence[Coll], which: str) -> list[Coll]:
    return [c for c in colls if direction(c.start) == which]


def custom_module(node: fx.Node) -> str:
    """torchtitan's own annotation of the module a node belongs to (``annotate_module_fqns``)."""
    fqn = (node.meta.get("custom") or {}).get("module_fqn")
    if not isinstance(fqn, str):
        raise AssertionError(f"{node.name}: no meta['custom']['module_fqn']")
    return fqn


def whole_step_bucket_numels(original: fx.GraphModule, kind: str, which: str,
                             bucket_of: Callable[[str], str]) -> dict[str, int]:
    """Full-size elements per bucket over the original collectives of ``kind`` in direction ``which``, first use
    order (all-gathers: by first wait; reduce-scatters: by first start). A collective's module is torchtitan's
    annotation; the partial gradients of one shared weight (reduce-scatter waits summed by a tree of adds) all
    belong to the module whose partial is issued last (its first user in forward)."""
    pos = _positions(original)
    colls = of_direction([c for c in collectives(original) if c.kind == kind], which)
    owner: dict[fx.Node, str] = {c.start: custom_module(c.start) for c in colls}
    if kind == "reduce_scatter":
        trees: dict[fx.Node, list[Coll]] = {}
        for c in colls:
            root = summed_partials(c.wait)
            if root is not None:
                trees.setdefault(root, []).append(c)
        for members in trees.values():
            last = max(members, key=lambda c: pos[c.start])
            for c in members:
                owner[c.start] = owner[last.start]
    firsts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for c in colls:
        bucket = bucket_of(owner[c.start])
        sizes[bucket] = sizes.get(bucket, 0) + c.numel
        at = pos[c.wait] if kind == "all_gather" else pos[c.start]
        firsts[bucket] = min(firsts.get(bucket, at), at)
    return {b: sizes[b] for b in sorted(firsts, key=firsts.__getitem__)}


def joint_apply(gm: fx.GraphModule, cfg: Mapping[str, Any]) -> fx.GraphModule:
    """The pass torchtitan's graph-trainer pipeline runs (``overlapcfg_bucketing_pass``: ``overlapcfg.apply(gm, cfg,
    graph_kind="joint")``, then the same-schedule check across the job's ranks): the transform the whole-step gloo
    parity worker (``graph_trainer.whole_step_parity_worker``) runs on each rank; with ``parity_worker`` the only
    use of overlapcfg in this module."""
    import overlapcfg
    from overlapcfg.integrations.torchtitan.graph_trainer import overlapcfg_bucketing_pass

    return overlapcfg_bucketing_pass(gm, cfg=overlapcfg.load_config(dict(cfg)))


# --- which parameter a collective carries, from aot descriptors and dynamo sources ------------------------------

_ROOT = re.compile(r"^[LG]\['[^']*'\](?:\[\d+\])?")
_SEGMENT = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")


def source_fqn(source: str) -> str:
    """``L['args'][0]._modules['model']...._modules['parametrizations']._modules['weight']._parameters['original']``
    -> ``model.<...>.weight`` (FINDINGS.md, "Descriptor -> parameter FQN", step 5)."""
    root = _ROOT.match(source)
    if root is None:
        raise AssertionError(f"unexpected dynamo source {source!r}")
    rest = source[root.end():]
    parts = _SEGMENT.findall(rest)
    if "".join(f"._x['{p}']" for p in parts) != re.sub(r"\._(?:modules|parameters|buffers)\[", "._x[", rest):
        raise AssertionError(f"unexpected dynamo source {source!r}")
    return M.user_fqn(".".join(parts))


def _dynamo_inputs(dynamo_gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]


def _source_name(node: fx.Node) -> str:
    name = node.meta["grapharg"].source.name
    return name() if callable(name) else name


def _plain_index(desc: Any) -> tuple[int, str | None]:
    attr = None
    while type(desc).__name__ == "SubclassGetAttrAOTInput":
        attr = attr or desc.attr
        desc = desc.base
    if type(desc).__name__ != "PlainAOTInput":
        raise AssertionError(f"unexpected aot input descriptor {desc!r}")
    return desc.idx, attr


def _input_fqn(desc: Any, dynamo_gm: fx.GraphModule) -> str:
    idx, attr = _plain_index(desc)
    if attr not in (None, "_local_tensor"):
        raise AssertionError(f"descriptor {desc!r} is not a parameter tensor")
    return source_fqn(_source_name(_dynamo_inputs(dynamo_gm)[idx]))


def gathered_param(start: fx.Node, dynamo_gm: fx.GraphModule) -> str:
    """The parameter an (original) all-gather gathers: its input placeholder's descriptor -> dynamo source."""
    src = start.args[0]
    if not (isinstance(src, fx.Node) and src.op == "placeholder"):
        raise AssertionError(f"{start.name}: input is not a placeholder")
    return _input_fqn(src.meta["desc"], dynamo_gm)


def summed_partials(wait: fx.Node) -> fx.Node | None:
    """If ``wait`` is one leaf of a tree of ``add`` ops whose leaves are all collective waits (the partial
    gradients of a parameter used by several modules), the root of that tree; else None."""
    def leaves_ok(node: fx.Node) -> bool:
        if node.target is _WAIT:
            return True
        return node.op == "call_function" and "add" in str(node.target) and all(
            leaves_ok(i) for i in node.all_input_nodes)

    node, root = wait, None
    while len(node.users) == 1:
        user = next(iter(node.users))
        if not (user.op == "call_function" and "add" in str(user.target) and leaves_ok(user)):
            break
        node = root = user
    return root


def reduced_param(wait: fx.Node, dynamo_gm: fx.GraphModule, *, through_sum: bool = True) -> str | None:
    """The parameter whose gradient an (original) reduce-scatter's wait is returned as. ``through_sum``: also
    through a tree of ``add`` ops summing reduce-scatter waits (a shared weight's partial gradients, one per use:
    two for tied embeddings, three for T5's shared embedding; FINDINGS.md); else None."""
    node = wait
    root = summed_partials(wait) if through_sum else None
    if root is not None:
        node = root
    outputs = [u for u in node.users if u.op == "output"]
    if not outputs:
        return None
    out = outputs[0]
    desc = out.meta["desc"][list(out.args[0]).index(node)]
    while type(desc).__name__ == "SubclassGetAttrAOTOutput":
        desc = desc.base
    if type(desc).__name__ != "GradAOTOutput":
        raise AssertionError(f"unexpected output descriptor {desc!r}")
    return _input_fqn(desc.grad_of, dynamo_gm)


def bucket_numels(original: fx.GraphModule, dynamo_gm: fx.GraphModule, kind: str,
                  bucket_of: Callable[[str], str], skip: Container[str] = ()) -> dict[str, int]:
    """Full-size elements per bucket over the original FSDP collectives of ``kind``, first use order (all-gathers:
    by first wait; reduce-scatters: by first start)."""
    pos = _positions(original)
    firsts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for c in collectives(original):
        if c.kind != kind or c.start.name in skip:
            continue
        param = gathered_param(c.start, dynamo_gm) if kind == "all_gather" else reduced_param(c.wait, dynamo_gm)
        if param is None:
            continue
        bucket = bucket_of(param.rpartition(".")[0])
        sizes[bucket] = sizes.get(bucket, 0) + c.numel
        at = pos[c.wait] if kind == "all_gather" else pos[c.start]
        firsts[bucket] = min(firsts.get(bucket, at), at)
    return {b: sizes[b] for b in sorted(firsts, key=firsts.__getitem__)}


def spied_backend(be: Any, dynamo: list[fx.GraphModule], pre: dict[str, fx.GraphModule]) -> Callable[..., Any]:
    """Wrap a ``GraphBackend``: keep the dynamo graph it receives and copies of aot's graphs before its passes."""
    for name, attr in (("forward", "fw_pass"), ("backward", "bw_pass")):
        inner = getattr(be, attr)

        def spy(gm: fx.GraphModule, inner: Any = inner, name: str = name) -> fx.GraphModule:
            pre[name] = M.copy_graph_module(gm)
            return inner(gm) if inner is not None else gm

        setattr(be, attr, spy)

    def outer(gm: fx.GraphModule, inputs: Any) -> Any:
        dynamo.append(M.copy_graph_module(gm))
        return be(gm, inputs)

    return outer


# --- 2-rank gloo parity ----------------------------------------------------------------------------------------------

def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            to_local = getattr(g, "to_local", None)
            out[name] = (to_local() if to_local is not None else g).detach().clone()
    return out


def _step(model: nn.Module, make_batch: Callable[[], M.Batch], cfg: Mapping[str, Any]) -> dict[str, Any]:
    import overlapcfg

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    be = overlapcfg.backend(dict(cfg))
    inputs, loss_fn = make_batch()
    loss = loss_fn(torch.compile(model, backend=be, fullgraph=True)(*inputs))
    loss.backward()
    records = {name: gm.meta["overlapcfg"] for name, gm in be.graphs.items()}
    result = {
        "loss": loss.detach().clone(),
        "grads": _grads(model),
        # The untransformed reference is counted as torch made it; a transformed graph waits each collective once.
        "counts": {name: (start_counts if cfg.get("strategy") == "none" else counts)(gm)
                   for name, gm in be.graphs.items()},
        "uncovered": sum(len(r.uncovered) for r in records.values()),
        "same_schedule": [r.same_schedule for r in records.values()],  # what the check found, per graph
    }
    torch._dynamo.reset()
    return result


def parity_worker(rank: int, world_size: int, jobs: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """For each ``(case name, cfg)``: one step with ``backend(cfg)`` and one with ``backend({"strategy": "none"})``
    on the same freshly built, rank-sharded model (same seed on every rank), plus (HF) the unsharded eager loss as
    a sanity reference. One spawn for all jobs: each rank imports torch and the model libraries once."""
    out: dict[str, Any] = {}
    for case_name, cfg in jobs:
        case = CASES[case_name]
        if world_size != case.world_size:
            raise ValueError(f"{case_name} runs at world size {case.world_size}, got {world_size}")
        started = time.perf_counter()
        model, make_batch = build(case, rank)
        res = {"transformed": _step(model, make_batch, cfg),
               "reference": _step(model, make_batch, {"strategy": "none"})}
        if case.hf is not None:
            eager, _ = getattr(M, case.hf)()
            inputs, loss_fn = make_batch()
            with torch.no_grad():
                res["eager_loss"] = loss_fn(eager(*inputs)).detach()
        res["seconds"] = time.perf_counter() - started
        out[case_name] = res
    return out


def skew_worker(rank: int, world_size: int, mix: Any, trials: int) -> Any:
    """``time_skew`` on the default group, at the compute and the probe all-gather ``mix`` (a ``MatmulMix`` read
    from a model's captured graphs) asks for: every rank returns the same gathered ``SkewTimings``."""
    import torch.distributed as dist

    from overlapcfg.measuring.clock import Clock
    from overlapcfg.measuring.skew import skew_unit, time_skew

    return time_skew("world", dist.group.WORLD, dtype=torch.float32, clock=Clock("cpu"), trials=trials,
                     unit_spec=skew_unit(mix))


def measure_worker(rank: int, world_size: int, case_name: str, configs: Mapping[str, Mapping[str, Any]]) -> Any:
    """``overlapcfg.measure`` of ``configs`` on the case's model, freshly built and sharded for this rank for each
    config (the step ``measure`` is handed: zeroed gradients, forward, loss, backward), at the smallest useful
    sizes: one warm-up step, two timed, one profiled, no node costs. Every rank returns the same measurement."""
    import overlapcfg

    case = CASES[case_name]

    def make_step(backend: Any) -> Callable[[], object]:
        model, make_batch = build(case, rank)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        inputs, loss_fn = make_batch()

        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(compiled(*inputs)).backward()

        return step

    result = overlapcfg.measure(make_step, {k: dict(v) for k, v in configs.items()}, hardware="cpu_gloo", warmup=1,
                                steps=2, profiled_steps=1, node_costs=False, interleave=False)
    return result.to_dict()

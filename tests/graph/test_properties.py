"""Properties, fast tier: the pass on synthetic FSDP graphs (``tests/support/synthetic.py``, nothing traced) and plan
resolution on random module trees (torch-free).

The scheduler's results are measured here from the final graph alone: the merged collectives' tags
(``node.meta["overlapcfg"]``: part and sources), node positions and the owners the builder wrote down. Bucket
membership comes from the builder's layers and this file's own reading of the plan, and the expected depths from
the semantics in ``tests/support/checker.py``'s docstring, so a scheduler or resolver bug cannot hide behind a shared
assumption. Nothing here imports ``overlapcfg.graph.schedule``.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import fx

from overlapcfg import compat, load_config
from overlapcfg.errors import OverlapConfigError, UpstreamPassError
from overlapcfg.graph.collectives import group_name
from overlapcfg.graph.stamp import forget_traces
from overlapcfg.passes import PassOptions, apply
from overlapcfg.resolve import resolve_plan
from tests.support.policies import LookaheadPolicy
from tests.support.synthetic import DIM, Synthetic, backward_graph, forward_graph, new_capture

_c10d = torch.ops._c10d_functional
_WAIT = _c10d.wait_tensor.default
_STARTS = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.all_gather_into_tensor_out.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
}
FIELDS = ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay")
GRAPH = settings(max_examples=8, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

ONE_CAPTURE = new_capture()
"""The fake mode of the graphs this file draws or builds for the pass: one capture, so a bucket merge of a given
signature is traced once for the file (``overlapcfg.graph.traces``), not once per hypothesis example. Safe to
share: a trace is a function of its signature (``test_merge_traces``), and the pass rewrites copies."""


# --- the oracle: expected depths from the spec, achieved depths from the graph ---------------------------------

def expected_prefetch(ks: Sequence[int], sizes: Sequence[int], cap: int | None) -> list[int]:
    """``tests/support/checker.py``'s rule: ``reach_j`` is the largest ``r <= min(j + k_j, n - 1)`` whose buckets
    ``j..r`` fit the cap, but never below ``max(reach_{j-1}, j)``; the depth is ``reach_j - j``."""
    reach: list[int] = []
    for j, k in enumerate(ks):
        fits = [r for r in range(j, min(j + k, len(ks) - 1) + 1) if cap is None or sum(sizes[j:r + 1]) <= cap]
        reach.append(max([j, *fits, *reach[-1:]]))
    return [r - j for j, r in enumerate(reach)]


def expected_delays(ds: Sequence[int]) -> list[int]:
    return [min(d, len(ds) - 1 - i) for i, d in enumerate(ds)]


@dataclass(frozen=True, slots=True)
class Placed:
    """A merged collective of the final graph: its bucket (by this file's reading), kind, start and wait."""

    bucket: int
    kind: str
    start: fx.Node
    wait: fx.Node


def placed_collectives(gm: fx.GraphModule, syn: Synthetic, bucket_of_layer: Callable[[int], int]) -> list[Placed]:
    """Every collective start of the final graph, in graph order; each must be merged and waited exactly once."""
    out = []
    for node in gm.graph.nodes:
        kind = _STARTS.get(node.target)  # type: ignore[arg-type]
        if kind is None:
            continue
        tag = node.meta.get("overlapcfg")
        assert isinstance(tag, dict) and tag.get("part") == "start", f"{node.name} was left unmerged"
        buckets = {bucket_of_layer(int(syn.owners[s].split(".")[1])) for s in tag["sources"]}
        assert len(buckets) == 1, f"{node.name} merges collectives of buckets {sorted(buckets)}"
        waits = [u for u in node.users if u.target is _WAIT]
        assert len(waits) == 1 and len(node.users) == 1, f"{node.name} is read by {list(node.users)}"
        out.append(Placed(buckets.pop(), kind, node, waits[0]))
    return out


def achieved_prefetch(gm: fx.GraphModule, ags: Sequence[Placed]) -> dict[int, int]:
    """Per bucket: all-gathers of other buckets issued but not yet waited when its wait runs."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    return {m.bucket: sum(1 for o in ags if o is not m and pos[o.start] < pos[m.wait] < pos[o.wait]) for m in ags}


def achieved_delays(gm: fx.GraphModule, rss: Sequence[Placed]) -> dict[int, int]:
    """Per bucket: reduce-scatters issued after it whose starts precede its wait."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    ordered = sorted(rss, key=lambda m: pos[m.start])
    return {m.bucket: sum(1 for later in ordered[i + 1:] if pos[later.start] < pos[m.wait])
            for i, m in enumerate(ordered)}


def assert_well_formed(gm: fx.GraphModule) -> None:
    """Lint, topological order, and every collective start waited exactly once, after it."""
    gm.graph.lint()
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        assert all(pos[i] < pos[node] for i in node.all_input_nodes), f"{node.name} reads a later node"
        if node.target in _STARTS:
            waits = [u for u in node.users if u.target is _WAIT]
            assert len(waits) == 1 and pos[waits[0]] > pos[node], f"{node.name}: waits {waits}"


# --- random scheduler configs ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Case:
    layers: tuple[tuple[int, ...], ...]
    group: int
    """Layers per bucket: 1 is the pattern ``layers.*``, more a ``{modules: [layers.*], group_size: g}`` entry."""
    policy: dict[str, int]
    entry: dict[str, int]
    """Depths written on the plan entry (group entries only)."""
    overrides: tuple[tuple[int, int, str, int], ...]
    """``(first layer, end layer, field, value)``: ``{match: layers.a:b, field: value}``."""
    cap: int | None
    descriptors: bool

    @property
    def n_buckets(self) -> int:
        return -(-len(self.layers) // self.group)

    def config(self) -> dict[str, Any]:
        entry: Any = "layers.*" if self.group == 1 else {"modules": ["layers.*"], "group_size": self.group,
                                                       **self.entry}
        policy: dict[str, Any] = dict(self.policy)
        if self.cap is not None:
            policy["max_inflight_bytes"] = self.cap
        overrides = [{"match": f"layers.{a}" if b == a + 1 else f"layers.{a}:{b}", field: v}
                     for a, b, field, v in self.overrides]
        return {"plan": {"buckets": [entry], "require_full_coverage": True}, "policy": policy,
                "overrides": overrides}

    def depths(self, field: str) -> list[int]:
        """Requested depth of each bucket (layer order): policy, then the entry, then each override in order."""
        value = self.entry.get(field, self.policy[field]) if self.group > 1 else self.policy[field]
        out = [value] * self.n_buckets
        for a, b, f, v in self.overrides:
            if f == field:
                for layer in range(a, min(b, len(self.layers))):
                    out[layer // self.group] = v
        return out

    def sizes(self, syn: Synthetic) -> list[int]:
        out = [0] * self.n_buckets
        for layer, nbytes in enumerate(syn.layer_bytes):
            out[layer // self.group] += nbytes
        return out


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layers = tuple(draw(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
                                 min_size=2, max_size=6)))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    depth = st.integers(0, 3)
    policy = {f: draw(depth) for f in FIELDS}
    entry = {f: draw(depth) for f in draw(st.lists(st.sampled_from(FIELDS), unique=True))} if group > 1 else {}
    n = len(layers)
    overrides = []
    for _ in range(draw(st.integers(0, 3))):
        a = draw(st.integers(0, n - 1))
        # ranges end at the last layer at most: one reaching past the model is a fault (test_resolve)
        overrides.append((a, draw(st.integers(a + 1, n)), draw(st.sampled_from(FIELDS)), draw(depth)))
    # From half the smallest bucket (it binds everywhere) to twice the largest (it binds nowhere); one shard row
    # gathers to two ranks of DIM float32 columns.
    buckets = [2 * DIM * 4 * sum(sum(p) for p in layers[i:i + group]) for i in range(0, n, group)]
    cap = None if draw(st.integers(0, 2)) == 0 else draw(st.integers(min(buckets) // 2, 2 * max(buckets)))
    return Case(layers, group, policy, entry, tuple(overrides), cap, draw(st.booleans()))


def _apply(syn: Synthetic, cfg: dict[str, Any]) -> fx.GraphModule:
    """The pass on a copy of ``syn``'s graph. The copy is lazy (``compat.lazy_graph_module_copy``, what the backend
    and ``explain`` give the pass): its Python code, and the pass's closing ``recompile``, are written only where a
    test reads ``.code``; ``copy.deepcopy`` would generate and compile it twice for each of the hundreds of applies
    here, which read the graph only."""
    with compat.fake_process_group(syn.world_size, 0):
        return apply(compat.lazy_graph_module_copy(syn.gm), load_config(cfg), module_fqns=syn.module_fqns,
                     graph_kind=syn.kind)


def _check_all_gathers(gm: fx.GraphModule, case: Case, syn: Synthetic, placed: list[Placed], field: str,
                       reverse: bool) -> None:
    order = list(range(case.n_buckets))[::-1 if reverse else 1]  # compute order
    ags = [p for p in placed if p.kind == "all_gather"]
    assert [p.bucket for p in ags] == order, "all-gathers must be issued in compute order"
    ks, sizes = case.depths(field), case.sizes(syn)
    want = expected_prefetch([ks[b] for b in order], [sizes[b] for b in order], case.cap)
    event(f"the byte cap binds: {want != expected_prefetch([ks[b] for b in order], [], None)}")
    got = achieved_prefetch(gm, ags)
    assert [got[b] for b in order] == want, f"{field}: requested {[ks[b] for b in order]}"
    decisions = [d for d in gm.meta["overlapcfg"].decisions if d.kind == "all_gather"]
    assert [(d.position, d.requested, d.effective) for d in decisions] == [
        (i, ks[b], got[b]) for i, b in enumerate(order)], "the record must say what the graph does"


@given(case=cases())
@GRAPH
def test_forward_schedule_reaches_the_specified_depths_and_is_deterministic(case: Case) -> None:
    syn = forward_graph(case.layers, descriptors=case.descriptors, fake_mode=ONE_CAPTURE)
    gm = _apply(syn, case.config())  # verify: on by default, raises on any fault
    assert_well_formed(gm)
    placed = placed_collectives(gm, syn, lambda layer: layer // case.group)
    assert {p.kind for p in placed} == {"all_gather"}
    _check_all_gathers(gm, case, syn, placed, "forward_prefetch", reverse=False)
    assert _apply(syn, case.config()).code == gm.code


@given(case=cases(), regather=st.sampled_from([True, True, False]))
@GRAPH
def test_backward_schedule_reaches_the_specified_depths_and_delays(case: Case, regather: bool) -> None:
    syn = backward_graph(case.layers, descriptors=case.descriptors, regather=regather, fake_mode=ONE_CAPTURE)
    gm = _apply(syn, case.config())
    assert_well_formed(gm)
    placed = placed_collectives(gm, syn, lambda layer: layer // case.group)
    if regather:
        _check_all_gathers(gm, case, syn, placed, "backward_prefetch", reverse=True)
    else:
        assert not any(p.kind == "all_gather" for p in placed)
    rss = [p for p in placed if p.kind == "reduce_scatter"]
    issue = list(range(case.n_buckets))[::-1]
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert [p.bucket for p in sorted(rss, key=lambda p: pos[p.start])] == issue
    ds = case.depths("reduce_scatter_delay")
    got = achieved_delays(gm, rss)
    assert [got[b] for b in issue] == expected_delays([ds[b] for b in issue])
    decisions = [d for d in gm.meta["overlapcfg"].decisions if d.kind == "reduce_scatter"]
    assert [(d.requested, d.effective) for d in decisions] == [(ds[b], got[b]) for b in issue]
    assert _apply(syn, case.config()).code == gm.code


def test_synthetic_graphs_have_what_the_pass_needs() -> None:
    """The builder's promises: fake values everywhere, FSDP reduce-scatters."""
    syn = backward_graph([[1, 2], [3], [1, 1, 1]], regather=True)
    nodes = [n for n in syn.gm.graph.nodes if n.op != "output"]
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in nodes)
    rs = [n for n in nodes if n.target is _c10d.reduce_scatter_tensor.default]
    assert len(rs) == 6 and all(compat.is_fsdp_reduce_scatter(n) for n in rs)
    assert sorted(set(syn.owners.values())) == ["layers.0.wk", "layers.0.wq", "layers.1.wq", "layers.2.wk",
                                                "layers.2.wq", "layers.2.wv"]


@pytest.mark.parametrize("descriptors", [False, True])
def test_synthetic_collectives_are_classified_and_attributed(descriptors: bool) -> None:
    from overlapcfg.graph.attribution import module_fqn
    from overlapcfg.graph.collectives import find_collectives

    syn = backward_graph([[1], [2, 2]], descriptors=descriptors, regather=True)
    found = find_collectives(syn.gm.graph, module_fqn, direction="backward")
    assert [(c.kind, c.fsdp, c.module_fqn) for c in found] == [
        ("all_gather", True, "layers.1.wk"), ("reduce_scatter", True, "layers.1.wk"),
        ("all_gather", True, "layers.1.wq"), ("reduce_scatter", True, "layers.1.wq"),
        ("all_gather", True, "layers.0.wq"), ("reduce_scatter", True, "layers.0.wq")]


# --- fast stand-ins for traced tests that moved to the slow tier ----------------------------------------------

def test_third_party_strategy_with_its_own_policy_runs_through_apply_on_a_synthetic_graph(
        clean_registry: None) -> None:
    """A policy without depth fields must not break plan resolution; the strategy gets the resolved plan."""
    from overlapcfg.graph.merge import merge_buckets
    from overlapcfg.strategies import StrategyResult
    from overlapcfg.strategies.registry import register_strategy

    made: list[Any] = []

    @register_strategy("merge_only_synthetic", policy=LookaheadPolicy)
    def run(gm: Any, ctx: Any) -> StrategyResult:
        made.append((ctx.plan, ctx.policy))
        return StrategyResult(tuple(merge_buckets(gm, ctx.covered, ctx.plan, "custom_ops")))

    syn = forward_graph([[1, 2], [2], [1, 1]])
    gm = _apply(syn, {"strategy": "merge_only_synthetic", "plan": {"buckets": ["layers.*"]},
                      "policy": {"lookahead": 5}})
    (plan, policy), = made
    assert isinstance(policy, LookaheadPolicy) and policy.lookahead == 5
    assert [b.name for b in plan.buckets] == ["layers.0", "layers.1", "layers.2"]
    assert gm.meta["overlapcfg"].after.fsdp == (("forward", "all_gather", 3),)


def test_settings_a_strategy_does_not_read_are_reported_on_a_synthetic_graph() -> None:
    syn = forward_graph([[1], [2]])
    gm = _apply(syn, {"strategy": "none", "plan": {"buckets": ["layers.*"]}, "policy": {"forward_prefetch": 3},
                      "overrides": [{"match": "layers.0", "forward_prefetch": 0}]})
    assert gm.meta["overlapcfg"].notes == (
        "overlap.plan is ignored: strategy 'none' does not bucket by plan",
        "overlap.overrides are ignored: strategy 'none' does not bucket by plan",
        "overlap.policy is ignored: strategy 'none' reads no policy",
    )
    assert gm.meta["overlapcfg"].after == gm.meta["overlapcfg"].before


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_auto_strategy_runs_upstream_scheduler_on_cpu_and_buckets_a_synthetic_graph(kind: str) -> None:
    syn = (forward_graph if kind == "forward" else backward_graph)([[1, 1], [2], [1, 3]])
    cfg = {"strategy": "auto", "policy": {"collective_bucketing": True}}
    if kind == "backward" and _torch_release() == (2, 12):
        # torch 2.12's scheduler views every gradient it reduce-scatters into its bucket, and a linear's weight
        # gradient is a transpose (torch 2.13 copies instead): torch's own error, the config not at fault
        with pytest.raises(UpstreamPassError, match=r"own pass failed on this graph \(ValueError: Cannot view"):
            _apply(syn, cfg)
        return
    gm = _apply(syn, cfg)
    record = gm.meta["overlapcfg"]
    assert record.strategy == "auto"
    if kind == "forward" and "pre_bucketing_fsdp_collectives" not in compat.auto_scheduler_parameters():
        # torch 2.11's scheduler buckets only collectives it finds exposed by its estimates, and on this tiny forward
        # it finds none; from torch 2.13 on it first pre-buckets FSDP collectives itself.
        assert 0 < record.after.total_fsdp <= record.before.total_fsdp
    else:
        assert 0 < record.after.total_fsdp < record.before.total_fsdp
    assert record.after.other == 0


# --- plan resolution over random module trees (torch-free) ----------------------------------------------------

WORDS = ("layers", "blocks", "attn", "mlp", "norm", "out", "wq")

Tree = dict[str, Any]

trees: st.SearchStrategy[Tree] = st.recursive(
    st.just({}),
    lambda children: st.dictionaries(st.sampled_from(WORDS), children, min_size=1, max_size=3)
    | st.lists(children, min_size=1, max_size=4).map(lambda xs: {str(i): x for i, x in enumerate(xs)}),
    max_leaves=20,
)


def fqns_of(tree: Tree, prefix: str = "") -> list[str]:
    """``named_modules()`` order: parents first, root ``""`` included."""
    out = [prefix] if prefix else [""]
    for name, sub in tree.items():
        out += fqns_of(sub, f"{prefix}.{name}" if prefix else name)
    return out


def inside(fqn: str, module: str) -> bool:
    return module == "" or fqn == module or fqn.startswith(module + ".")


def pattern_matches(pattern: str, fqn: str) -> bool:
    """A small reading of the grammar (literal, ``*``, ``**``, ``a:b``), independent of ``overlapcfg``'s NFA."""
    def seg(p: str, s: str) -> bool:
        if p == "*":
            return True
        m = re.fullmatch(r"(\d*):(\d*)", p)
        if m:
            return s.isdecimal() and int(m[1] or 0) <= int(s) and (not m[2] or int(s) < int(m[2]))
        return p == s

    def walk(ps: list[str], ss: list[str]) -> bool:
        if not ps:
            return not ss
        if ps[0] == "**":
            return any(walk(ps[1:], ss[i:]) for i in range(len(ss) + 1))
        return bool(ss) and seg(ps[0], ss[0]) and walk(ps[1:], ss[1:])

    return walk(pattern.split("."), fqn.split(".") if fqn else [])


@st.composite
def patterns(draw: st.DrawFn, fqns: Sequence[str]) -> str:
    """Mostly a generalisation of a real FQN (``*``, ranges, ``**``), sometimes a name the tree lacks."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(["nothing", "layers.99", "**.nothing", "blocks.*.zz"]))
    parts = draw(st.sampled_from([f for f in fqns if f] or ["layers"])).split(".")
    out = []
    for part in parts:
        choice = draw(st.integers(0, 5))
        if choice == 0:
            out.append("*")
        elif choice == 1 and part.isdecimal():
            i = int(part)
            a, b = draw(st.integers(0, i)), draw(st.integers(i + 1, i + 3))
            out.append(draw(st.sampled_from([f"{a}:{b}", f":{b}", f"{a}:"])))
        else:
            out.append(part)
    cut = draw(st.integers(0, len(out) - 1))
    if draw(st.integers(0, 4)) == 0:
        out = ["**", *out[cut:]]
    elif draw(st.integers(0, 6)) == 0:
        out = [*out[:cut + 1], "**"]
    return ".".join(out)


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[str], list[str], dict[str, Any]]:
    """A module tree's FQNs, parameter owners among them, and a config with a random plan and overrides."""
    fqns = fqns_of(draw(trees))
    owners = draw(st.lists(st.sampled_from(fqns[1:] or [""]), max_size=6, unique=True))
    pat = patterns(fqns)
    entries: list[Any] = []
    for _ in range(draw(st.integers(0, 4))):
        form = draw(st.integers(0, 2))
        if form == 0:
            entries.append(draw(pat))
        elif form == 1:
            entries.append(draw(st.lists(pat, min_size=1, max_size=3)))
        else:
            entry: dict[str, Any] = {"modules": draw(st.lists(pat, min_size=1, max_size=2))}
            if draw(st.booleans()):
                entry["per"] = draw(pat)
            if draw(st.booleans()):
                entry["group_size"] = draw(st.integers(1, 3))
            if draw(st.booleans()):
                entry[draw(st.sampled_from(FIELDS))] = draw(st.integers(0, 3))
            entries.append(entry)
    overrides = [{"match": draw(pat), draw(st.sampled_from(FIELDS)): draw(st.integers(0, 3))}
                 for _ in range(draw(st.integers(0, 2)))]
    cfg = {"plan": {"buckets": entries, "require_full_coverage": draw(st.booleans())},
           "policy": {f: draw(st.integers(0, 3)) for f in FIELDS}, "overrides": overrides}
    return fqns, owners, cfg


def _resolve(fqns: Sequence[str], owners: Sequence[str], cfg: dict[str, Any]) -> Any:
    loaded = load_config(cfg)
    assert loaded.plan is not None
    return resolve_plan(loaded.plan, fqns, owners, overrides=loaded.overrides, policy=loaded.policy)


def _shuffled(xs: Sequence[Any], seed: int) -> list[Any]:
    out = list(xs)
    random.Random(seed).shuffle(out)
    return out


@given(drawn=plans(), seed=st.integers(0, 2**16))
@settings(max_examples=150, deadline=None, derandomize=True)
def test_resolution_invariants_on_random_module_trees(drawn: tuple[list[str], list[str], dict[str, Any]],
                                                      seed: int) -> None:
    fqns, owners, cfg = drawn
    try:
        plan = _resolve(fqns, owners, cfg)
    except OverlapConfigError:
        plan = None  # anything else propagates and fails the test
    event(f"resolved: {plan is not None}")
    # Patterns inside one list or mapping entry are a set (their matches are taken in model order), and owners
    # come back in model order: neither input order may change the outcome.
    permuted = copy.deepcopy(cfg)
    for entry in permuted["plan"]["buckets"]:
        if isinstance(entry, list):
            entry[:] = _shuffled(entry, seed)
        elif isinstance(entry, dict):
            entry["modules"] = _shuffled(entry["modules"], seed)
    try:
        again = _resolve(fqns, _shuffled(owners, seed), permuted)
    except OverlapConfigError:
        again = None
    assert (plan is None) == (again is None)
    if plan is None:
        return
    assert [(b.name, b.modules, b.forward_prefetch, b.backward_prefetch, b.reduce_scatter_delay)
            for b in plan.buckets] == [(b.name, b.modules, b.forward_prefetch, b.backward_prefetch,
                                        b.reduce_scatter_delay) for b in again.buckets]
    assert plan.uncovered == again.uncovered
    assert _resolve(fqns, owners, cfg) == plan  # deterministic

    real = set(fqns)
    for b in plan.buckets:
        assert b.modules and set(b.modules) <= real, f"{b.name}: {b.modules}"
    for fqn in fqns:
        holders = [b.name for b in plan.buckets if any(inside(fqn, m) for m in b.modules)]
        assert len(holders) <= 1, f"{fqn!r} is in buckets {holders}"
    assert len({b.name for b in plan.buckets}) == len(plan.buckets)
    uncovered = [o for o in fqns if o in owners and not any(inside(o, m) for b in plan.buckets for m in b.modules)]
    assert list(plan.uncovered) == uncovered
    if cfg["plan"]["require_full_coverage"]:
        assert not plan.uncovered
    for b in plan.buckets:  # depths: policy, then the entry, then each override reaching the bucket, in order
        entry = cfg["plan"]["buckets"][b.entry_index]
        for f in FIELDS:
            want = entry.get(f, cfg["policy"][f]) if isinstance(entry, dict) else cfg["policy"][f]
            for o in cfg["overrides"]:
                if f in o and any(pattern_matches(o["match"], x) and any(inside(x, m) for m in b.modules)
                                  for x in fqns):
                    want = o[f]
            assert getattr(b, f) == want, f"{b.name}.{f}"


# --- the verifier on synthetic graphs (the traced negative controls live in test_verify_negative, slow tier) ----

VERIFY_LAYERS = ((2, 2, 2), (1, 2, 3), (2, 2, 2), (2, 2, 2))
"""Three parameters per layer, same-shaped pairs in the first bucket either way, two same-sized buckets in a row, a
bucket of mixed shapes (its copy-in has ``foreach_group_indices``): what every breakage needs to find its target."""
VERIFY_CONFIGS = {"merged": {"plan": {"buckets": ["layers.*"]}},
                  "partial": {"plan": {"buckets": ["layers.1:"]}},
                  "coalesced": {"plan": {"buckets": ["layers.*"]}, "policy": {"bucket_mode": "coalesced"}},
                  "stepped": {"plan": {"buckets": ["layers.*"]}}}
"""``stepped``: the graph carries in-place updates of two parameters (``with_in_place_updates``) before the pass."""
_VERIFY_GRAPHS: dict[tuple[str, bool], Synthetic] = {}
_VERIFIED: dict[tuple[str, str], fx.GraphModule] = {}


def _verify_graph(kind: str, stepped: bool = False) -> Synthetic:
    if (kind, stepped) not in _VERIFY_GRAPHS:
        build = forward_graph if kind == "forward" else backward_graph
        syn = build(VERIFY_LAYERS, fake_mode=ONE_CAPTURE, **({} if kind == "forward" else {"regather": True}))
        if stepped:
            from tests.support.in_place import with_in_place_updates

            with_in_place_updates(syn.gm)
        _VERIFY_GRAPHS[(kind, stepped)] = syn
    return _VERIFY_GRAPHS[(kind, stepped)]


def _good(kind: str, config: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(the graph given to the pass, a fresh copy of its verified output) on the synthetic reshard graphs."""
    syn = _verify_graph(kind, stepped=config == "stepped")
    if (kind, config) not in _VERIFIED:
        _VERIFIED[(kind, config)] = _apply(syn, VERIFY_CONFIGS[config])
    return syn.gm, compat.lazy_graph_module_copy(_VERIFIED[(kind, config)])  # breakers edit the graph only


def _breakages() -> list[Any]:
    from tests.support.breakages import BREAKAGES

    return [pytest.param(*getattr(p, "values", p), id=f"{getattr(p, 'values', p)[2].__name__}-"
                         f"{getattr(p, 'values', p)[0]}") for p in BREAKAGES]


@pytest.mark.parametrize(("kind", "config", "breaker"), _breakages())
def test_breakage_of_a_synthetic_graph_is_rejected_naming_the_culprit(kind: str, config: str,
                                                                      breaker: Callable[[fx.GraphModule],
                                                                                        list[str]]) -> None:
    from overlapcfg.errors import OverlapVerificationError
    from overlapcfg.graph.verify import verify

    before, gm = _good(kind, config)
    expected = breaker(gm)
    assert expected, f"{breaker.__name__} names nothing to expect"
    with pytest.raises(OverlapVerificationError) as info:
        verify(before, gm, direction=kind)
    problems = "\n".join(info.value.problems)
    for pattern in expected:
        assert re.search(pattern, problems), f"{pattern!r} not in:\n{problems}"


@pytest.mark.parametrize(("mode", "stepped"), [
    ("default", False), ("custom_ops", False), ("custom_ops_multidtype", False), ("coalesced", False),
    ("default", True), ("custom_ops", True)], ids=lambda v: {True: "in-place-updates", False: ""}.get(v, v))
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_every_bucket_mode_verifies_on_a_synthetic_graph(mode: str, kind: str, stepped: bool) -> None:
    """Also with in-place updates of parameters after their reads (whole-step graphs; the copy-in kinds, the
    ``default`` mode's ``copy_`` into a slice and ``custom_ops``' opaque copy-in): no false alarm."""
    from overlapcfg.graph.verify import summarize, verify

    syn = _verify_graph(kind, stepped)
    before = summarize(syn.gm, direction=kind)  # type: ignore[arg-type]
    for strategy in ("manual", "torch_manual"):
        cfg = {"strategy": strategy, "plan": {"buckets": ["layers.*"]}, "policy": {"bucket_mode": mode},
               "verify": False}
        if strategy == "torch_manual" and mode != "custom_ops" \
                and "bucket_mode" not in compat.manual_bucketing_parameters():
            # torch 2.11's manual_overlap_bucketing has no bucket_mode: refused at the setting, never ignored
            assert _torch_release() < (2, 12), "only torch 2.11 should lack bucket_mode"
            with pytest.raises(OverlapConfigError, match=r"overlap\.policy\.bucket_mode: .*needs torch >= 2\.12"):
                _apply(syn, cfg)
            continue
        if strategy == "torch_manual" and kind == "backward" and mode in ("default", "coalesced") \
                and _torch_release() == (2, 12):
            # torch 2.12's copy-in views every gradient into the bucket, and this one is a transpose (2.13 copies)
            with pytest.raises(UpstreamPassError, match=r"own pass failed on this graph \(ValueError: Cannot view"):
                _apply(syn, cfg)
            continue
        gm = _apply(syn, cfg)
        assert verify(before, gm, direction=kind) is None  # type: ignore[arg-type]


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_control_deps_wrapped_waits_verify_on_a_synthetic_graph(kind: str) -> None:
    from overlapcfg.graph.verify import summarize, verify

    syn = _verify_graph(kind)
    gm = _apply(syn, {"plan": {"buckets": ["layers.*"]}, "policy": {"insert_overlap_deps": True}, "verify": False})
    assert any(n.target is not compat.unwrap_control_deps(n)[0] for n in gm.graph.nodes)
    assert verify(syn.gm, gm, direction=kind) is None  # type: ignore[arg-type]
    assert verify(summarize(syn.gm, direction=kind), syn.gm, direction=kind) is None  # type: ignore[arg-type]


def test_control_deps_wrapped_all_gathers_keep_their_group_and_are_counted_on_a_synthetic_graph() -> None:
    """``insert_overlap_deps`` with ``reduce_scatter_first`` and deep backward prefetch wraps all-gather *starts*:
    a wrapped start still names its own group (the verifier used to read the wrapper's last argument and reject a
    valid config: "group '<node _pre_bucket_all_gather>'"), the record counts it (it used to lose them), and the
    prediction is the one without the wrappers (wrapped waits were costed as memory kernels, wrapped starts not
    at all)."""
    from overlapcfg.cost import simulate

    syn = backward_graph([[2, 1], [1], [3, 2], [1, 1]], regather=True)
    policy = {"backward_prefetch": 2, "issue_order": "reduce_scatter_first"}
    plan = {"buckets": ["layers.*"]}
    plain = _apply(syn, {"plan": plan, "policy": policy})
    predicted = simulate(plain, "cpu_gloo", world_size=2)
    for verified in (False, True):
        gm = _apply(syn, {"plan": plan, "policy": {**policy, "insert_overlap_deps": True}, "verify": verified})
        starts = [n for n in gm.graph.nodes if n.target is not compat.unwrap_control_deps(n)[0]
                  and compat.op_name(compat.unwrap_control_deps(n)[0]).startswith("_c10d_functional.all_gather")]
        assert starts, "the policy wraps all-gather starts in control_deps"
        assert {group_name(n) for n in starts} == {"0"}
        assert gm.meta["overlapcfg"].after == plain.meta["overlapcfg"].after
        assert gm.meta["overlapcfg"].after.get("backward", "all_gather") == 4
        wrapped = simulate(gm, "cpu_gloo", world_size=2)
        assert (wrapped.step_seconds, wrapped.comm_seconds, wrapped.compute_seconds) == \
            (predicted.step_seconds, predicted.comm_seconds, predicted.compute_seconds)


def test_a_failed_apply_puts_back_the_output_node_metadata_and_removes_added_submodules(
        clean_registry: None) -> None:
    """A strategy that wraps waits in ``control_deps`` (registering ``subgraph_*`` modules) and then breaks the
    graph: the verifier refuses it, and the caller gets its module back as it was: the code, the output node's
    metadata (aot's ``desc``, inductor's ``output_stack_traces``), no added submodules, the same ``gm.meta``."""
    from overlapcfg.errors import OverlapVerificationError
    from overlapcfg.strategies import StrategyResult, manual
    from overlapcfg.strategies.registry import register_strategy

    @register_strategy("deps_then_break")
    def run(gm: fx.GraphModule, ctx: Any) -> StrategyResult:
        result = manual.run(gm, ctx)
        wait = next(n for n in gm.graph.nodes if n.target is _WAIT)
        wait.replace_all_uses_with(wait.args[0])
        gm.graph.erase_node(wait)
        return result

    gm = copy.deepcopy(forward_graph([[1, 2], [2, 2], [1]]).gm)
    output = next(iter(gm.graph.find_nodes(op="output")))
    output.meta.update({"desc": ("a descriptor",), "output_stack_traces": ["File x.py, line 1"]})
    gm.meta["mine"] = 1
    code, meta, children = gm.code, dict(output.meta), dict(gm.named_children())
    cfg = load_config({"strategy": "deps_then_break", "plan": {"buckets": ["layers.*"]},
                       "policy": {"insert_overlap_deps": True}})
    with compat.fake_process_group(2, 0), pytest.raises(OverlapVerificationError):
        apply(gm, cfg, module_fqns=forward_graph([[1, 2], [2, 2], [1]]).module_fqns, graph_kind="forward")
    assert gm.code == code
    assert next(iter(gm.graph.find_nodes(op="output"))).meta == meta
    assert dict(gm.named_children()) == children
    assert gm.meta == {"mine": 1}


# --- the docs' example config (configuration.md), resolved against the demo model (building it traces nothing) ---

def test_the_docs_example_config_resolves_against_the_demo_model() -> None:
    from pathlib import Path

    from overlapcfg.demo import Llama, LlamaConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text().split("## A config", 1)[1]
    match = re.search(r"```yaml\n(.*?)```", text, flags=re.S)
    assert match, "no ```yaml block after '## A config'"
    cfg = load_config(match.group(1))
    model = Llama(LlamaConfig(n_layers=2))
    fqns = [name for name, _ in model.named_modules()]
    owners = list(dict.fromkeys(name.rpartition(".")[0] for name, _ in model.named_parameters()))
    assert cfg.plan is not None
    plan = resolve_plan(cfg.plan, fqns, owners, overrides=cfg.overrides, policy=cfg.policy)
    buckets = {b.name: b for b in plan.buckets}
    assert buckets["layers.0.attention_norm+layers.0.attention"].forward_prefetch == 0
    assert buckets["layers.1.ffn_norm+layers.1.feed_forward"].forward_prefetch == 0
    assert buckets["norm+output"].forward_prefetch == 2
    assert plan.uncovered == ()


# --- what test_compile's traced checks promise, on synthetic graphs ---------------------------------------------

def test_verify_still_catches_a_wrapped_wait_moved_before_its_start_on_a_synthetic_graph() -> None:
    from overlapcfg.errors import OverlapVerificationError
    from overlapcfg.graph.verify import summarize, verify

    gm = _apply(forward_graph([[1, 2], [2, 2], [1]]),
                {"plan": {"buckets": ["layers.*"]}, "policy": {"insert_overlap_deps": True}})
    wrapped = next(n for n in gm.graph.nodes if n.target is not compat.unwrap_control_deps(n)[0])
    start = compat.unwrap_control_deps(wrapped)[1][0]
    start.prepend(wrapped)  # the wait now runs before the collective it waits on
    with pytest.raises(OverlapVerificationError, match=wrapped.name):
        verify(summarize(gm, direction="forward"), gm, direction="forward")


def test_graphs_for_a_compiler_get_one_fake_value_per_node_on_a_synthetic_graph() -> None:
    """Identical buckets share one traced merge; for a compiler each stamped node still gets its own fake tensor."""
    syn = backward_graph([[2, 2], [2, 2], [2, 2]], regather=True)
    forget_traces()  # this capture makes the traces: stamps of another capture's never share their values

    def shared(for_compiler: bool) -> int:
        with compat.fake_process_group(syn.world_size, 0):
            gm = apply(copy.deepcopy(syn.gm), load_config({"plan": {"buckets": ["layers.*"]}}),
                       module_fqns=syn.module_fqns, graph_kind="backward",
                       options=PassOptions(for_compiler=for_compiler))
        ids = [id(n.meta["val"]) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        return len(ids) - len(set(ids))

    assert shared(for_compiler=False) > 0  # the fast path: identical layers share the cached trace's values
    assert shared(for_compiler=True) == 0

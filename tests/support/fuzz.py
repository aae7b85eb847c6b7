"""A fuzz of valid configs over the demo's traced graphs, for the verifier's "no false alarm" promise.

Each case is a random config the schema accepts (plans: presets and hand-built partitions, depths 0-3, byte caps,
overrides, every bucket mode, both issue orders, ``insert_overlap_deps``; strategies ``manual``, ``torch_manual``
and ``auto``) applied to one graph of one traced variant (plain FSDP with and without reshard-after-forward, HSDP
in both chain orders, FSDP + tensor parallel, and a reshard graph carrying whole-step in-place parameter updates).
``apply`` verifies its output (the default), and each outcome is sorted:

- ``applied``: rewritten and verified;
- ``refused``: our own documented error (``OverlapConfigError``, ``UnsupportedGraphError``): the config does not
  fit this graph, said as such (counted, and listed, but no failure);
- ``false_alarm``: ``OverlapVerificationError`` on a config the schema accepted: the pass's output was judged
  wrong; either the verifier or the pass is at fault, and both are bugs;
- ``foreign``: any other exception (torch's, a crash of ours).

Used by ``tests/config/test_fuzz_config.py`` (a seeded sample, slow tier) and ``benchmarks/verify_fuzz.py`` (longer
runs).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from overlapcfg import load_config
from overlapcfg.demo.job import traced
from overlapcfg.demo.settings import demo_settings
from overlapcfg.demo.tracing import TracedStep
from overlapcfg.errors import OverlapConfigError, OverlapVerificationError, UnsupportedGraphError
from overlapcfg.passes import apply
from tests.support.in_place import with_in_place_updates

__all__ = ["GRAPHS", "OUTCOMES", "VARIANTS", "Outcome", "run_case", "sample_config", "trace_variant"]

MODEL = {"n_layers": 2, "dim": 32, "n_heads": 4, "ffn_hidden": 64, "vocab_size": 64}
HSDP = {"dp_replicate": 2, "dp_shard": 2}
VARIANTS: dict[str, dict[str, Any]] = {
    "fsdp": {"reshard_after_forward": False},
    "fsdp_reshard": {"reshard_after_forward": True},
    "fsdp_reshard_in_place": {"reshard_after_forward": True},
    "hsdp_all_reduce_first": {"parallel": {**HSDP, "hsdp_reduce": "all_reduce_first"}, "reshard_after_forward": True},
    "hsdp_reduce_scatter_first": {"parallel": {**HSDP, "hsdp_reduce": "reduce_scatter_first"},
                                  "reshard_after_forward": False},
    "tp": {"parallel": {"dp_shard": 2, "tp": 2, "sequence_parallel": True}, "reshard_after_forward": True},
}
"""Traced variants of the 2-layer demo: what each one's graphs hold is in the module docstring."""
GRAPHS = ("forward", "backward")
OUTCOMES = ("applied", "refused", "false_alarm", "foreign")


_IN_PLACE: dict[str, TracedStep] = {}


def trace_variant(name: str) -> TracedStep:
    """The traced demo step for ``VARIANTS[name]``, memoized per process (``overlapcfg.demo.job.traced``; the
    ``_in_place`` variant's updated copies here). Shared read-only: ``run_case`` applies to a copy."""
    step = traced(demo_settings({"model": MODEL, **VARIANTS[name]}))
    if not name.endswith("_in_place"):
        return step
    if name not in _IN_PLACE:
        graphs = {g: with_in_place_updates(copy.deepcopy(step.graph(g))) for g in GRAPHS}  # type: ignore[arg-type]
        _IN_PLACE[name] = dataclasses.replace(step, forward=graphs["forward"], backward=graphs["backward"])
    return _IN_PLACE[name]


_PRESETS = ("llama_layers", "single_bucket", "per_block_split", "two_layers_per_bucket", "none")
_MODES = ("default", "custom_ops", "custom_ops_multidtype", "coalesced")


def _depths(rng: random.Random, fields: tuple[str, ...], p: float = 0.5) -> dict[str, int]:
    return {f: rng.randint(0, 3) for f in fields if rng.random() < p}


def _plan(rng: random.Random, per_entry_depths: bool) -> str | dict[str, Any]:
    """A preset, or a partition of the demo's modules: whole blocks, blocks split in two, blocks in pairs, with any
    of the embedding, the blocks and the head left out (uncovered)."""
    if rng.random() < 0.35:
        return rng.choice(_PRESETS)
    blocks: list[Any] = rng.choice([
        ["layers.*"],
        [{"modules": ["layers.*.attention_norm", "layers.*.attention"], "per": "layers.*"},
         {"modules": ["layers.*.ffn_norm", "layers.*.feed_forward"], "per": "layers.*"}],
        [{"modules": ["layers.*"], "group_size": 2}],
        ["layers.0", "layers.1"],
        ["layers.1:"],
    ])
    entries: list[Any] = [e for e, keep in (("tok_embeddings", rng.random() < 0.7), (None, True),
                                            (["norm", "output"], rng.random() < 0.7)) if keep]
    entries[entries.index(None):entries.index(None) + 1] = blocks if rng.random() < 0.85 else []
    if per_entry_depths:
        fields = ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay", "all_reduce_delay")
        entries = [{"modules": e if isinstance(e, list) else [e], **_depths(rng, fields, 0.3)}
                   if not isinstance(e, dict) and rng.random() < 0.3 else e for e in entries]
    return {"name": "fuzzed", "buckets": entries}


def _overrides(rng: random.Random) -> list[dict[str, Any]]:
    fields = ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay")
    out = []
    for _ in range(rng.choice((0, 0, 1, 2))):
        depths = _depths(rng, fields) or {"forward_prefetch": rng.randint(0, 3)}
        out.append({"match": rng.choice(["layers.0", "layers.1", "layers.*", "norm", "tok_embeddings"]), **depths})
    return out


def sample_config(rng: random.Random) -> dict[str, Any]:
    """One config the schema accepts (its strategy's contract included); plan faults against the demo's modules
    (an override reaching no bucket) are possible and come back as ``refused``."""
    strategy = rng.choices(["manual", "torch_manual", "auto"], weights=[7, 2, 1])[0]
    if strategy == "auto":
        policy: dict[str, Any] = {"collective_bucketing": rng.random() < 0.5,
                                  "insert_overlap_deps": rng.random() < 0.3,
                                  "max_compute_pre_fetch": rng.choice([1, 5, 200])}
        if rng.random() < 0.5:
            policy["bucket_mode"] = rng.choice(_MODES)
        return {"strategy": "auto", "policy": policy}
    cfg: dict[str, Any] = {"strategy": strategy, "plan": _plan(rng, per_entry_depths=strategy == "manual")}
    policy = {"bucket_mode": rng.choice(_MODES), "insert_overlap_deps": rng.random() < 0.3}
    if strategy == "manual":
        policy |= _depths(rng, ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay", "all_reduce_delay"),
                          0.8)
        policy["issue_order"] = rng.choice(["gather_first", "reduce_scatter_first"])
        if rng.random() < 0.3:
            policy["max_inflight_bytes"] = rng.choice([1, 4096, 65536, 1 << 20])
        if rng.random() < 0.3:
            cfg["overrides"] = _overrides(rng)
    cfg["policy"] = policy
    return cfg


@dataclass(frozen=True, slots=True)
class Outcome:
    variant: str
    graph: str
    config: dict[str, Any]
    kind: str
    """One of ``OUTCOMES``."""
    detail: str = ""


def run_case(step: TracedStep, variant: str, graph: str, config: dict[str, Any],
             on_error: Callable[[BaseException], None] | None = None) -> Outcome:
    """Apply ``config`` to a copy of ``step``'s ``graph`` (verification on) and sort the outcome."""
    try:
        cfg = load_config(config)
    except OverlapConfigError as err:
        return Outcome(variant, graph, config, "refused", f"load_config: {err}")
    gm = copy.deepcopy(step.graph(graph))  # type: ignore[arg-type]
    try:
        with step.process_groups():
            apply(gm, cfg, module_fqn_fn=step.module_fqn_fn(graph), module_fqns=step.module_fqns,  # type: ignore[arg-type]
                  graph_kind=graph)  # type: ignore[arg-type]
    except OverlapVerificationError as err:
        kind, detail = "false_alarm", str(err)
    except (OverlapConfigError, UnsupportedGraphError) as err:
        kind, detail = "refused", f"{type(err).__name__}: {err}"
    except Exception as err:  # what the fuzz is for: anything that is not ours
        if on_error is not None:
            on_error(err)
        kind, detail = "foreign", f"{type(err).__name__}: {err}"
    else:
        kind, detail = "applied", ""
    return Outcome(variant, graph, config, kind, detail)

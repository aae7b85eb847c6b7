"""Rank functions for ``tests/multiprocess/test_same_schedule.py``: one gloo job runs every case of the same-schedule
check in turn on its ranks (spawned by ``run_on_gloo``, so everything here is importable by name).

Each case gives the ranks what a real job can give them per rank and reports, per rank, what the check did: the
error's class, text, ranks and collective, or the outcome the record holds, and how long the case took. Every case
runs under a hard limit (``CASE_LIMIT_S``, ``faulthandler``): a case that hangs prints every thread's stack and ends
its process, and ``run_on_gloo`` fails the test with "exited without a result".

The cases, in order (the ranks count the check's exchanges per process group, so the missing-rank case, after which
the ranks' counts differ, is last):

- ``identical``: one config on every rank, applied to the captured step's graphs: checked silently;
- ``inductor_hook``: the same through ``inductor_pass``'s post-grad pass called on copies of the graphs (what
  inductor calls it with, less inductor's lowering, which a CPU test cannot afford twice per rank);
- ``node_costs``: each rank tunes its own captured step with its own node costs (the odd ranks' say every kernel is
  slow), as an offline tune per node would: the winners differ;
- ``tuner_tie``: each rank tunes with ties broken its own way (the odd ranks take the heaviest of the tied);
- ``tuned_in_the_job``: ``overlapcfg.tune`` in the job with both per-rank inputs at once: rank 0 decides for every
  rank, so the config is the same everywhere and the check passes;
- ``environment``: ``OVERLAPCFG_CONFIG`` set on the odd ranks only (torchtitan's way of choosing a config); with
  ``end_to_end``, compiled by ``overlapcfg.backend`` (the first run of the differing graph raises: the backward
  here, the forwards agree), else checked on the captured graphs like the cases above;
- ``model_branch``: ``overlapcfg.fully_shard`` of a model whose embedding has 8 more rows on the odd ranks;
- ``fully_shard``: ``overlapcfg.fully_shard`` of the same model with the same config: checked silently;
- ``missing_rank``: one rank never reaches the check (rank 0 in jobs of more than 2 ranks, else the last rank).
"""

from __future__ import annotations

import copy
import faulthandler
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import overlapcfg
from overlapcfg.capture import shard_module
from overlapcfg.cost.node_costs import MEASURABLE_KINDS, NodeCosts, node_signature
from overlapcfg.cost.price import node_kind
from overlapcfg.demo import Llama, LlamaConfig
from overlapcfg.demo.tracing import compile_with_pass, demo_batch, train_step
from overlapcfg.fsdp2 import read_record
from overlapcfg.integrations.torchtitan.source import ENV_VAR, find_config
from overlapcfg.passes import apply_step
from overlapcfg.passes.backend import CapturedStep, GraphBackend
from overlapcfg.passes.schedule_check import check_graph_schedule

MODEL = LlamaConfig(n_layers=2)
CASE_LIMIT_S = 150.0
"""A case still running after this long has hung: its process prints its stacks and exits (the test then fails)."""
TIMEOUT_S = 60.0
"""``same_schedule_timeout_s`` of the cases: ranks reach a check seconds apart on a loaded machine (one searches
longer than another), which a check must wait for without mistaking it for a missing rank."""
MISSING_TIMEOUT_S = 3.0
"""``same_schedule_timeout_s`` of the missing-rank case: how long the others wait for the rank that never comes."""
SPACE: dict[str, Any] = {"layers_per_bucket": [1], "merge_first": [False], "merge_last": [False],
                         "forward_prefetch": [1, 2], "backward_prefetch": [1, 2], "reduce_scatter_delay": [1],
                         "per_bucket_rounds": 1, "per_bucket_candidates": 1}
"""A smaller ``quick`` tune space (``conf/tune/space/quick.yaml``): the presets and competitors every search scores
are what the cases' winners come from."""
SLOW_KERNEL_S = 1e-2
"""What the odd ranks' node costs say every kernel takes: compute hides every collective, and the tuner then
prefers the fewest bytes in flight."""
TORCHTITAN_PLAN = ["tok_embeddings", "layers.0", "layers.1", ["norm", "output"]]
"""torchtitan's own grouping of the demo model (what its graph trainer passes ``OVERLAPCFG_CONFIG``'s lookup)."""
SAME = {"plan": "llama_layers", "same_schedule_timeout_s": TIMEOUT_S, "verify": False}
"""The config of the cases where every rank agrees. Verification is off in every graph-level case: the check reads
the schedule the pass recorded, proving the graph is other tests' work (and would double these cases' time)."""


def _odd(rank: int) -> bool:
    return rank % 2 == 1


def _case(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn()`` under the hard limit, every rank starting together: what it returned, or the overlapcfg error it
    raised, and the seconds taken."""
    faulthandler.dump_traceback_later(CASE_LIMIT_S, exit=True)
    dist.barrier()
    started = time.perf_counter()
    try:
        out: dict[str, Any] = {"outcome": fn()}
    except overlapcfg.OverlapcfgError as err:
        out = {"error": type(err).__name__, "message": str(err), "ranks": getattr(err, "ranks", None),
               "collective": getattr(err, "collective", None)}
    finally:
        faulthandler.cancel_dump_traceback_later()
    out["seconds"] = time.perf_counter() - started
    return out


def _checked(step: CapturedStep, cfg: overlapcfg.OverlapConfig) -> list[str]:
    """``cfg`` applied to copies of ``step``'s graphs and each graph checked as ``overlapcfg.backend`` checks it."""
    applied = apply_step(step, cfg)
    return [check_graph_schedule(g.graph, cfg, where=f"test, {g.name} graph") for g in applied.graphs]


def _hooked(step: CapturedStep, cfg: overlapcfg.OverlapConfig) -> list[str]:
    """``inductor_pass(cfg)`` on copies of ``step``'s graphs, as inductor's post-grad hook calls it; its uuid must
    make inductor bypass its FX graph cache here (a multi-rank job with the check on)."""
    hook = overlapcfg.inductor_pass(cfg)
    if hook.uuid() is not None:
        raise AssertionError("inductor_pass: a cache key in a multi-rank job with the check on")
    outcomes = []
    for name in ("forward", "backward"):
        gm = copy.deepcopy(step.graph(name))
        hook(gm.graph)
        outcomes.append(gm.meta["overlapcfg"].same_schedule)
    return outcomes


def _costs(step: CapturedStep, seconds: float) -> NodeCosts:
    graphs = {name: {n.name: (node_signature(n), seconds) for n in step.graph(name).graph.nodes
                     if n.op == "call_function" and node_kind(n) in MEASURABLE_KINDS}
              for name in ("forward", "backward")}
    return NodeCosts(source=f"every kernel {seconds} s", graphs=graphs)


def _local_tune(step: CapturedStep, node_costs: NodeCosts | None = None) -> overlapcfg.OverlapConfig:
    """The tuner's decision on this rank alone: what an offline tune per node gives (``overlapcfg.tune`` in a job
    shares rank 0's instead)."""
    from overlapcfg.tuning.search import _search

    result = _search(step, hardware="cpu_gloo", world_size=None, memory_budget=None, space=SPACE,
                     as_dtype=None, progress=None, verify=False, settings_at="", node_costs=node_costs)
    return result.config.model_copy(update={"same_schedule_timeout_s": TIMEOUT_S, "verify": False})


class _RankTieBreak:
    """``overlapcfg.tuning.candidates.choose`` with ties broken by rank: the odd ranks take the tied candidate whose
    name sorts last (as a tie-break iterating a set of names would, in an order that depends on each process's hash
    seed); counts its calls."""

    def __init__(self, rank: int) -> None:
        from overlapcfg.tuning import candidates

        self.rank, self.original, self.calls = rank, candidates.choose, 0

    def __call__(self, pool: Any, *, ceiling: float | None = None) -> Any:
        from overlapcfg.tuning.candidates import TIE_TOLERANCE

        self.calls += 1
        if not _odd(self.rank):
            return self.original(pool, ceiling=ceiling)
        fastest = min(c.step_seconds for c in pool)
        limit = fastest * (1 + TIE_TOLERANCE)
        limit = limit if ceiling is None else max(fastest, min(limit, ceiling))
        return max((c for c in pool if c.step_seconds <= limit), key=lambda c: c.name)


def _with_tie_break(rank: int, fn: Callable[[], Any]) -> tuple[Any, int]:
    from overlapcfg.tuning import search

    breaker = _RankTieBreak(rank)
    original, search.choose = search.choose, breaker  # type: ignore[assignment]
    try:
        return fn(), breaker.calls
    finally:
        search.choose = original


def _sharded_llama(rank: int, world_size: int) -> torch.nn.Module:
    return shard_module(Llama(MODEL, seed=0), world_size=world_size, rank=rank, reshard_after_forward=True)


def _environment(rank: int, world_size: int, step: CapturedStep, end_to_end: bool) -> list[str]:
    """``OVERLAPCFG_CONFIG``: unset on the even ranks (torchtitan's grouping, default policy), a policy preset on the
    odd ones."""
    os.environ.pop(ENV_VAR, None)
    if _odd(rank):
        os.environ[ENV_VAR] = "aggressive"
    cfg = find_config(TORCHTITAN_PLAN).model_copy(update={"same_schedule_timeout_s": TIMEOUT_S})
    os.environ.pop(ENV_VAR, None)
    if not end_to_end:
        return _checked(step, cfg.model_copy(update={"verify": False}))
    built = overlapcfg.backend(cfg)
    tokens, targets = demo_batch(MODEL.vocab_size, seed=100 + rank)
    train_step(compile_with_pass(_sharded_llama(rank, world_size), backend=built), tokens, targets)
    return [gm.meta["overlapcfg"].same_schedule for gm in built.graphs.values()]


def _fully_shard(rank: int, world_size: int, cfg: dict[str, Any], extra_rows: int = 0) -> str:
    model = Llama(MODEL, seed=0)
    if extra_rows:  # a model branch on the rank: one parameter of another size
        model.tok_embeddings = torch.nn.Embedding(MODEL.vocab_size + extra_rows, MODEL.dim)
    mesh = init_device_mesh("cpu", (world_size,))
    overlapcfg.fully_shard(model, cfg, mesh=mesh)
    return read_record(model).record.same_schedule


def schedule_ranks(rank: int, world_size: int, end_to_end: bool) -> dict[str, Any]:
    """Every case on this rank (module docstring); ``end_to_end``: compile the environment case (a second trace)."""
    torch.manual_seed(0)
    captured = GraphBackend()
    tokens, targets = demo_batch(MODEL.vocab_size, seed=100 + rank)
    train_step(compile_with_pass(_sharded_llama(rank, world_size), backend=captured), tokens, targets)
    step = captured.step()
    same = overlapcfg.load_config(SAME)
    out: dict[str, Any] = {}
    out["identical"] = _case(lambda: _checked(step, same))
    out["inductor_hook"] = _case(lambda: _hooked(step, same))
    costs = _costs(step, SLOW_KERNEL_S) if _odd(rank) else None
    by_costs = _local_tune(step, node_costs=costs)
    out["node_costs"] = _case(lambda: _checked(step, by_costs))
    out["node_costs"]["config"] = by_costs.model_dump(mode="json")
    # Every kernel slow on every rank: compute hides every collective, so the search ends in a tie of candidates
    # that differ only in bytes in flight, and each rank's tie-break picks its own.
    tied_costs = _costs(step, SLOW_KERNEL_S)
    by_tie, _ = _with_tie_break(rank, lambda: _local_tune(step, node_costs=tied_costs))
    out["tuner_tie"] = _case(lambda: _checked(step, by_tie))
    out["tuner_tie"]["config"] = by_tie.model_dump(mode="json")

    def tuned_in_the_job() -> dict[str, Any]:
        result, searched = _with_tie_break(rank, lambda: overlapcfg.tune(
            step, hardware="cpu_gloo", memory_budget=None, space=SPACE, verify=False, node_costs=costs))
        cfg = result.config.model_copy(update={"same_schedule_timeout_s": TIMEOUT_S, "verify": False})
        return {"config": cfg.model_dump(mode="json"), "searched": searched, "checked": _checked(step, cfg)}

    out["tuned_in_the_job"] = _case(tuned_in_the_job)
    out["environment"] = _case(lambda: _environment(rank, world_size, step, end_to_end))
    out["model_branch"] = _case(lambda: _fully_shard(rank, world_size, SAME, extra_rows=8 if _odd(rank) else 0))
    out["fully_shard"] = _case(lambda: _fully_shard(rank, world_size, SAME))
    absent = 0 if world_size > 2 else world_size - 1
    briefly = same.model_copy(update={"same_schedule_timeout_s": MISSING_TIMEOUT_S})
    out["missing_rank"] = _case(lambda: "skipped" if rank == absent else _checked(step, briefly))
    return out

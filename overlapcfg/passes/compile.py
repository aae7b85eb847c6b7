"""torch.compile integration: a backend that runs the pass on aot_autograd's graphs, and an inductor hook.

Two routes, one pass (``overlapcfg.passes.apply``):

- ``backend(cfg)`` is a ``torch.compile`` backend (``overlapcfg.passes.backend.GraphBackend``: aot_autograd with
  the min-cut partitioner, collectives attributed from aot's descriptors) with ``apply`` as its forward and
  backward passes. ``compiler="eager"`` runs the transformed graphs as they are (bit-identical kernels to an
  untransformed aot_eager run); ``compiler="inductor"`` lowers them with inductor's ``compile_fx_inner`` under the
  settings a manual schedule needs (``INDUCTOR_SETTINGS``).
- ``inductor_pass(cfg)`` is a ``CustomGraphPass`` for users who compile with inductor themselves and want the
  pass to run on inductor's post-grad graph (``torch._inductor.config.post_grad_custom_post_pass``).

Both compare each graph's schedule across ranks right after the pass (``overlapcfg.graph.same_schedule``; off with
``check_same_schedule: false``). Every rank runs the pass on every compile in both: aot's cache does not serve the
backend's custom compilers, and the inductor hook bypasses inductor's FX graph cache while the check is on in a
multi-rank job (a hit on some ranks only would skip the pass, and the check, there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeAlias

from torch import fx, nn

from overlapcfg import compat
from overlapcfg._version import __version__
from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.boundary import user_paths
from overlapcfg.config.load import ConfigSource
from overlapcfg.errors import OverlapUsageError
from overlapcfg.graph.same_schedule import not_checked
from overlapcfg.kinds import Direction
from overlapcfg.module_paths import ModelFacts
from overlapcfg.passes.backend import GraphBackend, GraphCompiler
from overlapcfg.passes.pipeline import PassOptions, apply
from overlapcfg.passes.schedule_check import check_graph_schedule
from overlapcfg.resolve import resolve_config

__all__ = ["INDUCTOR_SETTINGS", "CompilerName", "OverlapGraphPass", "backend", "check_plan_fits", "inductor_pass",
           "source_hash"]

log = logging.getLogger(__name__)

CompilerName: TypeAlias = Literal["eager", "inductor"]

INDUCTOR_SETTINGS: Mapping[str, object] = {
    # Inductor's own comm/compute reordering (scheduler IR) would move the collectives we placed.
    "reorder_for_compute_comm_overlap": False,
    # Runs last in inductor's scheduler and reorders its nodes for peak memory, collective starts and waits
    # included: it can undo a prefetch depth the plan asked for.
    "reorder_for_peak_memory": False,
    # Inductor's defaults, pinned so a global setting cannot re-bucket or re-schedule after our pass: upstream's
    # FX bucketing passes and FX overlap scheduler run after the post-grad custom pass.
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
    # Buffer reuse is planned on inductor's order without the overlap in mind (a buffer could be handed to a
    # kernel while a prefetched bucket still lives); torchtitan turns it off for manual bucketing too.
    "allow_buffer_reuse": False,
}
"""Inductor settings that must accompany a manual schedule. torchtitan's graph trainer sets the two reorder
flags and ``allow_buffer_reuse`` the same way around upstream ``manual_overlap_bucketing``.
``backend(cfg, compiler="inductor")`` patches them around each compile; users of ``inductor_pass`` set them
themselves (``torch._inductor.config.patch({**INDUCTOR_SETTINGS, "post_grad_custom_post_pass": ...})``).
Also set ``policy.insert_overlap_deps: true`` (as torchtitan does for inductor) so inductor's scheduler keeps the
waits where the pass put them; the backend leaves the policy as written."""


def _inductor_compiler(graph: Direction) -> GraphCompiler:
    """``compile_fx_inner`` for one of aot's graphs, under ``INDUCTOR_SETTINGS``.

    Patched per call rather than around ``torch.compile``: aot_autograd compiles the backward lazily, at the
    first ``.backward()``, long after ``torch.compile`` returned.
    """

    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
        with compat.inductor_config_patch(dict(INDUCTOR_SETTINGS)):
            return compat.compile_fx_inner(gm, example_inputs, is_backward=graph == "backward")

    return compile_graph


def check_plan_fits(cfg: OverlapConfig, model: nn.Module) -> None:
    """Resolve ``cfg``'s plan and overrides against ``model.named_modules()`` now: a pattern that matches no module,
    two entries claiming one module, an override that matches nothing are ``OverlapConfigError``s here, with the
    path where the user put the config and the closest names, instead of a ``BackendCompilerFailed`` at the first
    forward.

    Coverage (``require_full_coverage``) is left to the pass: which parameters are FSDP's is known only from the
    graph (a model may keep some parameters unsharded).
    """
    with user_paths(cfg.mount):
        resolve_config(cfg, ModelFacts.of(model), coverage=False)


def backend(cfg: ConfigSource, *, compiler: CompilerName = "eager", model: nn.Module | None = None,
            config_root: str | None = None, strict: bool | None = None) -> GraphBackend:
    """A ``torch.compile`` backend applying ``cfg`` to the forward and backward graphs of aot_autograd.

    ``cfg`` is validated now (``OverlapConfigError`` before any compile). Any model whose FSDP collectives appear
    in the graph works (SimpleFSDP-style parametrizations, torchtitan's ``data_parallel``, Hugging Face models);
    other collectives are left alone. ``model``: the model being compiled, to match plan patterns against its
    ``named_modules()`` (checked now: ``check_plan_fits``) and check attribution against its parameters (default:
    the modules the graph shows). The returned backend keeps the transformed graphs in ``.graphs`` (each with its
    ``PassRecord`` in ``gm.meta["overlapcfg"]``), the attributed collectives in ``.collectives``, and what it was
    given before the pass as a ``CapturedStep``: ``.step()``, for ``explain`` / ``compare`` / ``tune``.

    ``compiler="inductor"`` lowers the transformed graphs with inductor (``compile_fx_inner``) under
    ``INDUCTOR_SETTINGS``; on a CPU-only torch that needs a C++ compiler. ``config_root``: where the config sits in
    the user's tree, as ``load_config(cfg, root=...)`` (a loaded config or a Hydra node knows it already), so
    faults read ``trainer.overlap.plan...``. ``strict``: overrides ``cfg.strict`` (``PassOptions.strict``).

    Each graph's schedule is compared across ranks right after its pass, before it is lowered (``SameScheduleError``
    on every rank where they differ; the outcome in the record's ``same_schedule``).
    """
    loaded = load_config(cfg, root=config_root) if config_root else load_config(cfg)
    if compiler not in ("eager", "inductor"):
        raise OverlapUsageError(f"backend: compiler must be 'eager' or 'inductor', got {compiler!r}")
    if model is not None:
        check_plan_fits(loaded, model)
    options = PassOptions(for_compiler=compiler == "inductor", strict=strict)
    lowered = compiler == "inductor"
    if lowered:
        # Inductor lowers only decomposed aten (``aten.t`` has no lowering, just a decomposition), so aot traces
        # with inductor's table, as inductor's own compile_fx does; compile_fx_inner must know the backward.
        result = GraphBackend(compiler=_inductor_compiler("forward"), bw_compiler=_inductor_compiler("backward"),
                              decompositions=compat.inductor_decompositions(), model=model)
    else:
        result = GraphBackend(model=model)

    def graph_pass(name: Direction) -> Callable[[fx.GraphModule], fx.GraphModule]:
        def run(gm: fx.GraphModule) -> fx.GraphModule:
            gm = apply(gm, loaded, graph_kind=name, module_fqns=result.module_fqns, options=options)
            check_graph_schedule(gm, loaded, where=f"overlapcfg.backend, {name} graph")
            return gm

        return run

    result.fw_pass, result.bw_pass = graph_pass("forward"), graph_pass("backward")
    return result


# --- inductor's post-grad hook -----------------------------------------------------------------------------------

def source_hash() -> str:
    """A hash over the overlapcfg package's Python sources (torch's ``get_hash_for_files``, cached).

    Part of ``OverlapGraphPass.uuid()``: a changed pass must not reuse graphs inductor cached from the old one,
    even when the version string was not bumped (editable installs).
    """
    root = Path(__file__).resolve().parents[1]
    files = tuple(str(p) for p in sorted(root.rglob("*.py")))
    return compat.hash_files(files).hex()


_HOOK_OPTIONS = PassOptions(for_compiler=True, recompile=False)
"""Inductor reads fake-tensor metadata after the hook, and its post-grad passes end with ``gm.recompile()``."""


class OverlapGraphPass(compat.CustomGraphPass):
    """The pass as inductor's ``post_grad_custom_post_pass``; ``uuid()`` keeps inductor's FX graph cache on.

    Inductor settings that must accompany it (see ``INDUCTOR_SETTINGS``): ``reorder_for_compute_comm_overlap``
    and ``reorder_for_peak_memory`` off (both reorder scheduler nodes after our pass), upstream's FX bucketing
    and overlap scheduling off (``bucket_*_fx="none"``,
    ``aten_distributed_optimizations.enable_overlap_scheduling=False``), ``allow_buffer_reuse`` off; and
    ``policy.insert_overlap_deps: true`` so the scheduler keeps our wait placement. Example::

        with torch._inductor.config.patch({**INDUCTOR_SETTINGS, "post_grad_custom_post_pass": inductor_pass(cfg)}):
            loss = torch.compile(model)(tokens).sum(); loss.backward()

    It leaves regenerating the module's Python code to inductor, whose post-grad passes end with
    ``gm.recompile()``; called on a graph outside inductor, follow it with ``graph.owning_module.recompile()``.

    After the pass, the graph's schedule is compared across ranks (``overlapcfg.graph.same_schedule``). For that
    to run on every rank, ``uuid()`` bypasses inductor's FX graph cache while the check is on in a multi-rank job:
    a cache hit skips post-grad passes, and a hit on some ranks but not others would leave the check waiting on
    ranks that never run it. ``check_same_schedule: false`` keeps the cache (and skips the check).
    """

    def __init__(self, cfg: OverlapConfig) -> None:
        self.cfg = cfg

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, fx.GraphModule):
            raise OverlapUsageError("inductor_pass: the post-grad graph has no owning GraphModule")
        # Inductor's post-grad passes end with ``gm.recompile()``: regenerating the code here too would be paid twice.
        apply(gm, self.cfg, graph_kind="auto", options=_HOOK_OPTIONS)
        check_graph_schedule(gm, self.cfg, where="overlapcfg.inductor_pass")

    def uuid(self) -> str | None:
        """Changes with the config, the package version and the package sources; equal configs give equal ids.
        None (inductor then bypasses its FX graph cache) where the same-schedule check will run: a multi-rank job
        with ``check_same_schedule`` on (see the class docstring)."""
        if self.cfg.check_same_schedule and not_checked() is None:
            return None
        parts = (self.cfg.model_dump_json(), __version__, source_hash())
        return compat.hash_files((), extra="\0".join(parts)).hex()


def inductor_pass(cfg: ConfigSource) -> OverlapGraphPass:
    """``cfg`` (validated now) as a ``CustomGraphPass`` for ``torch._inductor.config.post_grad_custom_post_pass``.

    See ``OverlapGraphPass`` for the inductor settings that must accompany it.
    """
    return OverlapGraphPass(load_config(cfg))

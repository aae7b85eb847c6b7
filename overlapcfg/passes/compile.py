"""torch.compile integration: a backend that runs the pass on aot_autograd's graphs, and an inductor hook.

Two routes, one pass (``overlapcfg.passes.apply``):

- ``backend(cfg)`` is a ``torch.compile`` backend. It is ``overlapcfg.demo.tracing.StepBackend`` (aot_autograd with the
  min-cut partitioner; collectives annotated with their owners before the pass) with ``apply`` as its forward and
  backward passes. ``compiler="eager"`` runs the transformed graphs as they are (bit-identical kernels to an
  untransformed aot_eager run); ``compiler="inductor"`` lowers them with inductor's ``compile_fx_inner`` under the
  settings a manual schedule needs (``INDUCTOR_SETTINGS``).
- ``inductor_pass(cfg)`` is a ``CustomGraphPass`` for users who compile with inductor themselves and want the
  pass to run on inductor's post-grad graph (``torch._inductor.config.post_grad_custom_post_pass``).

What lives elsewhere: graph tracing and attribution (``overlapcfg.demo.tracing``), the pass (``overlapcfg.passes``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeAlias

from torch import fx

import overlapcfg
from overlapcfg import compat
from overlapcfg.passes import GraphKind, apply
from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.load import ConfigSource
from overlapcfg.demo.tracing import GraphCompiler, GraphName, GraphPass, StepBackend

__all__ = ["INDUCTOR_SETTINGS", "CompilerName", "OverlapGraphPass", "backend", "inductor_pass", "source_hash"]

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


def _graph_pass(cfg: OverlapConfig, graph_kind: GraphKind, debug: bool, for_compiler: bool) -> GraphPass:
    def run(gm: fx.GraphModule) -> fx.GraphModule:
        return apply(gm, cfg, graph_kind=graph_kind, debug=debug, for_compiler=for_compiler)

    return run


def _inductor_compiler(graph: GraphName) -> GraphCompiler:
    """``compile_fx_inner`` for one of aot's graphs, under ``INDUCTOR_SETTINGS``.

    Patched per call rather than around ``torch.compile``: aot_autograd compiles the backward lazily, at the
    first ``.backward()``, long after ``torch.compile`` returned.
    """

    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
        with compat.inductor_config_patch(dict(INDUCTOR_SETTINGS)):
            return compat.compile_fx_inner(gm, example_inputs, is_backward=graph == "backward")

    return compile_graph


def backend(cfg: ConfigSource, *, compiler: CompilerName = "eager", debug: bool = False) -> StepBackend:
    """A ``torch.compile`` backend applying ``cfg`` to the forward and backward graphs of aot_autograd.

    ``cfg`` is validated now (``OverlapConfigError`` before any compile). ``debug=True`` verifies each rewritten
    graph (``overlapcfg.graph.verify``). The returned ``StepBackend`` keeps the transformed graphs in ``.graphs`` (each
    with its ``PassRecord`` in ``gm.meta["overlapcfg"]``) and the original collectives in ``.collectives``.

    ``compiler="inductor"`` lowers the transformed graphs with inductor (``compile_fx_inner``) under
    ``INDUCTOR_SETTINGS``; on a CPU-only torch that needs a C++ compiler.
    """
    cfg = load_config(cfg)
    if compiler not in ("eager", "inductor"):
        raise TypeError(f"backend: compiler must be 'eager' or 'inductor', got {compiler!r}")
    lowered = compiler == "inductor"
    passes = _graph_pass(cfg, "forward", debug, lowered), _graph_pass(cfg, "backward", debug, lowered)
    if not lowered:
        return StepBackend(*passes)
    # Inductor lowers only decomposed aten (``aten.t`` has no lowering, just a decomposition), so aot traces with
    # inductor's table, as inductor's own compile_fx does; compile_fx_inner must know which graph is the backward.
    return StepBackend(*passes, compiler=_inductor_compiler("forward"), bw_compiler=_inductor_compiler("backward"),
                       decompositions=compat.inductor_decompositions())


# --- inductor's post-grad hook -----------------------------------------------------------------------------------

@functools.cache
def source_hash() -> str:
    """SHA-256 over the overlapcfg package's Python sources (path and bytes, sorted by path).

    Part of ``OverlapGraphPass.uuid()``: a changed pass must not reuse graphs inductor cached from the old one,
    even when the version string was not bumped (editable installs).
    """
    root = Path(overlapcfg.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


class OverlapGraphPass(compat.CustomGraphPass):
    """The pass as inductor's ``post_grad_custom_post_pass``; ``uuid()`` keeps inductor's FX graph cache on.

    Inductor settings that must accompany it (see ``INDUCTOR_SETTINGS``): ``reorder_for_compute_comm_overlap``
    and ``reorder_for_peak_memory`` off (both reorder scheduler nodes after our pass), upstream's FX bucketing
    and overlap scheduling off (``bucket_*_fx="none"``,
    ``aten_distributed_optimizations.enable_overlap_scheduling=False``), ``allow_buffer_reuse`` off; and
    ``policy.insert_overlap_deps: true`` so the scheduler keeps our wait placement. Example::

        with torch._inductor.config.patch({**INDUCTOR_SETTINGS, "post_grad_custom_post_pass": inductor_pass(cfg)}):
            loss = torch.compile(model)(tokens).sum(); loss.backward()
    """

    def __init__(self, cfg: OverlapConfig, *, debug: bool = False) -> None:
        self.cfg = cfg
        self.debug = debug

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, fx.GraphModule):
            raise TypeError("inductor_pass: the post-grad graph has no owning GraphModule")
        apply(gm, self.cfg, graph_kind="auto", debug=self.debug, for_compiler=True)

    def uuid(self) -> str:
        """Changes with the config, the package version and the package sources; equal configs give equal ids."""
        digest = hashlib.sha256()
        for part in (self.cfg.model_dump_json(), overlapcfg.__version__, source_hash(), str(self.debug)):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()


def inductor_pass(cfg: ConfigSource, *, debug: bool = False) -> OverlapGraphPass:
    """``cfg`` (validated now) as a ``CustomGraphPass`` for ``torch._inductor.config.post_grad_custom_post_pass``.

    See ``OverlapGraphPass`` for the inductor settings that must accompany it.
    """
    return OverlapGraphPass(load_config(cfg), debug=debug)

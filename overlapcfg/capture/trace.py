"""``capture_step``: one training step of any ``nn.Module``, captured as the ``CapturedStep`` that ``explain``,
``compare`` and ``tune`` take.

Route: ``torch.compile(model, backend=GraphBackend(model=model), fullgraph=True)`` (the production backend, with
no pass: aot_autograd, the min-cut partitioner, every collective attributed to its parameter from aot's
descriptors), one forward and one backward, then ``GraphBackend.step()``. So the graphs a step holds are the graphs
``overlapcfg.backend`` transforms in a real run.

The model must already be sharded so that its FSDP collectives are in the graph: ``overlapcfg.shard_module``
(SimpleFSDP-style, any model), torchtitan's ``data_parallel``, or any sharder of that kind. Eager FSDP2
(``fully_shard``) runs its collectives in hooks outside the graph: use ``overlapcfg.fully_shard`` and
``explain(model, cfg)`` for it.

Process groups: inside a job (a default group is initialized, e.g. under ``torchrun``) the step runs on the job's
groups, for real, and every rank must call this together; otherwise a fake group of ``world_size`` ranks is opened
for the capture only (``ensure_process_group``), values are meaningless and nothing is communicated. Either way the
model is left as it was: gradients, buffers and the RNG state are restored afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn

from overlapcfg import compat
from overlapcfg.capture.simple_fsdp import AllGatherShard
from overlapcfg.errors import OverlapConfigError, OverlapUsageError, UnsupportedGraphError
from overlapcfg.passes.backend import GraphBackend
from overlapcfg.passes.step import CapturedStep, ensure_process_group

__all__ = ["LossFn", "capture_step", "default_loss", "quiet_checkpoint_notice"]

log = logging.getLogger(__name__)

LossFn: TypeAlias = Callable[[Any], torch.Tensor]
"""``loss_fn(output) -> scalar``: the model's output to the loss, run outside the compiled model."""


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a step when no ``loss_fn`` is given: the output's ``loss`` (a Hugging Face ``ModelOutput``
    computed with ``labels``, or a ``"loss"`` key), a scalar output itself, else the sum of every floating-point
    tensor in the output (tuples, lists, dicts, ``ModelOutput``: any nesting).

    The sum is enough for a capture: the loss runs outside the compiled model, and the backward graph takes one
    gradient per output whatever the loss is, so the graphs are those of the real loss; only values differ.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    leaves = [t for t in compat.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise OverlapUsageError(
            f"capture_step: the model's output ({type(output).__name__}) holds no floating-point tensor "
            "that needs a gradient; pass loss_fn=lambda output: ... returning the scalar loss")
    return torch.stack([t.float().sum() for t in leaves]).sum()


def _sharded_for(model: nn.Module) -> tuple[int, int] | None:
    """``(world size, rank)`` ``shard_module`` cut the model for, if it did and recorded it."""
    gather = next((m for m in model.modules() if isinstance(m, AllGatherShard) and m.world_size is not None), None)
    return (gather.world_size, gather.rank) if gather is not None and gather.world_size is not None else None


def _world(model: nn.Module, world_size: int | None, rank: int | None) -> tuple[int, int]:
    if dist.is_initialized():
        live = (dist.get_world_size(), dist.get_rank())
        if (world_size is not None and world_size != live[0]) or (rank is not None and rank != live[1]):
            raise OverlapConfigError(
                f"capture_step: world_size={world_size}, rank={rank} contradict the live process group "
                f"(rank {live[1]} of {live[0]}); inside a job, leave them out")
        return live
    sharded = _sharded_for(model)
    if world_size is None:
        if sharded is None:
            raise OverlapUsageError("capture_step: no process group exists; pass world_size= (the ranks the model is "
                                    "sharded for): a fake group of that size is opened for the capture")
        world_size = sharded[0]
    if rank is None:
        rank = sharded[1] if sharded is not None and sharded[0] == world_size else 0
    return world_size, rank


@contextlib.contextmanager
def _model_left_as_it_was(model: nn.Module) -> Iterator[None]:
    """Gradients cleared for the step and put back after it; buffers (running statistics) and the RNG state
    restored: a capture under a fake group computes on meaningless values, and none of them may leak out."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    for p, _ in grads:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, grad in grads:
            p.grad = grad
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


@contextlib.contextmanager
def quiet_checkpoint_notice() -> Iterator[None]:
    """torch logs a 4-line WARNING that ``context_fn`` is passed to checkpoint under torch.compile, meant for
    regions with in-place ops; a SimpleFSDP reshard-after-forward region holds one all-gather and none. Silenced
    for the capture's thread, for the capture only (a filter on that logger, removed after)."""
    with compat.quiet_logger_records(logging.getLogger("torch._higher_order_ops.wrap"), below=logging.ERROR):
        yield


def _graph_break_message(err: Exception, kwargs: Mapping[str, Any] | None) -> str:
    """One screen: what broke the graph and where (dynamo's own report, whose "from user code" names the frames),
    and the way out when the break sits in the loss a Hugging Face model computes from ``labels`` (GPT-2's
    ``loss_function`` logs a warning, which dynamo cannot trace)."""
    report = "\n".join(line for line in str(err).splitlines() if line.strip())
    hint = ""
    if kwargs and "labels" in kwargs:
        hint = ("\nThe model was called with labels=, so its own loss is traced with it: if the break is in the "
                "loss, call it without labels and pass loss_fn=lambda output: ... (the loss then runs outside the "
                "compiled model).")
    return ("capture_step: the model's forward does not trace as one graph (torch.compile fullgraph=True); dynamo "
            f"stopped here:\n{report}{hint}")


def capture_step(model: nn.Module, args: Sequence[Any] | torch.Tensor = (), kwargs: Mapping[str, Any] | None = None,
                 *, loss_fn: LossFn | None = None, world_size: int | None = None,
                 rank: int | None = None) -> CapturedStep:
    """Capture one training step of ``model`` (forward ``model(*args, **kwargs)``, the loss, backward).

    ``args`` / ``kwargs``: the model's inputs, as ``torch.export`` takes them (a lone tensor is ``(tensor,)``).
    ``loss_fn(output) -> scalar``: the loss from the model's output, outside the compiled model (default:
    ``default_loss``: the output's ``loss``, e.g. a Hugging Face model called with ``labels``, which computes it
    inside its forward, so it is traced with the model; else the sum of its floating-point tensors).

    The model must be sharded already (``overlapcfg.shard_module``, torchtitan's ``data_parallel``, ...).
    Inside a job (a default process group exists, e.g. under ``torchrun``; every rank calls this) the step runs on
    the job's groups; ``world_size`` / ``rank`` may be left out. Otherwise a fake group of ``world_size`` ranks
    (default: what ``shard_module`` sharded for) is opened for the capture and closed after it. The model's
    forward must trace as one graph (``fullgraph=True``). Dynamo's caches are reset before and after (a forward
    compiled earlier with another backend would otherwise be reused), and so are DTensor's sharding caches (they
    would hand this trace device meshes of process groups traced before: ``compat.forget_dtensor_caches``); the
    model's gradients, buffers and the RNG state are left as they were.

    Raises ``UnsupportedGraphError`` if the step has no FSDP collective (the model is not sharded, or sharded
    eagerly by FSDP2), or if the forward does not trace as one graph (dynamo's report of where it broke).
    """
    inputs = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    ws, rk = _world(model, world_size, rank)
    backend = GraphBackend(model=model)
    started = time.perf_counter()
    compat.dynamo_reset()
    compat.forget_dtensor_caches()
    try:
        with ensure_process_group(ws, rk), _model_left_as_it_was(model), quiet_checkpoint_notice():
            output = torch.compile(model, backend=backend, fullgraph=True)(*inputs, **dict(kwargs or {}))
            (loss_fn or default_loss)(output).backward()
    except compat.DynamoUnsupported as err:
        raise UnsupportedGraphError(_graph_break_message(err, kwargs)) from None
    finally:
        compat.dynamo_reset()
        compat.forget_dtensor_caches()
    step = backend.step()
    if not step.collectives:
        raise UnsupportedGraphError(
            "capture_step: the captured step has no FSDP collective to bucket. Shard the model first so its "
            "collectives are in the graph (overlapcfg.shard_module(model, world_size=N), or torchtitan's "
            "data_parallel); eager FSDP2 (fully_shard) runs them outside the graph: use overlapcfg.fully_shard "
            "and explain(model, cfg) instead")
    log.info("captured a %d-parameter step in %.2fs: %d forward / %d backward nodes, %d FSDP collectives",
             len(step.param_fqns), time.perf_counter() - started, len(step.forward.graph.nodes),
             len(step.backward.graph.nodes), len(step.collectives))
    return step

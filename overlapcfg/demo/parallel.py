"""The demo on a 2-D/3-D mesh: HSDP over ``dp_replicate`` x ``dp_shard`` and tensor parallel over ``tp``.

The order is torchtitan's: tensor parallel first (torch's ``parallelize_module`` with column-/row-wise plans on
the attention and feed-forward projections, optionally sequence parallel), then SimpleFSDP over the data-parallel
dimensions (``shard_module``: all-gathers on the ``dp_shard`` group, gradients also all-reduced on the
``dp_replicate`` group). The mesh is ``(dp_replicate, dp_shard, tp)``, TP innermost, built with
``init_device_mesh`` under whatever default group exists: the fake one for a one-process trace
(``overlapcfg.demo.tracing``), gloo for the parity runs. Built the same way in a fresh default group, the mesh's
sub-groups get the same names, so graphs traced under one can be transformed under another
(``TracedStep.process_groups``).

Plain FSDP (``dp_replicate = tp = 1``) builds no mesh: it shards over the default group, as the demo always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from overlapcfg.capture.simple_fsdp import is_sharded, shard_module
from overlapcfg.demo.dims import MESH_DIMS, ParallelDims, tensor_parallel_faults
from overlapcfg.errors import Fault, OverlapConfigError, OverlapStateError

__all__ = ["DemoMesh", "ParallelDims", "apply_tensor_parallel", "build_mesh", "parallelize"]


@dataclass(frozen=True, slots=True)
class DemoMesh:
    """This rank's view of the demo mesh: the groups SimpleFSDP and the TP plan run their collectives on."""

    dims: ParallelDims
    mesh: DeviceMesh | None
    """``(dp_replicate, dp_shard, tp)``; ``None`` for plain FSDP (the default group is the shard group)."""
    shard_group: dist.ProcessGroup | None
    """FSDP all-gathers and reduce-scatters; ``None``: the default group, resolved when a parameter is used."""
    shard_rank: int
    """This rank's position in the shard group: which chunk of each parameter it keeps."""
    replicate_group: dist.ProcessGroup | None
    """HSDP's gradient all-reduces; ``None`` without replicas."""
    tp_mesh: DeviceMesh | None
    """The 1-D tensor-parallel mesh; ``None`` without TP."""
    dp_rank: int
    """This rank's data-parallel position (replica x shard): which batch it reads. TP ranks of one group share it:
    tensor parallelism splits one batch's computation, so they must all see the same tokens."""

    def group_names(self) -> dict[str, str]:
        """``{mesh dimension: process-group name as graphs state it}`` for the dimensions that communicate."""
        if self.mesh is None:
            world = dist.group.WORLD
            return {"dp_shard": world.group_name if world is not None else "0"}
        return {name: self.mesh.get_group(name).group_name for name in MESH_DIMS if getattr(self.dims, name) > 1}


def build_mesh(dims: ParallelDims, *, device_type: str = "cpu") -> DemoMesh:
    """The demo mesh for this rank, in the default process group (which must have ``dims.world_size`` ranks)."""
    if not dist.is_initialized():
        raise OverlapStateError("build_mesh: no default process group; open one first (e.g. compat.fake_process_group)")
    if dist.get_world_size() != dims.world_size:
        raise OverlapConfigError(f"build_mesh: the default group has {dist.get_world_size()} ranks, the mesh "
                                 f"{dims.describe()} needs {dims.world_size}")
    if dims.is_1d:
        return DemoMesh(dims, None, None, dist.get_rank(), None, None, dist.get_rank())
    mesh = init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=MESH_DIMS)
    return DemoMesh(
        dims, mesh,
        shard_group=mesh.get_group("dp_shard"),
        shard_rank=mesh.get_local_rank("dp_shard"),
        replicate_group=mesh.get_group("dp_replicate") if dims.dp_replicate > 1 else None,
        tp_mesh=mesh["tp"] if dims.tp > 1 else None,
        dp_rank=mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard"),
    )


def _block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """torchtitan's Llama plan for one block: column-wise in, row-wise out, so each sub-layer communicates once
    (an all-reduce of its output; with sequence parallel an all-gather in and a reduce-scatter out instead)."""
    out = Shard(1) if sequence_parallel else None
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=out),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=out),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "attention": gather,
                     "ffn_norm": SequenceParallel(), "feed_forward": gather})
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Tensor-parallelize the demo Llama in place over ``tp_mesh``; return it.

    Without sequence parallel, the embedding, the norms and the output stay whole on every TP rank (activations
    between blocks are replicated). With it, activations between blocks are sharded along the sequence: the
    embedding is row-wise (vocabulary) with a sequence-sharded output, the norms run on sequence shards, and the
    output projection is column-wise (vocabulary) and returns whole logits, so the loss is unchanged.
    """
    if is_sharded(model):
        raise OverlapStateError("apply_tensor_parallel: apply tensor parallel before SimpleFSDP (shard_module)")
    if sequence_parallel:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    for block in model.layers.values():  # type: ignore[operator]  # the demo Llama's ModuleDict (typed Tensor | Module)
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    return model


def _check_model(model: nn.Module, dims: ParallelDims) -> None:
    config = getattr(model, "config", None)
    if dims.tp == 1 or config is None:
        return
    faults = tensor_parallel_faults(dims, n_heads=config.n_heads, kv_heads=config.kv_heads,
                                    ffn_hidden=config.ffn_hidden, vocab_size=config.vocab_size)
    if faults:
        raise OverlapConfigError([Fault(f"model.{name}", why) for name, why in faults],
                                 header="cannot tensor-parallelize the model")


def parallelize(model: nn.Module, mesh: DemoMesh, *, reshard_after_forward: bool = False,
                param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Tensor parallel (if ``mesh.dims.tp > 1``), then SimpleFSDP over the data-parallel dimensions, in place.

    ``reshard_after_forward``, ``param_dtype`` and ``reduce_dtype`` are ``shard_module``'s. The model must be the
    demo Llama (or have its module names) when TP is on.
    """
    dims = mesh.dims
    if mesh.tp_mesh is not None:
        _check_model(model, dims)
        apply_tensor_parallel(model, mesh.tp_mesh, sequence_parallel=dims.sequence_parallel)
    return shard_module(model, world_size=dims.dp_shard, rank=mesh.shard_rank, group=mesh.shard_group,
                        reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype, replicate_group=mesh.replicate_group,
                        hsdp_reduce=dims.hsdp_reduce)

"""Rank functions and an independent prefetch probe for ``tests/fsdp2/test_fsdp2.py`` (spawned by ``run_on_gloo``, so
everything here is importable by name).

The probe does not read the driver's record or prefetch lists. It watches FSDP2 itself:

- an **all-gather** is the real process-group call (``torch.distributed.all_gather_single``, what FSDP2's default
  all-gather issues; ``all_gather_into_tensor`` on torch 2.11: ``compat.C10D_ALL_GATHER_NAME``), attributed to
  the FSDP2 parameter group whose ``unshard`` is on the stack;
- a bucket **starts computing in forward** at its first module's forward pre-hook, registered after sharding, so
  it runs after FSDP2's own pre-forward (which FSDP2 prepends): its unshard and its prefetches;
- a bucket **starts computing in backward** when autograd first unpacks a tensor the bucket saved in forward
  (``saved_tensors_hooks`` entered around the bucket's modules): the first backward kernel of the bucket.

Buckets are named by the test, from the plan's meaning (``{"layers.0": ["layers.0"], ...}``), not by the driver.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

# The probe attributes an all-gather to its parameter group: FSDP2's (private) group class is the only handle.
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import overlapcfg
from overlapcfg import compat
from overlapcfg.demo.llama import Llama, LlamaConfig, cross_entropy_loss
from overlapcfg.demo.tracing import demo_batch
from overlapcfg.fsdp2 import read_record
from tests.thirdparty import models as M

ROOT = "<root>"
STEPS = 3
DEMO = LlamaConfig(n_layers=4)

Event = tuple[str, str, str]
"""``(what, phase, bucket)``: what is ``all_gather`` or ``start``; phase ``forward`` or ``backward``."""


class Probe:
    """Records all-gathers and bucket starts, per step, for the buckets ``{name: [module fqn, ...]}``."""

    def __init__(self, model: nn.Module, buckets: dict[str, list[str]]) -> None:
        self.model = model
        self.buckets = buckets
        self.names = {model.get_submodule(f): name for name, fqns in buckets.items() for f in fqns}
        self.steps: list[list[Event]] = []
        self.phase = "forward"
        self._groups: list[str] = []
        self._seen: set[tuple[str, str]] = set()
        self._contexts: dict[nn.Module, Any] = {}

    def step(self, phase: str) -> None:
        if phase == "forward":
            self.steps.append([])
            self._seen = set()
        self.phase = phase

    def _record(self, what: str, bucket: str) -> None:
        if what == "start":
            if (self.phase, bucket) in self._seen:
                return
            self._seen.add((self.phase, bucket))
        self.steps[-1].append((what, self.phase, bucket))

    def _label(self, group: FSDPParamGroup) -> str:
        return self.names.get(group.modules[0], ROOT)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Probe]:
        probe = self
        unshard, all_gather = FSDPParamGroup.unshard, getattr(dist, compat.C10D_ALL_GATHER_NAME)

        def traced_unshard(group: FSDPParamGroup, *args: Any, **kwargs: Any) -> Any:
            probe._groups.append(probe._label(group))
            try:
                return unshard(group, *args, **kwargs)
            finally:
                probe._groups.pop()

        def traced_all_gather(*args: Any, **kwargs: Any) -> Any:
            if probe._groups:
                probe._record("all_gather", probe._groups[-1])
            return all_gather(*args, **kwargs)

        handles = []
        for module, name in self.names.items():
            handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            handles.append(module.register_forward_hook(self._post_hook()))
        FSDPParamGroup.unshard = traced_unshard  # type: ignore[method-assign]
        setattr(dist, compat.C10D_ALL_GATHER_NAME, traced_all_gather)
        try:
            yield self
        finally:
            FSDPParamGroup.unshard = unshard  # type: ignore[method-assign]
            setattr(dist, compat.C10D_ALL_GATHER_NAME, all_gather)
            for h in handles:
                h.remove()

    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._record("start", name)

            def unpack(packed: tuple[str, torch.Tensor]) -> torch.Tensor:
                if self.phase == "backward":
                    self._record("start", packed[0])
                return packed[1]

            ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: (name, t), unpack)
            ctx.__enter__()
            self._contexts[module] = ctx
        return hook

    def _post_hook(self) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._contexts.pop(module).__exit__(None, None, None)
        return hook


# --- models -------------------------------------------------------------------------------------------------------

def demo_model() -> tuple[nn.Module, Callable[[int], tuple[tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]]]:
    def batch(rank: int) -> tuple[tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]:
        tokens, targets = demo_batch(DEMO.vocab_size, seed=100 + rank)
        return (tokens,), lambda logits: cross_entropy_loss(logits, targets)
    return Llama(DEMO, seed=0), batch


def hf_model() -> tuple[nn.Module, Callable[[int], tuple[tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]]]:
    model, _ = M.hf_llama()

    def batch(rank: int) -> tuple[tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]:
        gen = torch.Generator().manual_seed(100 + rank)
        data = torch.randint(0, M.VOCAB, (M.BATCH, M.SEQ_LEN + 1), generator=gen)
        targets = data[:, 1:].contiguous()

        def loss_fn(output: Any) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten(0, 1))
        return (data[:, :-1].contiguous(),), loss_fn
    return model, batch


def _hf(build: Callable[[], tuple[nn.Module, Any]]) -> Callable[[], tuple[nn.Module, Callable[[int], Any]]]:
    """A thirdparty HF builder with this module's per-rank batch (the loss reads ``output.logits``)."""
    def make() -> tuple[nn.Module, Callable[[int], Any]]:
        model, _ = build()
        return model, hf_model()[1]
    return make


MODELS = {"demo": demo_model, "hf": hf_model, "gpt2": _hf(M.hf_gpt2), "gemma2": _hf(M.hf_gemma2)}
BLOCKS = {"demo": "layers", "hf": "model.layers", "gpt2": "transformer.h", "gemma2": "model.layers"}
"""Where each model keeps its blocks: plain per-block FSDP2 shards each child of this module, then the root."""


def plain_per_block(model: nn.Module, kind: str, mesh: Any) -> nn.Module:
    """The reference: torch's fully_shard on each block, then the root; no explicit prefetch."""
    for block in model.get_submodule(BLOCKS[kind]).children():
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model


def prefetch_readback(model: nn.Module, buckets: dict[str, list[str]]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """What FSDP2 itself holds, not what the driver meant to give it: each group's explicit forward and backward
    prefetch lists (``FSDPState._states_to_forward_prefetch`` / ``_states_to_backward_prefetch``, private: the only
    place FSDP2 keeps them), by bucket name, the root's group as ``ROOT``. A group listed in its own backward list
    (how the driver switches FSDP2's implicit prefetch off) is left out: prefetching itself is a no-op."""
    states = {ROOT: model._get_fsdp_state()}  # type: ignore[operator]
    states.update({name: model.get_submodule(fqns[0])._get_fsdp_state() for name, fqns in buckets.items()})
    name_of = {id(state): name for name, state in states.items()}

    def names(owner: str, listed: list[Any]) -> tuple[str, ...]:
        return tuple(n for s in listed if (n := name_of.get(id(s), "?")) != owner)

    return {name: (names(name, state._states_to_forward_prefetch), names(name, state._states_to_backward_prefetch))
            for name, state in states.items()}


# --- the rank function --------------------------------------------------------------------------------------------

def train_variants(rank: int, world_size: int, kind: str, variants: dict[str, Any],
                   buckets: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """For each variant (``None``: plain per-block FSDP2; else an overlap config), shard a fresh model, train
    ``STEPS`` SGD steps on this rank's batch with the probe installed; return losses, local gradient shards
    (every step), the probe's events and each step's wall time."""
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, dict[str, Any]] = {}
    for variant, cfg in variants.items():
        model, batch = MODELS[kind]()
        if cfg is None:
            plain_per_block(model, kind, mesh)
        else:
            overlapcfg.fully_shard(model, cfg, mesh=mesh)
        inputs, loss_fn = batch(rank)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        res: dict[str, Any] = {"losses": [], "grads": [], "seconds": []}
        probe = Probe(model, buckets)
        with probe.installed():
            for _ in range(STEPS):
                dist.barrier()
                started = time.perf_counter()
                optim.zero_grad()
                probe.step("forward")
                loss = loss_fn(model(*inputs))
                probe.step("backward")
                loss.backward()
                grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
                optim.step()
                res["seconds"].append(time.perf_counter() - started)
                res["losses"].append(loss.detach().clone())
                res["grads"].append(grads)
        res["events"] = probe.steps
        res["params"] = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
        if cfg is not None:  # after the steps: the first forward may have re-planned the lists
            record = read_record(model)
            res["readback"] = prefetch_readback(model, buckets)
            res["record"] = {"forward": dict(record.forward_prefetch), "backward": dict(record.backward_prefetch),
                             "effective": [(d.direction, d.bucket, d.position, d.effective)
                                           for d in record.decisions if d.kind == "all_gather"],
                             "backward_order": record.backward_order, "same_schedule": record.record.same_schedule}
        out[variant] = res
    return out


def train_models(rank: int, world_size: int,
                 jobs: dict[str, tuple[dict[str, Any], dict[str, list[str]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``train_variants`` for several models in one gloo run (spawning ranks costs more than training them)."""
    return {kind: train_variants(rank, world_size, kind, variants, buckets)
            for kind, (variants, buckets) in jobs.items()}

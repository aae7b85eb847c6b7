"""The step's own kernels, timed in turn as the step runs them, not each one back to back.

Timing a kernel back to back (``Clock.per_call``) keeps its code, the dispatcher's tables and its operands in the
core's caches from one call to the next. A step never runs a kernel that way: between two calls of one kernel it
runs every other kernel of the step, whose data and code evict the first one's. On this project's 2-core CPU
(``benchmarks/measured.py``'s demo step, measured node by node inside the running step) the difference was the
largest error left in the calibrated prediction:

- 395 views: 0.53 ms back to back, 7.7 ms inside the step (1.3 against 19 us each);
- 244 memory-bound kernels: 2.5 ms back to back, 14.4 ms inside the step;
- 95 matmuls and attention calls: 48 ms back to back, 76 ms inside the step.

Timed *in turn* instead (each distinct call of the step once per round, in the order the graphs first run them,
every call timed on its own), the same kernels took 5.8, 14.1 and 66 ms: within 25 % of the step for each kind,
where back-to-back timing was 3 to 14 times under. No number from the step's own run goes into it: only which
kernels the step calls, at which shapes, which its traced graphs say.

So calibration (on a CPU; a GPU runs its kernels from a queue, and its launch costs overlap) replays the step's
distinct calls in turn (``time_in_turn``) on tensors of their traced shapes, strides and dtypes (floating point
random, integers and booleans zero: every index is then in range), and the profile takes from them:

- ``MemoryRate.view_seconds``: the mean over the step's views;
- ``MemoryRate.launch_seconds``: what the step's memory-bound kernels take beyond their bytes at the calibrated
  bandwidth, on average (so the sum over the step is what was timed);
- the timed matmuls (``MatmulRate.timed``) of the step's dtype: each shape's time in turn.

A call that cannot be replayed (an op that is not an ``OpOverload``, a symbolic size, an op that raises on the
tensors given) is left to the back-to-back figures, and the profile's notes count them.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.cost.price import matmul_layout, matmul_shape, node_bytes, node_kind

__all__ = ["IN_TURN_ROUNDS", "KernelCall", "MAX_CALLS", "MAX_REPLAY_BYTES", "TensorSpec", "kernel_census",
           "launch_beyond_bytes", "replayed", "time_in_turn"]

IN_TURN_ROUNDS = 15
"""Rounds of the step's calls; each call's time is its median over them."""
MAX_CALLS = 512
"""Distinct calls replayed at most (those the step makes most often): a round stays a fraction of a second."""
MAX_REPLAY_BYTES = 2**30
"""Bytes of made-up inputs held at once at most (every replayed call keeps its own for the whole replay): calls past
it, the least frequent first, are left to the back-to-back figures, so a large model calibrating on a CPU does not
need its step's activations many times over."""
MAX_ROUND_SECONDS = 0.5
"""Rounds stop at ``IN_TURN_ROUNDS`` or once they have taken ``IN_TURN_ROUNDS x`` this (at least 3 rounds)."""

Kind = Literal["compute", "memory", "view"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor argument as traced: enough to make one of the same layout."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class KernelCall:
    """One distinct call of the step: the op by name, its arguments with tensors as ``TensorSpec``. Plain data, as
    ``MatmulMix`` is: it travels to the ranks that time it."""

    op: str
    """``aten.mm.default``: namespace, name and overload (``compat.op_overload_named``)."""
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    kind: Kind
    nbytes: int
    """Bytes read and written (``overlapcfg.cost.price.node_bytes``)."""
    matmul: tuple[tuple[int, int, int, int], str] | None = None
    """``(shape, layout)`` of a matmul (``matmul_shape``, ``matmul_layout``)."""

    def input_bytes(self) -> int:
        """Bytes of the tensors a replay makes for it (each argument's whole extent)."""
        return sum(_extent(t) * t.dtype.itemsize for t in _tensor_specs((self.args, tuple(v for _, v in self.kwargs))))


def _tensor_specs(spec: object) -> list[TensorSpec]:
    if isinstance(spec, TensorSpec):
        return [spec]
    if isinstance(spec, tuple):
        return [t for inner in spec for t in _tensor_specs(inner)]
    return []


def _extent(spec: TensorSpec) -> int:
    """Elements of storage the layout reaches (at least one)."""
    if not all(spec.shape):
        return 1
    return spec.offset + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True)) + 1


class _Unreplayable(Exception):
    """A node calibration cannot call again on tensors of its own (see the module docstring)."""


def _spec(value: object) -> object:
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
            raise _Unreplayable
        return TensorSpec(tuple(val.shape), tuple(val.stride()), int(val.storage_offset()), val.dtype)
    if isinstance(value, (list, tuple)):
        return ("list" if isinstance(value, list) else "tuple", tuple(_spec(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return ("value", value)
    raise _Unreplayable


def _call_of(node: fx.Node) -> KernelCall | None:
    priced = node_kind(node)
    kind: Kind
    if priced == "free" and node.target is not operator.getitem:
        kind = "view"
    elif priced in ("compute", "memory"):
        kind = "compute" if priced == "compute" else "memory"
    else:
        return None
    name = compat.op_overload_name(node.target)
    if name is None:
        raise _Unreplayable
    shape = matmul_shape(node)
    return KernelCall(op=name, args=tuple(_spec(a) for a in node.args),
                      kwargs=tuple((k, _spec(v)) for k, v in sorted(node.kwargs.items())), kind=kind,
                      nbytes=node_bytes(node) if kind != "view" else 0,
                      matmul=(shape, matmul_layout(node)) if shape is not None else None)


def kernel_census(graphs: Sequence[fx.GraphModule]) -> tuple[Counter[KernelCall], int]:
    """How often the graphs make each distinct kernel call (matmuls and other compute, memory-bound kernels, views;
    in the order they first run), and how many calls cannot be replayed (see the module docstring)."""
    calls: Counter[KernelCall] = Counter()
    unreplayable = 0
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            try:
                call = _call_of(node)
            except _Unreplayable:
                unreplayable += 1
                continue
            if call is not None:
                calls[call] += 1
    return calls, unreplayable


def replayed(calls: Counter[KernelCall], *, max_calls: int = MAX_CALLS,
             max_bytes: int = MAX_REPLAY_BYTES) -> list[KernelCall]:
    """The calls to replay, in the order the step first makes them: the most frequent first, up to ``max_calls`` of
    them and ``max_bytes`` of made-up inputs in all."""
    kept: set[KernelCall] = set()
    held = 0
    for call, _ in calls.most_common():
        if len(kept) >= max_calls:
            break
        need = call.input_bytes()
        if held + need > max_bytes:
            continue
        kept.add(call)
        held += need
    return [c for c in calls if c in kept]


def _made(spec: object, device: torch.device, generator: torch.Generator) -> object:
    if isinstance(spec, TensorSpec):
        extent = _extent(spec)
        if spec.dtype.is_floating_point or spec.dtype.is_complex:
            base = torch.randn(extent, generator=generator).to(device=device, dtype=spec.dtype)
        else:
            base = torch.zeros(extent, dtype=spec.dtype, device=device)
        return base.as_strided(spec.shape, spec.stride, spec.offset)
    assert isinstance(spec, tuple) and len(spec) == 2  # _spec builds only pairs besides TensorSpec
    tag, inner = spec
    if tag == "value":
        return inner
    made = [_made(s, device, generator) for s in inner]
    return made if tag == "list" else tuple(made)


def _replay(call: KernelCall, device: torch.device, generator: torch.Generator) -> Callable[[], object] | None:
    """The call on fresh tensors, run once; None where the op refuses them."""
    op = compat.op_overload_named(call.op)
    if op is None:
        return None
    args = tuple(_made(a, device, generator) for a in call.args)
    kwargs = {k: _made(v, device, generator) for k, v in call.kwargs}

    def run() -> object:
        return op(*args, **kwargs)

    try:
        run()
    except Exception:  # an op may refuse made-up values: it keeps the back-to-back figures
        return None
    return run


def time_in_turn(calls: Sequence[KernelCall], device: torch.device, *, rounds: int = IN_TURN_ROUNDS,
                 max_round_seconds: float = MAX_ROUND_SECONDS) -> list[float | None]:
    """Seconds of each call (its median over the rounds), running every call once a round in the order given, each
    timed on its own; None for a call that could not be replayed. CPU only: the host clock around one call is its
    duration there (``overlapcfg.measuring.clock``)."""
    generator = torch.Generator().manual_seed(0)
    runs = [_replay(c, device, generator) for c in calls]
    samples: list[list[float]] = [[] for _ in calls]
    clock = time.perf_counter
    started = clock()
    for done in range(rounds):
        if done >= 3 and clock() - started > max_round_seconds * rounds:
            break
        for i, run in enumerate(runs):
            if run is None:
                continue
            t0 = clock()
            run()
            samples[i].append(clock() - t0)
    return [statistics.median(s) if s else None for s in samples]


def launch_beyond_bytes(calls: Sequence[KernelCall], counts: Sequence[int], seconds: Sequence[float | None],
                        bandwidth: float) -> float | None:
    """The per-kernel cost that makes ``launch + bytes / bandwidth`` sum to the timed memory-bound calls: their
    count-weighted time less their bytes at ``bandwidth``, per call (never below zero); None without one."""
    timed = [(c, n, s) for c, n, s in zip(calls, counts, seconds, strict=True) if c.kind == "memory" and s is not None]
    if not timed:
        return None
    total = sum(n * s for _, n, s in timed)
    moving = sum(n * c.nbytes / bandwidth for c, n, _ in timed)
    return max(0.0, (total - moving) / sum(n for _, n, _ in timed))

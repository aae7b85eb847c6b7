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
where back-to-back timing was 1.6 to 14 times under. No number from the step's own run goes into it: only which
kernels the step calls, at which shapes, which its traced graphs say.

So calibration (on a CPU; a GPU runs its kernels from a queue, and its launch costs overlap) replays the step's
distinct calls in turn (``time_in_turn``) on tensors of their traced shapes, strides and dtypes (floating point
random, integers and booleans zero: every index is then in range), and the profile takes from them:

- ``MemoryRate.view_seconds``: the mean over the step's views;
- ``MemoryRate.launch_seconds``: what the step's memory-bound kernels take beyond their bytes at the calibrated
  bandwidth, on average (so the sum over the step is what was timed);
- the timed matmuls (``MatmulRate.timed``): each shape's time in turn, in every layout and dtype the step runs it
  in.

On a machine other jobs share, each call is priced at the replay's *share of the CPU*, not at its own median:
``time_in_turn`` also reads the thread's CPU clock around every call, and a call's time is its median CPU time times
the replay's wall time over its CPU time (``TurnTimes.cpu_share``, 1 on an idle core). A median of wall times does
not do it: a scheduler takes its time slices from whichever call is running when the slice starts, so the long calls
absorb them and a call shorter than a slice almost never does (its median is its idle-core time), while the step
runs its short calls hundreds of times. Measured on this project's 2-core CPU beside another 2-rank job: the replay
ran at 52 % of a core (62 ms of CPU a round, 117 ms of wall), the step's main thread at 53 % (164 ms of CPU, 307 ms
running or waiting to run); the calls' count-weighted wall medians were 1.6x their idle-core times, their CPU times
times the share 1.9x, as the step. Only with one intra-op thread (the thread's CPU clock then counts all of a call's
work; with more, the wall medians are kept and the share is 1).

What is not replayed, and why: an op that writes one of its arguments (``copy_``, a resize: it would change what
the replay holds), a collective (it would talk to the other ranks), a random op (it would move the random state),
a call on a symbolic size or a tensor that is not strided, an op that is not an ``OpOverload``, and an op that
raises on the made-up tensors. Those keep the back-to-back figures, and the profile's notes count them. The replay
runs inside ``torch.random.fork_rng``, and within a time budget (at least one round).
"""

from __future__ import annotations

import math
import operator
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.cost.price import matmul_layout, matmul_shape, node_bytes, node_kind

__all__ = ["IN_TURN_ROUNDS", "InTurn", "KernelCall", "MAX_CALLS", "MAX_REPLAY_BYTES", "TensorSpec", "TurnTimes",
           "in_turn_note", "kernel_census", "launch_beyond_bytes", "matmul_layouts_in_turn", "matmuls_in_turn",
           "priced_in_turn", "replayed", "time_in_turn", "views_in_turn"]

IN_TURN_ROUNDS = 15
"""Rounds of the step's calls; each call's time is its median over them."""
MAX_CALLS = 512
"""Distinct calls replayed at most (those the step makes most often)."""
MAX_REPLAY_BYTES = 2**30
"""Bytes of made-up inputs held at once at most (every replayed call keeps its own for the whole replay): calls past
it, the least frequent first, are left to the back-to-back figures, so a large model calibrating on a CPU does not
need its step's activations many times over."""
ALIGNMENT = 64
"""Elements a made-up tensor's storage offset is reduced to modulo: the traced offset into a large flat buffer
(a bucket, a view deep into a parameter) would otherwise allocate all the storage before it."""
_NOT_KERNELS = ("_operator", "operator", "builtins", "math")
"""Modules of Python callables a graph calls on sizes (``operator.mul`` on SymInts): no kernel, nothing to count."""
_COLLECTIVE_NAMESPACES = ("_c10d", "c10d", "symm_mem")

Kind = Literal["compute", "memory", "view"]
Spec: TypeAlias = "TensorSpec | tuple[str, Any] | tuple[str, str, Any]"
"""An argument as traced: a ``TensorSpec``, ``("list" | "tuple", (Spec, ...))`` or ``("value", type name, value)``."""


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
    args: tuple[Spec, ...]
    kwargs: tuple[tuple[str, Spec], ...]
    kind: Kind
    nbytes: int
    """Bytes read and written (``overlapcfg.cost.price.node_bytes``)."""
    matmul: tuple[tuple[int, int, int, int], str] | None = None
    """``(shape, layout)`` of a matmul (``matmul_shape``, ``matmul_layout``)."""
    dtype: torch.dtype | None = None
    """The first tensor argument's dtype (a matmul's is the rate it is priced at)."""

    def input_bytes(self) -> int:
        """Bytes of the tensors a replay makes for it."""
        return sum(_extent(t) * t.dtype.itemsize for t in _tensor_specs((self.args, tuple(v for _, v in self.kwargs))))


InTurn: TypeAlias = tuple[Sequence[KernelCall], Sequence[int], Sequence["float | None"]]
"""``(calls, how often the step makes each, seconds in turn or None)``: what calibration keeps of the replay."""


def _tensor_specs(spec: object) -> list[TensorSpec]:
    if isinstance(spec, TensorSpec):
        return [spec]
    if isinstance(spec, tuple):
        return [t for inner in spec for t in _tensor_specs(inner)]
    return []


def _extent(spec: TensorSpec) -> int:
    """Elements of storage the made-up tensor needs (at least one; the offset reduced, see ``ALIGNMENT``)."""
    if not all(spec.shape):
        return 1
    return spec.offset % ALIGNMENT + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True)) + 1


class _Unreplayable(Exception):
    """A node calibration does not call again on tensors of its own (see the module docstring)."""


def _spec(value: object) -> Spec:
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            raise _Unreplayable
        sizes = (*val.shape, *val.stride(), val.storage_offset())
        if not all(isinstance(d, int) for d in sizes):
            raise _Unreplayable
        dims = [int(d) for d in sizes]  # plain ints already (checked): no symbolic size is specialized here
        rank = val.dim()
        return TensorSpec(tuple(dims[:rank]), tuple(dims[rank:2 * rank]), dims[-1], val.dtype)
    if isinstance(value, (list, tuple)):
        return ("list" if isinstance(value, list) else "tuple", tuple(_spec(v) for v in value))
    if isinstance(value, float) and math.isnan(value):
        return ("value", "float", "nan")
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return ("value", type(value).__name__, value)  # 1, 1.0 and True are different arguments
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
        if getattr(node.target, "__module__", None) in _NOT_KERNELS:
            return None
        raise _Unreplayable
    if compat.op_effects(node.target)[0] or name.startswith(_COLLECTIVE_NAMESPACES) or \
            torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        raise _Unreplayable
    shape = matmul_shape(node)
    args = tuple(_spec(a) for a in node.args)
    tensors = _tensor_specs(args)
    return KernelCall(op=name, args=args, kwargs=tuple((k, _spec(v)) for k, v in sorted(node.kwargs.items())),
                      kind=kind, nbytes=node_bytes(node) if kind != "view" else 0,
                      matmul=(shape, matmul_layout(node)) if shape is not None else None,
                      dtype=tensors[0].dtype if tensors else None)


def kernel_census(graphs: Sequence[fx.GraphModule]) -> tuple[Counter[KernelCall], int]:
    """How often the graphs make each distinct kernel call (matmuls and other compute, memory-bound kernels, views;
    in the order they first run), and how many calls are not replayed (see the module docstring)."""
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


def _made(spec: Spec, device: torch.device, generator: torch.Generator) -> object:
    if isinstance(spec, TensorSpec):
        extent = _extent(spec)
        if spec.dtype.is_floating_point or spec.dtype.is_complex:
            base = torch.randn(extent, generator=generator).to(device=device, dtype=spec.dtype)
        else:
            base = torch.zeros(extent, dtype=spec.dtype, device=device)
        return base.as_strided(spec.shape, spec.stride, spec.offset % ALIGNMENT if all(spec.shape) else 0)
    if spec[0] == "value":
        return spec[-1] if spec[1:] != ("float", "nan") else math.nan
    made = [_made(s, device, generator) for s in cast(tuple[Spec, ...], spec[1])]  # a list's or tuple's items
    return made if spec[0] == "list" else tuple(made)


def _replay(call: KernelCall, device: torch.device, generator: torch.Generator) -> Callable[[], object] | None:
    """The call on fresh tensors, run once; None where the op is not found here or refuses them."""
    op = compat.op_overload_named(call.op)
    if op is None:
        return None
    try:
        args = tuple(_made(a, device, generator) for a in call.args)
        kwargs = {k: _made(v, device, generator) for k, v in call.kwargs}

        def run() -> object:
            return op(*args, **kwargs)

        run()
    except Exception:  # a dtype torch cannot fill, an op refusing made-up values: it keeps the back-to-back figures
        return None
    return run


@dataclass(frozen=True, slots=True)
class TurnTimes:
    """What ``time_in_turn`` measured on this rank."""

    seconds: list[float | None]
    """Each call's time in turn at the replay's share of the CPU; None for a call that could not be replayed."""
    cpu_share: float
    """The replay's wall time over its CPU time (>= 1; 1 on an idle core, about 2 beside one other busy job per
    core), the factor each call's CPU time is priced at; 1 where the calls were priced at their wall medians."""


def time_in_turn(calls: Sequence[KernelCall], device: torch.device, *, rounds: int = IN_TURN_ROUNDS,
                 budget_s: float = 5.0) -> TurnTimes:
    """Time each call in turn: every call once a round in the order given, each timed on its own by the wall clock
    and the thread's CPU clock. With one intra-op thread a call's seconds are its median CPU time times the
    replay's CPU share (see the module's docstring), else its median wall time. Rounds stop after ``rounds``, or
    once ``budget_s`` has passed at the end of a round (at least one round). A call that cannot be replayed (or
    fails in a later round) is None. Runs inside ``torch.random.fork_rng``: the caller's random state is as it was.
    CPU only: the host clock around one call is its duration there (``overlapcfg.measuring.clock``)."""
    with torch.random.fork_rng(devices=[]):
        generator = torch.Generator().manual_seed(0)
        runs = [_replay(c, device, generator) for c in calls]
        walls: list[list[float]] = [[] for _ in calls]
        cpus: list[list[float]] = [[] for _ in calls]
        clock, cpu_clock = time.perf_counter, time.thread_time
        started = clock()
        for _ in range(rounds):
            for i, run in enumerate(runs):
                if run is None:
                    continue
                c0, t0 = cpu_clock(), clock()
                try:
                    run()
                except Exception:  # failed on a later call (a value it changed in place): left out from here on
                    runs[i], walls[i], cpus[i] = None, [], []
                    continue
                walls[i].append(clock() - t0)
                cpus[i].append(cpu_clock() - c0)
            if clock() - started > budget_s:
                break
    return priced_in_turn(walls, cpus, single_thread=torch.get_num_threads() == 1)


def priced_in_turn(walls: Sequence[Sequence[float]], cpus: Sequence[Sequence[float]], *,
                   single_thread: bool) -> TurnTimes:
    """Each call's price from its wall and CPU samples (an empty list: not timed): with ``single_thread``, its
    median CPU time times the replay's share (its summed wall over its summed CPU, never below 1); otherwise its
    median wall time, at a share of 1."""
    wall_total = sum(sum(w) for w in walls)
    cpu_total = sum(sum(c) for c in cpus)
    if not single_thread or cpu_total <= 0.0:
        return TurnTimes([statistics.median(w) if w else None for w in walls], 1.0)
    share = max(1.0, wall_total / cpu_total)
    return TurnTimes([statistics.median(c) * share if c else None for c in cpus], share)


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


def views_in_turn(in_turn: InTurn) -> float | None:
    """The mean time of the step's views in turn (count-weighted); None where none was timed."""
    calls, counts, seconds = in_turn
    timed = [(n, s) for c, n, s in zip(calls, counts, seconds, strict=True) if c.kind == "view" and s is not None]
    return sum(n * s for n, s in timed) / sum(n for n, _ in timed) if timed else None


def matmuls_in_turn(in_turn: InTurn, chosen: Sequence[tuple[int, int, int, int]], layouts: dict[Any, str],
                    timed: dict[torch.dtype, Sequence[float]]) -> tuple[dict[torch.dtype, list[float]], int]:
    """``timed`` (each dtype's back-to-back seconds of the ``chosen`` shapes) with each shape's time in turn where
    the replay timed the step's calls of that shape, layout and dtype (count-weighted), and how many it replaced."""
    calls, counts, seconds = in_turn
    out = {dt: list(ts) for dt, ts in timed.items()}
    replaced = 0
    for dt, times in out.items():
        for i, shape in enumerate(chosen):
            key = (shape, layouts.get(shape, "nn"))
            found = [(n, s) for c, n, s in zip(calls, counts, seconds, strict=True)
                     if s is not None and c.matmul == key and c.dtype == dt]
            if found:
                times[i] = sum(n * s for n, s in found) / sum(n for n, _ in found)
                replaced += 1
    return out, replaced


def matmul_layouts_in_turn(in_turn: InTurn) -> dict[torch.dtype, dict[tuple[tuple[int, int, int, int], str], float]]:
    """Per dtype, every matmul ``(shape, layout)`` the replay timed and its time in turn (count-weighted over the
    step's calls of it): a shape the step runs in two layouts is two kernels, and each is priced as timed."""
    calls, counts, seconds = in_turn
    sums: dict[torch.dtype, dict[tuple[tuple[int, int, int, int], str], tuple[float, int]]] = {}
    for c, n, sec in zip(calls, counts, seconds, strict=True):
        if c.matmul is None or c.dtype is None or sec is None:
            continue
        have = sums.setdefault(c.dtype, {}).get(c.matmul, (0.0, 0))
        sums[c.dtype][c.matmul] = (have[0] + n * sec, have[1] + n)
    return {dt: {key: total / n for key, (total, n) in by.items()} for dt, by in sums.items()}


def in_turn_note(in_turn: InTurn, *, left_out: int, views: float | None, back_to_back_views: float,
                 launch: float | None, back_to_back_launch: float, matmuls: int, cpu_share: float = 1.0) -> str | None:
    """The profile's note on the replay: what it timed and set, and how many of the step's calls it left to the
    back-to-back figures; None where the step had no kernel calls to speak of."""
    calls, counts, seconds = in_turn
    if not calls and not left_out:
        return None
    timed: Counter[str] = Counter(c.kind for c, s in zip(calls, seconds, strict=True) if s is not None)
    refused = sum(n for n, s in zip(counts, seconds, strict=True) if s is None)
    said = [f"{timed[k]} {what}" for k, what in (("view", "views"), ("memory", "memory-bound"),
                                                 ("compute", "matmul and other compute")) if timed[k]]
    parts = [f"the step's distinct kernel calls timed in turn, as the step runs them ({', '.join(said) or 'none'})"]
    if cpu_share > 1.0:
        parts.append(f"each at its CPU time x {cpu_share:.2f} (the replay's wall over CPU time: 1 on an idle core, "
                     "more where other jobs share its cores)")
    if views is not None:
        parts.append(f"view_seconds {views * 1e6:.3g} us (back to back {back_to_back_views * 1e6:.3g} us)")
    if launch is not None:
        parts.append(f"launch_seconds {launch * 1e6:.3g} us beyond the bytes at mem_bandwidth (back to back "
                     f"{back_to_back_launch * 1e6:.3g} us)")
    if matmuls:
        parts.append(f"{matmuls} timed matmul shape(s) at their times in turn")
    if refused + left_out:
        parts.append(f"{refused + left_out} of the step's kernel calls were not replayed (in-place, collective or "
                     "random ops, symbolic sizes, ops refusing made-up values, or past the replay's caps) and are "
                     "priced by the back-to-back figures")
    return "kernels: " + "; ".join(parts)

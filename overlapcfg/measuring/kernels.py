"""Time the kernels the roofline prices: the model's matmuls (compute) and an elementwise kernel (memory).

The roofline (``overlapcfg.cost.price.compute_seconds``) charges a kernel ``max(FLOPs / peak, bytes /
bandwidth)``. Calibration measures each term where it applies:

- ``mem_bandwidth``: ``out = a + b`` over log-spaced sizes, back to back, fitted as ``overhead + bytes /
  bandwidth`` (bytes read and written, as the roofline counts them); the overhead (what a tiny kernel costs) is
  recorded, not priced: the roofline has no per-kernel constant (see ``compute_seconds``);
- the matmul rate: every distinct matmul shape of the step's graphs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, read
  from their fake tensors) in the step's dtype, timed back to back; the rate is their FLOPs over their time, each
  shape weighted by how often the step runs it, so the roofline reproduces the model's matmul time as a whole.
  Without a step, a few square shapes stand in.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.cost.calibration import KernelSamples
from overlapcfg.errors import OverlapConfigError
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.collectives import log_sizes
from overlapcfg.measuring.fit import fit_line

__all__ = ["MatmulMix", "MatmulShape", "chosen_shapes", "default_shapes", "matmul_mix", "matmul_samples",
           "memory_samples", "memory_sizes", "time_matmuls", "time_memory"]

MatmulShape = tuple[int, int, int, int]
"""``(batch, m, k, n)``: ``batch`` products of ``(m x k) @ (k x n)``."""

_MATMULS = {"aten.mm": (0, 1), "aten.addmm": (1, 2), "aten.bmm": (0, 1), "aten.baddbmm": (1, 2)}
"""Matmul ops and the argument positions of their two factors."""
MAX_SHAPES = 16
"""Distinct shapes timed at most (those with the most FLOPs in the step)."""


@dataclass(frozen=True, slots=True)
class MatmulMix:
    """The matmuls a step runs: how many of each shape, in which dtype. Plain data: it travels to other processes
    where the graphs it was read from cannot (``calibrate(step=mix)``)."""

    shapes: Counter[MatmulShape]
    dtype: torch.dtype | None


def matmul_mix(graphs: Sequence[fx.GraphModule]) -> MatmulMix:
    """How many times the graphs run each matmul shape, and their (first) dtype."""
    shapes: Counter[MatmulShape] = Counter()
    dtype = None
    for gm in graphs:
        for node in gm.graph.nodes:
            positions = _MATMULS.get(compat.op_name(node.target)) if node.op == "call_function" else None
            if positions is None:
                continue
            a, b = (node.args[i].meta.get("val") if isinstance(node.args[i], fx.Node) else None for i in positions)
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                continue
            batch = a.shape[0] if a.dim() == 3 else 1
            shapes[(int(batch), int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1]))] += 1
            dtype = dtype or a.dtype
    return MatmulMix(shapes, dtype)


def _flops(shape: MatmulShape) -> int:
    batch, m, k, n = shape
    return 2 * batch * m * k * n


def chosen_shapes(shapes: Counter[MatmulShape]) -> list[MatmulShape]:
    """The shapes to time: the ``MAX_SHAPES`` with the most FLOPs in the step, in that order."""
    return sorted(shapes, key=lambda s: (-_flops(s) * shapes[s], s))[:MAX_SHAPES]


def time_matmuls(chosen: Sequence[MatmulShape], dtype: torch.dtype, clock: Clock, *,
                 progress: Callable[[str, int], None] | None = None) -> list[float]:
    """Seconds per call of each shape, back to back."""
    seconds = []
    for shape in chosen:
        batch, m, k, n = shape
        a = torch.randn(batch, m, k, dtype=dtype, device=clock.device)
        b = torch.randn(batch, k, n, dtype=dtype, device=clock.device)
        op: Callable[[], object] = functools.partial(torch.bmm, a, b) if batch > 1 else \
            functools.partial(torch.mm, a[0], b[0])
        seconds.append(clock.per_call(op))
        if progress is not None:
            progress("matmuls", 1)
    return seconds


def matmul_samples(shapes: Counter[MatmulShape], chosen: Sequence[MatmulShape], seconds: Sequence[float],
                   dtype: torch.dtype) -> KernelSamples:
    """The rate at the step's mix (see the module docstring) and its residual per shape."""
    work = [float(_flops(s)) for s in chosen]
    rate = sum(w * shapes[s] for w, s in zip(work, chosen, strict=True)) / \
        sum(t * shapes[s] for t, s in zip(seconds, chosen, strict=True))
    errors = [(w / rate - t) / t for w, t in zip(work, seconds, strict=True)]
    residual = math.sqrt(sum(e * e for e in errors) / len(errors))
    names = tuple(f"{'' if s[0] == 1 else f'{s[0]} x '}{s[1]} x {s[2]} x {s[3]} (x{shapes[s]})" for s in chosen)
    return KernelSamples(what=f"matmul {str(dtype).removeprefix('torch.')}", shapes=names, work=tuple(work),
                         seconds=tuple(seconds), rate=rate, overhead=0.0, residual=residual)


def memory_sizes(max_bytes: int) -> list[int]:
    """Bytes read + written by the timed ``a + b`` (fp32: 12 bytes an element), one per octave."""
    return log_sizes(12, max_bytes, per_octave=1, multiple=12)


def time_memory(sizes: Sequence[int], clock: Clock, *, progress: Callable[[str, int], None] | None = None,
                ) -> list[float]:
    """Seconds per call of ``out = a + b`` (fp32) moving each of ``sizes`` bytes."""
    seconds = []
    for nbytes in sizes:
        numel = nbytes // 12
        a, b, out = (torch.ones(numel, device=clock.device) for _ in range(3))
        seconds.append(clock.per_call(functools.partial(torch.add, a, b, out=out)))
        if progress is not None:
            progress("memory", 1)
    return seconds


def memory_samples(sizes: Sequence[int], seconds: Sequence[float]) -> KernelSamples:
    """``overhead + bytes / rate`` fitted through the timings."""
    fit = fit_line(sizes, seconds)
    overhead, per_byte = fit.coefficients
    if per_byte <= 0:
        raise OverlapConfigError(f"calibrate: elementwise kernel times do not grow with size up to {max(sizes)} bytes; "
                                 "raise the largest size")
    return KernelSamples(what="memory (a + b, float32)", shapes=tuple(f"{n} B" for n in sizes),
                         work=tuple(float(n) for n in sizes), seconds=tuple(seconds), rate=1.0 / per_byte,
                         overhead=overhead, residual=fit.residual)


def default_shapes(clock: Clock) -> Counter[MatmulShape]:
    """Square matmuls standing in for a model's when none is given: sizes a step of that device would run."""
    sides = (2048, 4096, 8192) if clock.cuda else (256, 512, 1024)
    return Counter({(1, s, s, s): 1 for s in sides})

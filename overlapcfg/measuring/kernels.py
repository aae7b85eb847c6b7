"""Time the kernels the roofline prices: the model's matmuls (compute) and an elementwise kernel (memory).

The roofline (``overlapcfg.cost.price.compute_seconds``) charges a kernel ``max(FLOPs / peak, bytes /
bandwidth)``. Calibration measures each term where it applies:

- ``mem_bandwidth``: ``out = a + b`` over log-spaced sizes up to well beyond the last-level cache, back to back
  (bytes read and written, as the roofline counts them). Through the sizes at least ``BEYOND_CACHE`` times the
  cache (``overlapcfg.measuring.device``) a line ``overhead + bytes / bandwidth`` gives the memory's own bandwidth;
  a fit through every size, which is what the profile held before, is the cache's (8.8 TB/s on an H200 whose HBM
  does 4.8). The profile's figure is the rate at the step's own memory-bound kernels, as the matmul rate is: their
  bytes over the time the timings give each of their sizes (interpolated; beyond the largest size, along the
  memory's line), so a model whose kernels stay in the cache is priced at the cache's speed and one whose
  kernels stream from memory at the memory's; without a step, the memory's bandwidth. Calibration caps the figure
  at the device's datasheet and says so. The overhead (what a tiny kernel costs, from all sizes) is recorded, not
  priced: the roofline has no per-kernel constant (see ``compute_seconds``);
- the matmul rates: every distinct matmul shape of the step's graphs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, read
  from their fake tensors), timed back to back in each dtype of ``MATMUL_DTYPES`` (what a model trains in is
  measured, not extrapolated from another dtype); a rate is their FLOPs over their time, each shape weighted by how
  often the step runs it, so the roofline reproduces the model's matmul time as a whole. Without a step, a few
  square shapes stand in.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from overlapcfg.cost.achievable import MatmulRate
from overlapcfg.cost.measured_fits import KernelSamples
from overlapcfg.cost.price import collective_bytes, matmul_layout, matmul_shape, node_bytes, node_kind
from overlapcfg.errors import OverlapConfigError
from overlapcfg.graph.ops import collective_kind
from overlapcfg.measuring.attention_timing import AttentionShape, attention_census
from overlapcfg.measuring.clock import Clock
from overlapcfg.measuring.collective_fits import log_sizes
from overlapcfg.measuring.fit import fit_line, fit_nonnegative
from overlapcfg.measuring.step_kernels import KernelCall, kernel_census

__all__ = ["ANCHOR_SHAPES", "BEYOND_CACHE", "MATMUL_DTYPES", "MEMORY_ATTEMPTS", "MEMORY_CAP", "MatmulMix",
           "MatmulShape", "beyond_cache", "chosen_shapes", "default_shapes", "matmul_mix", "matmul_rate_fit",
           "matmul_samples", "memory_grows", "memory_samples", "memory_sizes", "time_matmuls", "time_memory",
           "time_views", "timed_until_growing"]

MatmulShape = tuple[int, int, int, int]
"""``(batch, m, k, n)``: ``batch`` products of ``(m x k) @ (k x n)``."""

MATMUL_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes the matmul rate is measured in (``PeakFlops.fp32`` and ``.bf16``; fp16 is priced as bf16)."""
BEYOND_CACHE = 4
"""The memory bandwidth is fitted through sizes at least this many times the last-level cache."""
MEMORY_CAP = {"cpu": 2**30, "gpu": 2**32}
"""Largest total bytes (read + written) of the memory kernel, per device kind: a CPU's last-level cache can be
hundreds of MiB (480 MiB here), and three buffers of a few GiB on a shared machine would be a burden."""
MIN_BEYOND = 3
"""Sizes the bandwidth is fitted through at least (the largest ones, where fewer lie beyond the cache)."""
KERNEL_SECONDS = 0.05
"""How long each round of a timed kernel runs (three rounds): several of a shared machine's scheduling slices."""
SMALLEST = 3
"""The smallest timed sizes (a few bytes): their median time is the per-kernel cost (dispatch, launch), priced apart
from the bytes (``MemoryRate.launch_seconds``)."""

MAX_SHAPES = 16
"""Distinct shapes timed at most (those with the most FLOPs in the step)."""


@dataclass(frozen=True, slots=True)
class MatmulMix:
    """The kernels a step runs, as calibration prices them: how many matmuls of each shape, in which dtype, and
    how many memory-bound kernels of each size (bytes read and written). Plain data: it travels to other processes
    where the graphs it was read from cannot (``calibrate(step=mix)``)."""

    shapes: Counter[MatmulShape]
    dtype: torch.dtype | None
    memory: Counter[int] = field(default_factory=Counter)
    """Bytes read + written -> how many of the step's memory-bound kernels move that many."""
    layouts: dict[MatmulShape, str] = field(default_factory=dict)
    """The operand layout each shape mostly runs in (``overlapcfg.cost.price.matmul_layout``): timed that way."""
    attention: Counter[AttentionShape] = field(default_factory=Counter)
    """How many attention calls of each shape (``overlapcfg.measuring.attention_timing``)."""
    attention_untimed: int = 0
    """Forward attention calls with no one shape to time at (``attention_census``): named in the profile's notes."""
    calls: Counter[KernelCall] = field(default_factory=Counter)
    """Every distinct kernel call of the step and how often it runs, in the order the graphs first run them
    (``overlapcfg.measuring.step_kernels``: timed in turn on a CPU)."""
    calls_unreplayable: int = 0
    """The step's kernel calls that cannot be replayed (``kernel_census``): counted in the profile's notes."""
    gathers: Counter[int] = field(default_factory=Counter)
    """Full-size bytes (``overlapcfg.cost.price.collective_bytes``) -> how many of the step's all-gathers gather
    that many: the rank-skew probe is one of them (``overlapcfg.measuring.skew.skew_unit``)."""


def matmul_mix(graphs: Sequence[fx.GraphModule]) -> MatmulMix:
    """How many times the graphs run each matmul shape (``overlapcfg.cost.price.matmul_shape``), their (first)
    dtype, the sizes of their memory-bound kernels (``overlapcfg.cost.price.node_kind``) and of their
    all-gathers."""
    shapes: Counter[MatmulShape] = Counter()
    memory: Counter[int] = Counter()
    layouts: dict[MatmulShape, Counter[str]] = {}
    gathers: Counter[int] = Counter()
    dtype = None
    for gm in graphs:
        for node in gm.graph.nodes:
            kind = node_kind(node)
            if kind == "memory":
                memory[node_bytes(node)] += 1
            elif kind == "collective" and collective_kind(node) == "all_gather":
                gathers[collective_bytes(node)] += 1
            shape = matmul_shape(node)
            if shape is None:
                continue
            shapes[shape] += 1
            layouts.setdefault(shape, Counter())[matmul_layout(node)] += 1
            first = node.all_input_nodes[0].meta.get("val") if node.all_input_nodes else None
            dtype = dtype or (first.dtype if isinstance(first, torch.Tensor) else None)
    attention, untimed = attention_census(graphs)
    calls, unreplayable = kernel_census(graphs)
    return MatmulMix(shapes, dtype, memory, {s: c.most_common(1)[0][0] for s, c in layouts.items()}, attention,
                     untimed, calls, unreplayable, gathers)


def _flops(shape: MatmulShape) -> int:
    batch, m, k, n = shape
    return 2 * batch * m * k * n


ANCHOR_SHAPES: tuple[MatmulShape, ...] = ((1, 16, 16, 16), (1, 64, 64, 64))
"""Tiny products timed besides the step's own: they pin the per-kernel cost the rate fit separates from the FLOPs
(``matmul_rate_fit``); not part of the step's mix."""


def chosen_shapes(shapes: Counter[MatmulShape]) -> list[MatmulShape]:
    """The shapes to time: the ``MAX_SHAPES`` with the most FLOPs in the step, in that order, then the
    ``ANCHOR_SHAPES`` the step does not run itself."""
    top = sorted(shapes, key=lambda s: (-_flops(s) * shapes[s], s))[:MAX_SHAPES]
    return top + [a for a in ANCHOR_SHAPES if a not in top]


def time_matmuls(chosen: Sequence[MatmulShape], dtype: torch.dtype, clock: Clock, *,
                 progress: Callable[[str, int], None] | None = None,
                 layouts: Mapping[MatmulShape, str] | None = None) -> list[float]:
    """Seconds per call of each shape, back to back, its factors laid out as the step reads them (``layouts``:
    ``nt`` reads ``b`` transposed; default ``nn``)."""
    seconds = []
    for shape in chosen:
        batch, m, k, n = shape
        layout = (layouts or {}).get(shape, "nn")
        a = torch.randn(batch, m, k, dtype=dtype, device=clock.device) if layout[0] == "n" else \
            torch.randn(batch, k, m, dtype=dtype, device=clock.device).transpose(1, 2)
        b = torch.randn(batch, k, n, dtype=dtype, device=clock.device) if layout[1] == "n" else \
            torch.randn(batch, n, k, dtype=dtype, device=clock.device).transpose(1, 2)
        op: Callable[[], object] = functools.partial(torch.bmm, a, b) if batch > 1 else \
            functools.partial(torch.mm, a[0], b[0])
        seconds.append(clock.per_call(op, min_seconds=KERNEL_SECONDS))
        if progress is not None:
            progress("matmuls", 1)
    return seconds


def matmul_samples(shapes: Counter[MatmulShape], chosen: Sequence[MatmulShape], seconds: Sequence[float],
                   dtype: torch.dtype) -> tuple[KernelSamples, MatmulRate, float]:
    """The timed shapes' record, the shape-aware rate model fitted to them (``matmul_rate_fit``) and the peak it is
    a share of. The record's ``rate`` is the step's mix (its FLOPs over its time, each shape weighted by how often the
    step runs it), ``overhead`` the fitted per-kernel cost, ``residual`` the model's."""
    work = [float(_flops(s)) for s in chosen]
    counted = sum(t * shapes[s] for t, s in zip(seconds, chosen, strict=True))
    rate = sum(w * shapes[s] for w, s in zip(work, chosen, strict=True)) / counted if counted > 0 else \
        max(w / t for w, t in zip(work, seconds, strict=True))
    peak, model, residual = matmul_rate_fit(chosen, seconds)
    names = tuple(f"{'' if s[0] == 1 else f'{s[0]} x '}{s[1]} x {s[2]} x {s[3]} (x{shapes[s]})" for s in chosen)
    what = (f"matmul {str(dtype).removeprefix('torch.')} (best {peak / 1e9:.4g} GFLOP/s; x {model.efficiency:.3g}, "
            f"half dim {model.half_dim:.4g}, {1e6 * model.launch_seconds:.3g} us a kernel)")
    return (KernelSamples(what=what, shapes=names, work=tuple(work), seconds=tuple(seconds), rate=rate,
                          overhead=model.launch_seconds, residual=residual), model, peak)


HALF_DIMS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0)
"""Half dimensions the matmul fit tries (``MatmulRate.half_dim``, one for m, n and k)."""


def matmul_rate_fit(chosen: Sequence[MatmulShape], seconds: Sequence[float]) -> tuple[float, MatmulRate, float]:
    """``(peak, model, residual)``: the best FLOP/s any timed shape reached, and the ``MatmulRate`` (share of that
    peak, half dimension, per-kernel cost) whose ``launch + FLOPs / (peak x share(shape))`` is closest to every timed
    shape in relative error (non-negative least squares per half dimension; the best of ``HALF_DIMS``)."""
    flops = [float(_flops(s)) for s in chosen]
    peak = max(f / t for f, t in zip(flops, seconds, strict=True))
    best: tuple[float, MatmulRate] | None = None
    for half in HALF_DIMS:
        probe = MatmulRate(efficiency=1.0, half_dim=half, half_k=half)
        design = [(1.0, f / (peak * probe.share(*s))) for f, s in zip(flops, chosen, strict=True)]
        fit = fit_nonnegative(design, seconds)
        launch, inverse = fit.coefficients
        efficiency = min(1.0, 1.0 / inverse) if inverse > 0 else 1.0
        model = MatmulRate(efficiency=efficiency, half_dim=half, half_k=half, launch_seconds=min(launch, 0.1))
        if best is None or fit.residual < best[0]:
            best = (fit.residual, model)
    assert best is not None  # HALF_DIMS is not empty
    return peak, best[1], best[0]


def memory_sizes(cache_bytes: int, cap: int) -> list[int]:
    """Bytes read + written by the timed ``a + b`` (fp32: 12 bytes an element), one per octave, up to
    ``4 * BEYOND_CACHE`` times the cache (so that ``MIN_BEYOND`` sizes lie beyond it) or ``cap``, whichever is
    smaller."""
    return log_sizes(12, max(2**20, min(cap, 4 * BEYOND_CACHE * cache_bytes)), per_octave=1, multiple=12)


def time_memory(sizes: Sequence[int], clock: Clock, *, progress: Callable[[str, int], None] | None = None,
                ) -> list[float]:
    """Seconds per call of ``out = a + b`` (fp32) moving each of ``sizes`` bytes."""
    seconds = []
    for nbytes in sizes:
        numel = nbytes // 12
        a, b, out = (torch.ones(numel, device=clock.device) for _ in range(3))
        seconds.append(clock.per_call(functools.partial(torch.add, a, b, out=out), min_seconds=KERNEL_SECONDS))
        if progress is not None:
            progress("memory", 1)
    return seconds


def beyond_cache(sizes: Sequence[int], cache_bytes: int) -> list[int]:
    """Indices of the sizes the bandwidth is fitted through: those at least ``BEYOND_CACHE`` times the cache, or
    the ``MIN_BEYOND`` largest where fewer are."""
    big = [i for i, n in enumerate(sizes) if n >= BEYOND_CACHE * cache_bytes]
    return big if len(big) >= MIN_BEYOND else list(range(max(0, len(sizes) - MIN_BEYOND), len(sizes)))


MEMORY_ATTEMPTS = 3
"""Times the sizes the bandwidth is fitted through are timed at most, until their times grow with size."""


def memory_grows(sizes: Sequence[int], seconds: Sequence[float], cache_bytes: int) -> bool:
    """Whether the line through the sizes beyond the cache (``beyond_cache``) rises: a bandwidth exists. Bytes moved
    take time, so a line that does not rise says the timings are wrong, not the memory: on a busy machine a rank
    that the scheduler pauses inside one size's rounds times that size several times too slow."""
    big = beyond_cache(sizes, cache_bytes)
    return fit_line([sizes[i] for i in big], [seconds[i] for i in big]).coefficients[1] > 0


def timed_until_growing(sizes: Sequence[int], cache_bytes: int, time: Callable[[Sequence[int]], list[float]],
                        attempts: int = MEMORY_ATTEMPTS) -> tuple[list[float], int]:
    """``(seconds, attempts used)``: ``time(sizes)``, then the sizes beyond the cache timed again (their new times
    replacing the old) while their times do not grow with size (``memory_grows``), at most ``attempts`` times in
    all. A pause of the process is what makes one size slower than a larger one; timing again is the remedy, where
    fitting through the pause would give a bandwidth that no step sees (or none). ``time`` must decide the same on
    every rank (calibration passes the slowest rank's times, the same everywhere), since each new timing is
    collective."""
    seconds = list(time(sizes))
    big = beyond_cache(sizes, cache_bytes)
    used = 1
    while used < attempts and not memory_grows(sizes, seconds, cache_bytes):
        for i, again in zip(big, time([sizes[i] for i in big]), strict=True):
            seconds[i] = again
        used += 1
    return seconds, used


def memory_samples(sizes: Sequence[int], seconds: Sequence[float], cache_bytes: int,
                   kernels: Counter[int] | None = None) -> KernelSamples:
    """The rate at ``kernels`` (the step's memory-bound kernel sizes, see the module docstring), or the memory's
    bandwidth without them: the slope of ``overhead + bytes / rate`` through the sizes beyond the cache
    (``beyond_cache``). The overhead is the intercept of the line through every size. The residual is the memory
    line's, or how far one rate is from each of the step's kernels' interpolated times."""
    big = beyond_cache(sizes, cache_bytes)
    fit = fit_line([sizes[i] for i in big], [seconds[i] for i in big])
    per_byte = fit.coefficients[1]
    if per_byte <= 0:
        timed = ", ".join(f"{sizes[i] / 2**20:.0f} MiB in {seconds[i] * 1e3:.3g} ms" for i in big)
        raise OverlapConfigError(
            f"calibrate: elementwise kernel times do not grow with size beyond the {cache_bytes / 2**20:.0f} MiB "
            f"cache ({timed}; timed {MEMORY_ATTEMPTS} times): the machine was too busy to time its memory; "
            "calibrate again when fewer jobs share it")
    overhead = statistics.median(seconds[:SMALLEST]) if len(seconds) >= SMALLEST else \
        fit_line(sizes, seconds).coefficients[0]
    within = sizes[big[0]] < 2 * cache_bytes
    where = (f"memory {1 / per_byte / 1e9:.3g} GB/s from {len(big)} sizes >= {sizes[big[0]] / 2**20:.0f} MiB" +
             (f", within 2x the {cache_bytes / 2**20:.0f} MiB cache: may time the cache" if within else
              f", beyond {sizes[big[0]] / cache_bytes:.0f}x the {cache_bytes / 2**20:.0f} MiB cache"))
    rate, residual = 1.0 / per_byte, fit.residual
    if kernels:
        def t(nbytes: int) -> float:
            if nbytes >= sizes[-1]:
                return seconds[-1] + (nbytes - sizes[-1]) * per_byte
            i = max(0, bisect.bisect_right(sizes, nbytes) - 1)
            w = (nbytes - sizes[i]) / (sizes[i + 1] - sizes[i])
            return seconds[i] + max(0.0, w) * (seconds[i + 1] - seconds[i])

        whole = {n: t(n) for n in kernels}
        moving = sum(max(whole[n] - overhead, 0.0) * c for n, c in kernels.items())  # the per-kernel cost apart
        rate = sum(n * c for n, c in kernels.items()) / moving if moving > 0 else 1.0 / per_byte
        errors = [((overhead + n / rate - whole[n]) / whole[n], c) for n, c in kernels.items()]
        residual = math.sqrt(sum(e * e * c for e, c in errors) / sum(c for _, c in errors))
        where = f"at the step's {sum(kernels.values())} memory-bound kernels; {where}"
    return KernelSamples(what=f"memory (a + b, float32; {where})", shapes=tuple(f"{n} B" for n in sizes),
                         work=tuple(float(n) for n in sizes), seconds=tuple(seconds), rate=rate,
                         overhead=overhead, residual=residual)


def time_views(clock: Clock) -> float:
    """Seconds one view op takes to dispatch (``aten.view`` of a small tensor, as a graph module calls it): what an
    eager host pays per view and reshape (``MemoryRate.view_seconds``)."""
    x = torch.ones(4, 4, device=clock.device)
    view = torch.ops.aten.view.default
    return clock.per_call(functools.partial(view, x, [16]), min_seconds=KERNEL_SECONDS)


def default_shapes(clock: Clock) -> Counter[MatmulShape]:
    """Square matmuls standing in for a model's when none is given: sizes a step of that device would run."""
    sides = (2048, 4096, 8192) if clock.cuda else (256, 512, 1024)
    return Counter({(1, s, s, s): 1 for s in sides})

"""Achievable rates: what a device's kernels reach, as opposed to its datasheet peaks (the profile's
``achievable`` section), and the pure formulas that read them.

A datasheet peak is a ceiling no training step reaches: a large square bf16 GEMM gets 75-80 % of it on an H100 for
a short burst and less once the chip sits at its power limit; a skinny or small GEMM far less; attention kernels
30-75 % depending on the backend; an elementwise kernel about 90 % of the memory bandwidth. The cost model prices
each kernel at the rate *its kind and shape* reach:

- **matmuls** (``MatmulRate``): ``efficiency x sustained x waves x sat(m) sat(n) sat(k)`` of the dtype's peak.
  ``efficiency`` is the best-shape burst rate over peak (a published maximum-achievable-matmul figure, or a
  calibration's), ``sustained`` the share of that the chip holds at its power limit (training is one long saturated
  run), ``sat(x) = x / (x + half)`` the loss of a small or skinny dimension (``half_dim`` for m and n: a
  64-wide matmul cannot fill the tiles a 4096-wide one does; ``half_k`` for k: each output tile pays a pipeline
  fill and an epilogue whatever its k), and ``waves`` the wave and tile quantization of ``tile``-sized output tiles
  over ``units`` compute units (NVIDIA's "Matrix Multiplication Background" guide: 133 tiles on 132 SMs take two
  waves; a dimension that is not a multiple of the tile pays for the whole last tile). A kernel also pays
  ``launch_seconds``.
- **attention** (``AttentionRates``): per backend (flash, cuDNN, memory-efficient, math), the measured share of peak
  at points of sequence length and head dimension (a paper's benchmark table), interpolated in log sequence
  length, the nearest head dimension; forward and backward apart, causal apart where measured.
- **memory-bound kernels** (``MemoryRate``): the achievable share of the memory bandwidth (lower for a kernel that
  reduces, a norm or a softmax, than for a pointwise one), a launch cost per kernel and, for eager host-driven
  execution, a dispatch cost per view (a CPU's interpreter pays it; a GPU's views launch nothing).

``overlapcfg.cost.price`` applies them; the collectives' achievable rates are the profile's ``collectives`` fits
(``overlapcfg.cost.measured_fits.CollectiveFit``), whether calibrated or published; the rank skew is the profile's
``skew`` (``Skew``, and ``expected_max_normal``). Every number in a shipped profile says where it comes from in a
comment next to it. Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr
from pydantic_core import PydanticCustomError

from overlapcfg.config.base import ConfigModel, measured
from overlapcfg.errors import show_value

__all__ = ["Achievable", "AttentionPoint", "AttentionRates", "Fraction", "MatmulRate", "MatmulRates", "MemoryRate",
           "Skew", "TimedMatmul", "WakePoint", "expected_max_normal"]


def _fraction(value: Any) -> float:
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if isinstance(value, str) and len(value) <= 64:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
    if not (math.isfinite(number) and 0 < number <= 1):
        raise PydanticCustomError("fraction", "expected a fraction of the peak in (0, 1], got {got}",
                                  {"got": show_value(value)})
    return float(number)


Fraction = Annotated[float, BeforeValidator(_fraction)]
"""A share of a datasheet peak reached in practice: above 0, at most 1 (a kernel faster than the peak is a unit
mix-up, and 0 would price every kernel at infinity)."""
KernelSeconds = Annotated[float, measured("seconds", 0.0, 60.0, example="0 to 60 s")]
"""A fixed cost per kernel or per view, or one kernel's time: 0 up to a minute."""
Elements = Annotated[float, measured("elements", 0.0, 1e7, example="0 to 10 million")]


class TimedMatmul(ConfigModel):
    """One matmul a calibration timed on this machine, with the operand layout the step runs it in."""

    shape: tuple[int, int, int, int]
    """``(batch, m, k, n)``."""
    layout: Literal["nn", "nt", "tn", "tt"]
    """Whether each factor is read transposed (column-major): ``nt`` = ``a @ b`` with ``b`` a transposed view."""
    seconds: KernelSeconds
    """Per call, launch included."""


class MatmulRate(ConfigModel):
    """A GEMM's share of the dtype's peak by its shape (see the module docstring)."""

    efficiency: Fraction
    """Burst rate at the best shape over the peak (maximum achievable matmul FLOPS / datasheet)."""
    sustained: Fraction = 1.0
    """Share of the burst rate held at the power limit through a long run (1.0: as measured, e.g. a calibration
    that timed the kernels back to back)."""
    half_dim: Elements = 0.0
    """An m or n of this many elements halves the rate: ``sat(x) = x / (x + half_dim)``; 0: no loss (a GPU, whose
    small m and n are the waves' and tiles' business)."""
    half_k: Elements = 0.0
    """A k of this many elements halves the rate (each tile's pipeline fill and epilogue); 0: no loss."""
    tile: tuple[int, int] | None = None
    """Output tile ``(m, n)`` of a typical kernel, for wave quantization; null: none (a CPU)."""
    units: int | None = Field(None, ge=1)
    """Compute units tiles run on at once (SMs); with ``tile``, a GEMM takes ``ceil(tiles / units)`` waves."""
    launch_seconds: KernelSeconds = 0.0
    """Fixed cost per matmul kernel (launch, host dispatch)."""
    timed: tuple[TimedMatmul, ...] = ()
    """Kernels a calibration timed at the step's own shapes and layouts: priced as timed (a CPU's GEMM can differ
    fourfold between layouts of one shape), the model above for every other."""

    _by_shape: dict[tuple[tuple[int, int, int, int], str], float] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        self._by_shape = {(t.shape, t.layout): t.seconds for t in self.timed}

    def timed_seconds(self, shape: tuple[int, int, int, int], layout: str) -> float | None:
        """The timed seconds of ``shape`` in ``layout``, if calibration timed exactly that kernel."""
        return self._by_shape.get((shape, layout))

    def share(self, batch: int, m: int, k: int, n: int) -> float:
        """The share of the peak a ``batch x (m x k) @ (k x n)`` product reaches."""
        share = self.efficiency * self.sustained
        if self.half_dim > 0:
            share *= m / (m + self.half_dim) * n / (n + self.half_dim)
        if self.half_k > 0:
            share *= k / (k + self.half_k)
        if self.tile is not None and self.units is not None:
            share *= wave_share(batch, m, n, self.tile, self.units)
        return max(share, 1e-6)


@functools.lru_cache(maxsize=4096)
def wave_share(batch: int, m: int, n: int, tile: tuple[int, int], units: int) -> float:
    """Useful work over work done when ``batch x ceil(m / tm) x ceil(n / tn)`` tiles run in waves of ``units``:
    a partial last wave, and partial tiles at the edges, cost as much as full ones."""
    tm, tn = tile
    tiles = max(1, batch) * math.ceil(max(m, 1) / tm) * math.ceil(max(n, 1) / tn)
    waves = math.ceil(tiles / units)
    edges = (max(m, 1) * max(n, 1)) / (math.ceil(max(m, 1) / tm) * tm * math.ceil(max(n, 1) / tn) * tn)
    return tiles / (waves * units) * edges


class MatmulRates(ConfigModel):
    """Matmul rates per dtype, as ``PeakFlops`` gives peaks: bf16 (fp16 alike) and fp32."""

    bf16: MatmulRate
    fp32: MatmulRate

    def for_dtype(self, dtype_name: str) -> MatmulRate:
        return self.bf16 if dtype_name in ("bfloat16", "float16", "bf16", "fp16") else self.fp32


class AttentionPoint(ConfigModel):
    """One measured point of an attention kernel: its share of the bf16 peak, counting FLOPs as the FlashAttention
    papers do (a causal call does half the work of a full one)."""

    seq_len: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    forward: Fraction
    backward: Fraction
    forward_causal: Fraction | None = None
    """Where measured apart; null: ``forward``."""
    backward_causal: Fraction | None = None
    """Where measured apart; null: ``backward``."""


class AttentionRates(ConfigModel):
    """Attention kernels per backend: ``backend`` is the one SDPA picks by default on this device."""

    backend: str
    """The backend a prediction prices unless told another (``Pricing.attention_backend``)."""
    backends: dict[str, tuple[AttentionPoint, ...]]
    """Measured points per backend name (``flash``, ``cudnn``, ``efficient``, ``math``)."""
    sustained: Fraction = 1.0
    """Share of the measured (burst) rates held at the power limit, as ``MatmulRate.sustained``."""
    launch_seconds: KernelSeconds = 0.0
    """Fixed cost per attention kernel."""

    def share(self, backend: str, seq_len: int, head_dim: int, *, backward: bool, causal: bool) -> float:
        """The share of the peak one call reaches: the nearest measured head dimension, interpolated linearly in
        log sequence length between measured lengths (held flat beyond them)."""
        points = self.backends[backend]
        dims = sorted({p.head_dim for p in points})
        dim = min(dims, key=lambda d: (abs(math.log(d) - math.log(max(head_dim, 1))), d))
        row = sorted((p for p in points if p.head_dim == dim), key=lambda p: p.seq_len)

        def value(p: AttentionPoint) -> float:
            if backward:
                return p.backward_causal if causal and p.backward_causal is not None else p.backward
            return p.forward_causal if causal and p.forward_causal is not None else p.forward

        lengths = [p.seq_len for p in row]
        i = bisect.bisect_left(lengths, seq_len)
        if i == 0:
            share = value(row[0])
        elif i == len(row):
            share = value(row[-1])
        else:
            lo, hi = row[i - 1], row[i]
            w = (math.log(seq_len) - math.log(lo.seq_len)) / (math.log(hi.seq_len) - math.log(lo.seq_len))
            share = value(lo) + w * (value(hi) - value(lo))
        return share * self.sustained


class MemoryRate(ConfigModel):
    """Bandwidth-bound kernels: the achievable share of ``mem_bandwidth`` and fixed costs."""

    efficiency: Fraction
    """Achieved over datasheet memory bandwidth for a streaming kernel (read + write)."""
    reduction_efficiency: Fraction | None = None
    """The same for a kernel that reduces (a norm, a softmax, a sum): generated reductions reach less of the
    bandwidth than a copy; null: ``efficiency``."""
    launch_seconds: KernelSeconds = 0.0
    """Fixed cost per kernel."""
    view_seconds: KernelSeconds = 0.0
    """Fixed cost per view or reshape a host runs eagerly (the dispatch of an op that moves no data); 0 on a GPU,
    whose views launch nothing."""


class Achievable(ConfigModel):
    """What a device's kernels reach (see the module docstring). A profile without it prices every kernel at
    its peaks (the pure roofline)."""

    matmul: MatmulRates
    memory: MemoryRate
    attention: AttentionRates | None = None
    """Fused attention per backend; null: attention's matmuls at the matmul rates."""


Relative = Annotated[float, measured("seconds of skew per second of compute", 0.0, 1.0, example="0 to 1")]
SkewSeconds = Annotated[float, measured("seconds", 0.0, 1.0, example="up to 1 s")]
Diffusion = Annotated[float, measured("seconds^2 of arrival variance per second of compute", 0.0, 1.0,
                                      example="0 to 1")]


IdleSeconds = Annotated[float, measured("seconds", 0.0, 3600.0, example="up to an hour")]


class WakePoint(ConfigModel):
    """One measured point of a collective's wake-up cost: started on a link idle for ``idle`` seconds, the
    collective took ``extra`` seconds longer than one started right after another collective."""

    idle: IdleSeconds
    extra: SkewSeconds


def _ascending_idle(points: tuple[WakePoint, ...]) -> tuple[WakePoint, ...]:
    idles = [p.idle for p in points]
    if any(b <= a for a, b in itertools.pairwise(idles)):
        raise PydanticCustomError("wake_order", "expected points in strictly increasing idle seconds, got {got}",
                                  {"got": ", ".join(f"{i:g}" for i in idles)})
    return points


class Skew(ConfigModel):
    """How far apart ranks arrive at a collective: the standard deviation of one rank's arrival, ``sqrt(absolute^2
    + diffusion x T + (relative x T)^2)`` after ``T`` seconds of compute since the ranks last synchronized (a
    blocking wait).

    A collective starts when its last rank arrives: a rank waits ``expected_max_normal(p) x`` that for the last of
    ``p`` (``overlapcfg.cost.replay``). ``relative``: ranks computing at persistently different speeds (a GPU's
    silicon and cooling), which grows with ``T``; ``diffusion``: independent hiccups (a shared CPU's scheduler
    handing out time slices), whose sum grows with ``sqrt(T)``; ``absolute``: jitter whatever the compute (the
    operating system, launches).

    ``wake``: what a collective costs beyond its fit when its link has been idle a while, the same on every rank
    (so not skew, but measured alongside it: the last rank's own wait). On a CPU, gloo's threads sleep between
    collectives and a collective after a stretch of compute first wakes them: on 2 gloo ranks of a 2-core machine
    a one-number all-reduce took 117 us right after another collective and 209-363 us after 2-95 ms of compute.
    Empty on a GPU profile unless measured."""

    relative: Relative
    absolute: SkewSeconds = 0.0
    diffusion: Diffusion = 0.0
    wake: Annotated[tuple[WakePoint, ...], AfterValidator(_ascending_idle)] = ()
    """Measured points, linear between them, flat beyond the last and 0 before the first."""

    def sigma(self, seconds: float) -> float:
        """Standard deviation of a rank's arrival after ``seconds`` of compute since the last synchronization."""
        t = max(seconds, 0.0)
        return math.sqrt(self.absolute * self.absolute + self.diffusion * t + (self.relative * t) ** 2)

    def wait(self, seconds: float, ranks: int) -> float:
        """Expected seconds a rank waits for the last of ``ranks`` to arrive (0 for one rank)."""
        return expected_max_normal(ranks) * self.sigma(seconds) if ranks > 1 else 0.0

    def wake_seconds(self, idle: float) -> float:
        """Extra seconds of a collective starting on a link idle for ``idle`` seconds (``wake``)."""
        points = self.wake
        if not points or idle <= points[0].idle:
            return 0.0 if not points or idle < points[0].idle else points[0].extra
        for lo, hi in itertools.pairwise(points):
            if idle <= hi.idle:
                return lo.extra + (idle - lo.idle) / (hi.idle - lo.idle) * (hi.extra - lo.extra)
        return points[-1].extra


@functools.lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0.5642 for 2, 1.4236 for 8, 2.3437 for 64, 3.0439 for 512):
    ``integral x n phi(x) Phi(x)^(n-1) dx``, by the trapezoid rule over [-10, 10] (exact to 1e-6)."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 8000, -10.0, 10.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        term = x * n * pdf * cdf ** (n - 1)
        total += term * (0.5 if i in (0, steps) else 1.0)
    return total * h

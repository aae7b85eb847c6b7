"""Time the step's own attention calls, and turn the timings into the profile's achievable attention rates.

The cost model prices each ``scaled_dot_product_attention`` call as one fused kernel at a share of the matmul peak
(``overlapcfg.cost.attention``, ``overlapcfg.cost.achievable.AttentionRates``). Without a measured share it uses the
matmul rate itself, which is far from what fused attention reaches where its shapes are small: on this project's
2-core CPU, the demo step's 4 calls (8 x 4 heads, 128 tokens, head dim 16) measured 14-18 ms forward and backward
together inside the step, against 5.2 ms priced at the matmul rate.

So calibration runs SDPA at each of the step's call shapes (``AttentionShape``: batch x heads, query length, head
dimension, causal), forward and forward + backward, on the device with its default backend, and records each
call's share of the calibrated matmul peak, counting FLOPs as the cost model does: ``4 x batch_heads x seq^2 x
head_dim`` for the forward, half of it for a causal call, and ``2.5x`` the forward for the backward (five matmuls).
The backend is read from which SDPA operator ran (``compat.dispatched_ops``), never assumed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.cost.achievable import AttentionPoint, AttentionRates
from overlapcfg.cost.attention import FusedAttention, attention_plan, kept_attention
from overlapcfg.cost.hardware import PeakFlops
from overlapcfg.measuring.clock import Clock

__all__ = ["AttentionShape", "AttentionTiming", "attention_census", "attention_rates", "attention_shapes",
           "attention_work", "share_peak", "time_attention"]

AttentionShape = tuple[int, int, int, bool]
"""``(batch x heads, query length, head dimension, causal)`` of one call (keys and queries of the same length)."""

AttentionTiming = tuple[float, float]
"""Seconds of one call's forward and of its backward."""

_SDPA = torch.nn.functional.scaled_dot_product_attention
KERNEL_SECONDS = 0.02
"""How long each timing round runs (``Clock.per_call``)."""

_BACKENDS = (("cudnn", "cudnn"), ("efficient", "efficient"), ("flash", "flash"))
"""Substrings of the SDPA operator that ran -> the backend's name in ``AttentionRates.backends``."""


def _shape_of(fused: FusedAttention) -> AttentionShape | None:
    """A forward call's shape from its FLOPs (``4 x batch_heads x seq^2 x head_dim``, as
    ``overlapcfg.cost.attention`` counts them): None where they do not divide into one."""
    if fused.backward or fused.seq_len < 1 or fused.head_dim < 1:
        return None
    per_head = 4 * fused.seq_len * fused.seq_len * fused.head_dim
    batch_heads, rest = divmod(fused.flops, per_head)
    return (batch_heads, fused.seq_len, fused.head_dim, fused.causal) if batch_heads >= 1 and not rest else None


def attention_census(graphs: Sequence[fx.GraphModule]) -> tuple[Counter[AttentionShape], int]:
    """How many forward attention calls of each shape the graphs run (decomposed or already fused), and how many
    forward calls have no one shape to time at (their FLOPs do not divide into ``batch x heads``: queries and keys
    of different lengths), which calibration names in the profile's notes rather than dropping in silence."""
    shapes: Counter[AttentionShape] = Counter()
    untimed = 0
    plan = attention_plan(graphs)
    for gi, gm in enumerate(graphs):
        for node in gm.graph.nodes:
            role = plan.role(gi, node)  # a decomposed call's carrier; else a fused operator, by its schema
            fused = role if isinstance(role, FusedAttention) else kept_attention(node) if node.op == "call_function" \
                else None
            if fused is None or fused.backward:
                continue
            shape = _shape_of(fused)
            if shape is None:
                untimed += 1
            else:
                shapes[shape] += 1
    return shapes, untimed


def attention_shapes(graphs: Sequence[fx.GraphModule]) -> Counter[AttentionShape]:
    """How many forward attention calls of each shape the graphs run (``attention_census``'s first half)."""
    return attention_census(graphs)[0]


def attention_work(shape: AttentionShape, *, backward: bool) -> float:
    """FLOPs the cost model counts for one call (see the module docstring)."""
    batch_heads, seq, dim, causal = shape
    work = 4.0 * batch_heads * seq * seq * dim * (2.5 if backward else 1.0)
    return work / 2 if causal else work


def _backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """The backend SDPA dispatches to here, from the operator that ran."""
    with torch.no_grad():
        names = compat.dispatched_ops(lambda: _SDPA(q, k, v, is_causal=causal))
    for name in names:
        if "scaled_dot_product" in name:
            for part, backend in _BACKENDS:
                if part in name:
                    return backend
    return "math"


def time_attention(shapes: Sequence[AttentionShape], dtype: torch.dtype, clock: Clock,
                   ) -> tuple[str, list[AttentionTiming]]:
    """The backend SDPA uses on ``clock``'s device and, per shape, the seconds of a forward and of a backward (the
    forward + backward run less the forward), each call allocating its outputs as a step's do."""
    backend = "math"
    out: list[AttentionTiming] = []
    for batch_heads, seq, dim, causal in shapes:
        q, k, v = (torch.randn(1, batch_heads, seq, dim, dtype=dtype, device=clock.device, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, batch_heads, seq, dim, dtype=dtype, device=clock.device)

        def forward(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, causal: bool = causal) -> None:
            with torch.no_grad():
                _SDPA(q, k, v, is_causal=causal)

        def both(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, causal: bool = causal,
                 grad: torch.Tensor = grad) -> None:
            torch.autograd.grad(_SDPA(q, k, v, is_causal=causal), (q, k, v), grad)

        backend = _backend(q, k, v, causal)
        fwd = clock.per_call(forward, min_seconds=KERNEL_SECONDS)
        total = clock.per_call(both, min_seconds=KERNEL_SECONDS)
        out.append((fwd, max(total - fwd, fwd * 1e-3)))
    return backend, out


def share_peak(peak: PeakFlops, dtype: torch.dtype) -> float:
    """The peak a share timed in ``dtype`` is taken of: the one pricing multiplies it by
    (``HardwareProfile.flops_for``, where fp16 is costed as bf16)."""
    return peak.bf16 if dtype in (torch.bfloat16, torch.float16) else peak.fp32


def attention_rates(backend: str, shapes: Sequence[AttentionShape], timings: Sequence[AttentionTiming],
                    peak: float) -> AttentionRates | None:
    """The measured shares of ``peak`` (FLOP/s) as ``AttentionRates`` with one backend: per (query length, head
    dimension), the forward and backward shares, apart for causal and full calls where both were timed (a causal
    call only: its shares stand for both). Shares above 1 (attention faster than the best matmul timed) are
    held at 1. None without timings."""
    if not shapes or peak <= 0:
        return None
    found: dict[tuple[int, int], dict[bool, tuple[float, float]]] = {}
    for shape, (fwd, bwd) in zip(shapes, timings, strict=True):
        shares = tuple(min(1.0, max(1e-6, attention_work(shape, backward=b) / (t * peak)))
                       for b, t in ((False, fwd), (True, bwd)))
        found.setdefault((shape[1], shape[2]), {})[shape[3]] = (shares[0], shares[1])
    points = []
    for (seq, dim), by_causal in sorted(found.items()):
        full = by_causal.get(False, by_causal.get(True))
        causal = by_causal.get(True)
        assert full is not None  # at least one of the two was timed
        points.append(AttentionPoint(seq_len=seq, head_dim=dim, forward=full[0], backward=full[1],
                                     forward_causal=causal[0] if causal else None,
                                     backward_causal=causal[1] if causal else None))
    return AttentionRates(backend=backend, backends={backend: tuple(points)})

"""A small Llama-style transformer whose module FQNs match torchtitan's Llama 3, so plans written for one work for
the other (``tok_embeddings``, ``layers.N.attention.wq``, ``layers.N.feed_forward.w1``, ``norm``, ``output``).

Deliberately left out: rotary embeddings and KV caches. Neither owns a parameter, so neither changes which FSDP
collectives exist or who owns them, and plain causal SDPA traces into a short, clean graph. ``n_kv_heads`` is kept
so a Llama-3-8B-shaped model (grouped-query attention: ``wk``/``wv`` are 4x smaller) has the real parameter sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from overlapcfg.errors import OverlapConfigError

__all__ = [
    "LLAMA3_8B",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "TransformerBlock",
    "cross_entropy_loss",
]


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Sizes of the demo model. Defaults are tiny so a 2-layer model traces in about a second."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 128
    max_seq_len: int = 64
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``n_heads`` (plain multi-head attention)."""
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise OverlapConfigError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise OverlapConfigError(f"LlamaConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise OverlapConfigError(
                f"LlamaConfig.n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads


LLAMA3_8B = LlamaConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=8192
)
"""Llama 3 8B parameter shapes; build it on ``device="meta"`` (16 GB of weights otherwise)."""


class Attention(nn.Module):
    """Causal self-attention through SDPA (no rotary embeddings, see the module docstring).

    Head counts are read from the projections' outputs (``view(..., -1, head_dim)``), not from the config: under
    tensor parallelism (``overlapcfg.demo.parallel``) ``wq``/``wk``/``wv`` return this rank's heads only.
    """

    def __init__(self, cfg: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, device=device)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False, device=device)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False, device=device)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.n_heads:
            repeat = self.n_heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False, device=device)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False, device=device)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention then SwiGLU, each with an RMSNorm and a residual."""

    def __init__(self, cfg: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        self.attention = Attention(cfg, device)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        self.feed_forward = FeedForward(cfg, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = _pre_norm_residual(x, self.attention_norm, self.attention)
        return _pre_norm_residual(attended, self.ffn_norm, self.feed_forward)


def _pre_norm_residual(x: torch.Tensor, norm: nn.Module, sublayer: nn.Module) -> torch.Tensor:
    """The pre-norm residual of Llama-style blocks: the sublayer sees the normalized input, its output is added to
    the input unnormalized."""
    return x + sublayer(norm(x))


def _embedding(vocab_size: int, dim: int, device: torch.device | str | None) -> nn.Embedding:
    """``nn.Embedding(vocab_size, dim, device=device)``; on the meta device without its random init.

    An embedding initializes itself with ``normal_``, whose meta kernel is a Python reference that imports
    ``torch._dynamo`` on its first call (about a CPU second), in a process that only wanted module names: the command
    resolves a plan against a meta model before it traces, so that a typo in a pattern is an error at once. A meta
    tensor holds no values, so skipping that init changes nothing but the time. Off the meta device the embedding is
    built as usual (its init draws from the global RNG, which callers may rely on).
    """
    if device is not None and torch.device(device).type == "meta":
        return nn.Embedding.from_pretrained(torch.empty((vocab_size, dim), device=device), freeze=False)
    return nn.Embedding(vocab_size, dim, device=device)


class Llama(nn.Module):
    """Token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``.

    ``layers`` is an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (as in torchtitan) so FQNs are ``layers.0`` and
    a layer can be removed without renumbering the others. On ``device="meta"`` nothing is initialized.
    """

    def __init__(self, config: LlamaConfig | None = None, *, device: torch.device | str | None = None,
                 seed: int = 0) -> None:
        super().__init__()
        self.config = cfg = config if config is not None else LlamaConfig()
        self.tok_embeddings = _embedding(cfg.vocab_size, cfg.dim, device)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, device) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)
        self.init_weights(seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Seeded init independent of the global RNG: same seed, same weights, in any process.

        Draws on CPU in ``named_parameters`` order and copies, so the values do not depend on the device.
        Norm weights are ones; everything else is N(0, 0.02). A no-op for meta tensors.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if param.is_meta:
                continue
            if name.endswith("norm.weight"):
                values = torch.ones(param.shape, dtype=param.dtype)
            else:
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(param.dtype)
            param.copy_(values)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all positions (targets are given, not shifted here)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

"""The demo Llama on the meta device runs no random init: an embedding's ``normal_`` on meta tensors is a Python
reference that imports ``torch._dynamo`` (seconds) in a process that only wanted module names, as the command's
plan check before tracing does (``overlapcfg.demo.job.check_plan``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapcfg.demo import LlamaConfig
from overlapcfg.demo.llama import Llama


def test_a_meta_llama_draws_no_init_and_has_the_real_models_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = LlamaConfig(n_layers=2)
    real = {name: (p.shape, p.dtype, p.requires_grad) for name, p in Llama(cfg).named_parameters()}

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a meta model was initialized with normal_")

    monkeypatch.setattr(nn.init, "normal_", refuse)
    model = Llama(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert {name: (p.shape, p.dtype, p.requires_grad) for name, p in model.named_parameters()} == real
    assert isinstance(model.tok_embeddings, nn.Embedding) and model.tok_embeddings.padding_idx is None
    assert torch.device("meta") == model.tok_embeddings.weight.device

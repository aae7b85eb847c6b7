"""Fixtures of the diagnosis tests: the committed traces (``fixtures/``) and copies to break."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def gpu_traces(tmp_path: Path) -> Path:
    """A copy of the synthetic CUDA/NCCL traces of two ranks (``fixtures/make_gpu_trace.py``)."""
    out = tmp_path / "gpu"
    shutil.copytree(FIXTURES / "gpu_fsdp2", out)
    return out


@pytest.fixture(scope="module")
def cpu_fixtures() -> Path:
    """Real gloo traces of 2 ranks, 2 profiled steps, a 1-layer Hugging Face Llama (``fixtures/README.md``)."""
    return FIXTURES

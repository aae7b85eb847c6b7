"""The demo Llama and SimpleFSDP sharding: names, shapes, seeding, meta construction, and numerical parity of the
sharded model with the unsharded one on two real gloo ranks."""

from __future__ import annotations

import os
import resource

import pytest
import torch

from overlapcfg.capture import gather_full_grads, shard_module, sharded_parameters
from overlapcfg.compat import fake_process_group
from overlapcfg.demo import LLAMA3_8B, Llama, LlamaConfig
from overlapcfg.demo.gloo import RankFailedError, run_on_gloo
from overlapcfg.demo.tracing import compile_with_pass, demo_batch, train_step
from overlapcfg.errors import OverlapConfigError
from overlapcfg.module_paths import user_fqn
from tests.support.rank_warmup import preloaded

SMALL = LlamaConfig()


def test_llama_module_fqns_follow_torchtitan_names() -> None:
    names = [n for n, _ in Llama(SMALL).named_modules() if n]
    assert names[:4] == ["tok_embeddings", "layers", "layers.0", "layers.0.attention_norm"]
    assert "layers.1.attention.wq" in names and "layers.1.feed_forward.w3" in names
    assert names[-2:] == ["norm", "output"]
    assert {n.rsplit(".", 1)[-1] for n in names if n.startswith("layers.0.")} == {
        "attention_norm", "attention", "wq", "wk", "wv", "wo", "ffn_norm", "feed_forward", "w1", "w2", "w3",
    }


def test_same_seed_gives_same_weights_and_another_seed_does_not() -> None:
    a, b, c = Llama(SMALL, seed=3), Llama(SMALL, seed=3), Llama(SMALL, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_meta_device_builds_llama3_8b_shapes_without_memory() -> None:
    model = Llama(LLAMA3_8B, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.layers["0"].attention.wk.weight.shape == (1024, 4096)  # grouped-query attention
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_config_rejects_heads_that_do_not_divide_dim() -> None:
    with pytest.raises(ValueError, match="dim=64 is not divisible by n_heads=5"):
        LlamaConfig(n_heads=5)


def test_shard_module_keeps_chunk_rank_of_dim0() -> None:
    full = Llama(SMALL, seed=1)
    sharded = shard_module(Llama(SMALL, seed=1), world_size=2, rank=1)
    shards = dict(sharded_parameters(sharded))
    assert list(shards) == [n for n, _ in full.named_parameters()]
    for name, param in full.named_parameters():
        assert torch.equal(shards[name], param.detach().chunk(2)[1]), name


def test_sharded_parameter_fqns_are_parametrization_originals() -> None:
    sharded = shard_module(Llama(SMALL), world_size=2, rank=0)
    raw = [n for n, _ in sharded.named_parameters()]
    assert raw[0] == "tok_embeddings.parametrizations.weight.original"
    assert user_fqn(raw[0]) == "tok_embeddings.weight"
    assert user_fqn("layers.0.attention.wq.parametrizations.weight.0") == "layers.0.attention.wq"
    assert user_fqn("_orig_mod.layers.0._checkpoint_wrapped_module.ffn_norm") == "layers.0.ffn_norm"


def test_sharded_model_runs_eagerly_under_fake_group_with_full_shapes() -> None:
    sharded = shard_module(Llama(SMALL), world_size=4, rank=3)
    assert sharded.output.parametrizations.weight.original.shape == (SMALL.vocab_size // 4, SMALL.dim)
    tokens, _ = demo_batch(SMALL.vocab_size, batch=2, seq_len=8)
    with fake_process_group(world_size=4, rank=3):
        assert (sharded.output.weight + 0).shape == (SMALL.vocab_size, SMALL.dim)  # "+ 0" waits on the gather
        assert sharded(tokens).shape == (2, 8, SMALL.vocab_size)


def test_shard_module_works_on_meta_tensors() -> None:
    sharded = shard_module(Llama(LLAMA3_8B, device="meta"), world_size=8, rank=0)
    assert sharded.tok_embeddings.parametrizations.weight.original.shape == (128256 // 8, 4096)


def test_shard_module_lists_every_parameter_not_divisible_by_world_size() -> None:
    with pytest.raises(OverlapConfigError) as err:
        shard_module(Llama(LlamaConfig(vocab_size=255)), world_size=2, rank=0)
    assert [f.path for f in err.value.faults] == ["tok_embeddings.weight", "output.weight"]
    assert "dim 0 has size 255, not divisible by world_size=2" in str(err.value)


def test_shard_module_refuses_to_shard_twice() -> None:
    sharded = shard_module(Llama(SMALL), world_size=2, rank=0)
    with pytest.raises(RuntimeError, match="already sharded"):
        shard_module(sharded, world_size=2, rank=0)


# --- two real gloo ranks ---------------------------------------------------------------------------------------

def _parity_worker(rank: int, world_size: int, config: LlamaConfig) -> dict[str, object]:
    """Each rank: the unsharded model on its own batch (the reference), then the sharded model eagerly (with and
    without reshard-after-forward) and compiled through ``compile_with_pass`` on the same batch."""
    tokens, targets = demo_batch(config.vocab_size, seed=100 + rank)
    ref_loss, ref_grads = train_step(Llama(config, seed=0), tokens, targets)
    out: dict[str, object] = {"ref_loss": ref_loss, "ref_grads": ref_grads}
    for reshard in (False, True):
        model = shard_module(Llama(config, seed=0), world_size=world_size, rank=rank,
                             reshard_after_forward=reshard)
        out[f"loss_{reshard}"], _ = train_step(model, tokens, targets)
        out[f"grads_{reshard}"] = gather_full_grads(model)
    model = shard_module(Llama(config, seed=0), world_size=world_size, rank=rank)
    out["compiled_loss"], _ = train_step(compile_with_pass(model), tokens, targets)
    out["compiled_grads"] = gather_full_grads(model)
    return out


def _failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")


def _exit_without_reporting(rank: int, world_size: int, code: int) -> None:
    """A rank that dies without a Python exception (as a segfault or an OOM kill would): ``os._exit``."""
    os._exit(code)


def _abort_in_native_code(rank: int, world_size: int) -> None:
    """glibc's reaction to a corrupted heap (``malloc(): unaligned tcache chunk detected``) is ``abort()``; no core
    file is written (where core dumps are on, the checkout would get one)."""
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.abort()


@pytest.mark.slow
def test_sharded_model_matches_unsharded_bit_for_bit_on_two_gloo_ranks() -> None:
    """Same weights and batch per rank: loss is bitwise the unsharded loss; the reduce-scatter SUMS, so the full
    gradient is bitwise ``g_rank0 + g_rank1`` of the unsharded model (one fp addition, commutative)."""
    r0, r1 = run_on_gloo(_parity_worker, SMALL, world_size=2, preload=preloaded(__name__))
    expected = {name: r0["ref_grads"][name] + r1["ref_grads"][name] for name in r0["ref_grads"]}
    for res in (r0, r1):
        for reshard in (False, True):
            assert torch.equal(res[f"loss_{reshard}"], res["ref_loss"])
            grads = res[f"grads_{reshard}"]
            assert list(grads) == list(expected)
            for name, grad in grads.items():
                assert torch.equal(grad, expected[name]), (reshard, name)
        # aot_autograd with the boxed-eager compiler runs the same CPU kernels (one thread per rank): bitwise too.
        assert torch.equal(res["compiled_loss"], res["ref_loss"])
        for name, grad in res["compiled_grads"].items():
            assert torch.equal(grad, expected[name]), ("compiled", name)


@pytest.mark.slow
def test_run_on_gloo_reports_the_failing_ranks_traceback() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 failed:(.|\n)*ValueError: boom on purpose"):
        run_on_gloo(_failing_worker, world_size=2, timeout_s=60, preload=preloaded(__name__))


@pytest.mark.slow
def test_run_on_gloo_reports_a_rank_that_died_without_waiting_for_the_timeout() -> None:
    """Regression: a rank that dies without reporting (os._exit, segfault, OOM kill, a failed import in spawn
    bootstrap) used to be noticed only after the whole ``timeout_s``, reported as a time-out."""
    # No clock in the assertion: a time-out long enough that a loaded machine never reaches it, so only a harness
    # that waits for it (the bug) reports "timed out"; a working one names the dead rank's exit code at once.
    with pytest.raises(RankFailedError) as failed:
        run_on_gloo(_exit_without_reporting, 3, world_size=2, timeout_s=600, preload=preloaded(__name__))
    assert "timed out" not in str(failed.value) and "3" in str(failed.value)


@pytest.mark.slow
def test_a_rank_that_dies_in_native_code_prints_where_it_was(capfd: pytest.CaptureFixture[str]) -> None:
    """A native crash reports nothing through the results queue; the rank's Python stack on stderr
    (``faulthandler``, which the ranks enable) is what says which call it died in. Spawned ranks (no preload): a
    rank forked from a fork server writes to the stderr the server was started with, which a test's fd capture
    after the first cannot see."""
    with pytest.raises(RankFailedError):
        run_on_gloo(_abort_in_native_code, world_size=2, timeout_s=600)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "_abort_in_native_code" in err, err[-2000:]

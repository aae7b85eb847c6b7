"""Tests of ``overlapcfg.passes``: apply, its transaction and safety, torch.compile, determinism, keep-unsharded."""

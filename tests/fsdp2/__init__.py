"""Tests of ``overlapcfg.fsdp2``: the eager FSDP2 driver."""

"""Whole jobs on several processes: gloo parity runs and torchrun commands (slow tier)."""

"""The package version (one place: hatch reads it, the inductor pass hashes it)."""

__version__ = "0.2.0.dev0"

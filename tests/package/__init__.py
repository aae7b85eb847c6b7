"""The package as a whole: its public surface and its layering."""

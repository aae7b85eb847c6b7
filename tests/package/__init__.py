"""The package as a whole: its public surface, its layering, and README's promises."""

"""Draft-head architectures, one file each, with loaders for their published checkpoint formats."""

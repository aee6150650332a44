"""Acceptance and sampling: the target distribution, and the exact rules that keep decoding lossless."""

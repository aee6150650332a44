"""Drafting: the tree type, tree shapes, selection, every method's proposer (the core's map: `specchat.decode`).

It imports nothing itself: its torch-free modules (`tree`, `lookup`, `deagle`) are read before torch loads.
"""

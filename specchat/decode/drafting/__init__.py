"""Drafting: the tree type, tree shapes, selection, and the proposers of every method (the map: `specchat.decode`).

The torch-free modules here (`tree`, `lookup`, `deagle`) are read before torch loads, so this
package imports nothing itself.
"""

"""Drafting with a draft head (`proposer.HeadProposer`: the algorithm) on either layout, whose
subclass keeps the head's cache and runs a cycle's selection:

- growing (`GrowingHead`, CPUs): a cache that grows; exact sizes, DEAGLE's vote stops drafting, the
  candidates read once and selected on the host (by the verify-cost curve where there is one).
- fixed (`FixedHead`, CUDA): a fixed-capacity cache; one shape every cycle (the step is captured),
  the whole depth drafted, selection and lookup merging on the device.

`for_target` picks the one for a target's layout.
"""

from __future__ import annotations

from drafters import DraftHead
from specchat.decode.drafting.heads.proposer import HeadProposer
from specchat.decode.drafting.heads.growing import GrowingHead
from specchat.decode.drafting.heads.fixed import FixedHead
from specchat.decode.drafting.shapes import DynamicTree, StaticTree
from specchat.decode.runtime.target import Target

__all__ = ["HeadProposer", "GrowingHead", "FixedHead", "for_target"]


def for_target(head: DraftHead, target: Target, shape: StaticTree | DynamicTree, **options) -> HeadProposer:
    """The head's proposer on `target`'s layout (`options`: lookup, curve, pace, lookup_paths,
    fused)."""
    return (GrowingHead if target.envelope is None else FixedHead)(head, target, shape, **options)

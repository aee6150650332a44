"""Decoding methods by name, and what each needs to run.

vanilla  plain decoding, one target forward per token
eagle    EAGLE-1: a static draft tree (`--static-tree`, default mc_sim_7b_63) from a draft head
eagle2   EAGLE-2: a dynamic draft tree (`--total-tokens`, `--depth`, `--tree-top-k`) from a draft head

Any head format (EAGLE-1/2 or EAGLE-3) drafts for either tree method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.drafting import PAPER_DEPTH, PAPER_TOP_K, PAPER_TOTAL_TOKENS, DynamicTreeParams, TreeProposer
from specchat.tree import parse_static_tree

# A CPU verifies a handful of tokens at nearly the cost of one but not sixty, and every draft
# step is paid in full, so CPU trees are smaller than the papers' GPU settings. Chosen from the
# 0.5B measurements in the README (`specchat bench`); CUDA runs use the papers' numbers.
CPU_TOTAL_TOKENS, CPU_DEPTH, CPU_TOP_K = 24, 6, 6

METHODS = {
    "vanilla": "plain decoding",
    "eagle": "EAGLE-1 static tree from a draft head",
    "eagle2": "EAGLE-2 dynamic tree from a draft head",
}
TREE_METHODS = ("eagle", "eagle2")


class MethodError(ValueError):
    """A method cannot run with the given settings (e.g. it needs a draft head)."""


@dataclass(frozen=True)
class TreeDefaults:
    total_tokens: int
    depth: int
    top_k: int


def tree_defaults(device: torch.device) -> TreeDefaults:
    if device.type == "cuda":
        return TreeDefaults(PAPER_TOTAL_TOKENS, PAPER_DEPTH, PAPER_TOP_K)
    return TreeDefaults(CPU_TOTAL_TOKENS, CPU_DEPTH, CPU_TOP_K)


def dynamic_params(settings, device: torch.device) -> DynamicTreeParams:
    defaults = tree_defaults(device)
    try:
        return DynamicTreeParams(
            total_tokens=settings.total_tokens or defaults.total_tokens,
            depth=settings.depth or defaults.depth,
            top_k=settings.tree_top_k or defaults.top_k,
        )
    except ValueError as error:
        raise MethodError(str(error)) from error


def build_proposer(settings, target):
    """The proposer for `settings.method` (None for plain decoding)."""
    method = settings.method
    if method == "vanilla":
        return None
    if method not in METHODS:
        raise MethodError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    if not settings.draft:
        raise MethodError(
            f"--method {method} needs a draft head: --draft FOLDER or hub id (EAGLE-1/2 or EAGLE-3 format)")
    from drafters import load_head

    head = load_head(settings.draft, target, kind=settings.draft_kind)
    if method == "eagle":
        try:
            paths = parse_static_tree(settings.static_tree or "mc_sim_7b_63")
        except ValueError as error:
            raise MethodError(f"--static-tree: {error}") from error
        return TreeProposer(head, target.num_layers, static_paths=paths)
    return TreeProposer(head, target.num_layers, dynamic=dynamic_params(settings, target.device))

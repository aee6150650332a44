"""Decoding methods by name, and what each needs to run.

vanilla  plain decoding, one target forward per token
eagle    EAGLE-1: a static draft tree (`--static-tree`; default mc_sim_7b_63 within `--total-tokens`)
eagle2   EAGLE-2: a dynamic draft tree (`--total-tokens`, `--depth`, `--tree-top-k`) from a draft head
deagle   DEAGLE: the EAGLE-2 tree, deepened only while its survival signals hold (`specchat.deagle`)
jakiro   Jakiro: the EAGLE-2 tree from a Jakiro MoE head, last level drafted in parallel
sps      standard speculative sampling with a small draft model (`--draft` names the model)
pld      prompt lookup: n-gram matches in the conversation, no draft model

eagle, eagle2 and deagle take any head format (EAGLE-1/2, EAGLE-3 or Jakiro); jakiro needs a
Jakiro head. Every method is verified by the same exact rules (`specchat.verify`).
"""

from __future__ import annotations

import dataclasses

from specchat.deagle import DeagleParams
from specchat.draft_model import DEFAULT_DRAFT_TOKENS, DraftModelProposer, TokenizerMismatch, check_tokenizers
from specchat.drafting import PAPER_DEPTH, PAPER_TOP_K, PAPER_TOTAL_TOKENS, DynamicTreeParams, TreeProposer
from specchat.heads import effective_draft, needs_draft
from specchat.lookup import DEFAULT_LOOKUP_TOKENS, PromptLookupProposer
from specchat.tree import MC_SIM_7B_63, MC_SIM_7B_63_ACCEPTED, parse_static_tree, trim_static_tree

# A CPU verifies a handful of tokens for the price of one (0.5B, bf16, 2 threads: 158 ms for 16
# against 159 ms for 1, then 192 ms for 20; README), and every draft step is paid in full, so CPU
# trees are smaller than the papers' GPU settings. On a CPU the verified size comes from the
# machine's measured cost curve (`specchat.calibrate`), within these bounds; CUDA runs use the
# papers' numbers.
CPU_DEPTH, CPU_TOP_K = 6, 6
CPU_TOTAL_TOKENS_RANGE = (8, 32)

METHODS = {
    "vanilla": "plain decoding",
    "eagle": "EAGLE-1 static tree from a draft head",
    "eagle2": "EAGLE-2 dynamic tree from a draft head",
    "deagle": "EAGLE-2 tree with DEAGLE's dynamic depth",
    "jakiro": "EAGLE-2 tree from a Jakiro MoE head, last level in parallel",
    "sps": "speculative sampling with a small draft model",
    "pld": "prompt lookup (n-gram matches, no draft model)",
}


class MethodError(ValueError):
    """A method cannot run with the given settings (e.g. it needs a draft head)."""


def cpu_total_tokens(target) -> int:
    """The largest verified tree this CPU runs for about the price of one token (measured once, cached)."""
    from specchat.calibrate import cached_curve

    low, high = CPU_TOTAL_TOKENS_RANGE
    return min(high, max(low, cached_curve(target).best_total_tokens()))


def dynamic_params(settings, target) -> DynamicTreeParams:
    """The tree budget: the flags, else the papers' numbers on CUDA, else this CPU's."""
    if target.device.type == "cuda":
        total, depth, top_k = PAPER_TOTAL_TOKENS, PAPER_DEPTH, PAPER_TOP_K
    else:
        total = settings.total_tokens or cpu_total_tokens(target)  # measured only when not given
        depth, top_k = CPU_DEPTH, CPU_TOP_K
    try:
        return DynamicTreeParams(total_tokens=settings.total_tokens or total, depth=settings.depth or depth,
                                 top_k=settings.tree_top_k or top_k)
    except ValueError as error:
        raise MethodError(str(error)) from error


def default_static_tree(settings, target) -> tuple:
    """EAGLE-1's mc_sim_7b_63, trimmed to its most accepted nodes where the verify budget is smaller."""
    nodes = dynamic_params(settings, target).total_tokens - 1
    if nodes >= len(MC_SIM_7B_63):
        return MC_SIM_7B_63
    return trim_static_tree(MC_SIM_7B_63, nodes, MC_SIM_7B_63_ACCEPTED)


def deagle_params(settings) -> DeagleParams:
    try:
        return DeagleParams(
            tau_s=settings.deagle_tau_s, tau_rho=settings.deagle_tau_rho, min_depth=settings.deagle_min_depth,
            mass_nodes=settings.deagle_mass_nodes, expected_over=settings.deagle_expected_over,
            expected_plus_bonus=settings.deagle_count_bonus, consecutive=settings.deagle_consecutive,
        )
    except ValueError as error:
        raise MethodError(str(error)) from error


def build_proposer(settings, target, load_model=None):
    """The proposer for `settings.method` (None for plain decoding).

    `load_model(name)` loads a draft model for sps the way the target was loaded.
    """
    method = settings.method
    if method not in METHODS:
        raise MethodError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    if method == "vanilla":
        return None
    wanted, draft_name = needs_draft(method), effective_draft(settings)
    if wanted and not draft_name:
        raise MethodError(f"--method {method} needs --draft: {wanted}")
    if method == "pld":
        try:
            return PromptLookupProposer(settings.draft_tokens or DEFAULT_LOOKUP_TOKENS,
                                        settings.pld_max_ngram, settings.pld_min_ngram)
        except ValueError as error:
            raise MethodError(str(error)) from error
    if method == "sps":
        draft = load_model(draft_name)
        try:
            check_tokenizers(target, draft)
        except TokenizerMismatch as error:
            raise MethodError(str(error)) from error
        return DraftModelProposer(draft, target.vocab_size, settings.draft_tokens or DEFAULT_DRAFT_TOKENS)
    return tree_proposer(dataclasses.replace(settings, draft=draft_name), target)


def tree_proposer(settings, target) -> TreeProposer:
    from drafters import load_head

    method = settings.method
    kind = "jakiro" if method == "jakiro" else settings.draft_kind
    head = load_head(settings.draft, target, kind=kind)
    if settings.static_tree:
        try:
            paths = parse_static_tree(settings.static_tree)
        except ValueError as error:
            raise MethodError(f"--static-tree: {error}") from error
        return TreeProposer(head, target.num_layers, static_paths=paths)
    if method == "eagle":
        return TreeProposer(head, target.num_layers, static_paths=default_static_tree(settings, target))
    return TreeProposer(
        head, target.num_layers, dynamic=dynamic_params(settings, target),
        deagle=deagle_params(settings) if method == "deagle" else None,
        parallel_last_level=method == "jakiro", reference_attach=settings.jakiro_reference_attach,
    )

"""Building a method's proposer from the settings: one builder per method, in one table (`BUILDERS`).

Each proposer drafts on the layout of the target it is built for (`specchat.decode.engine`). Tree
budgets: on CUDA the papers' numbers; on a CPU the verified size comes from the machine's measured
cost curve (`specchat.decode.runtime.calibrate`), since a CPU verifies a handful of tokens for the price of
one but pays every draft step in full. Every combination of settings that makes no sense for a
method is refused here, in one place; the draft a method needs was checked with the settings
(`methods.checked_draft`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from specchat import methods
from specchat.decode.runtime import cpu_decoder, quantized
from specchat.decode.runtime.calibrate import Curve, cached_curve
from specchat.decode.drafting.deagle import DeagleParams
from specchat.decode.drafting import draft_model as small_model, heads, prompt_lookup
from specchat.decode.drafting.draft_model import DraftModelProposer, TokenizerMismatch, check_tokenizers
from specchat.decode.drafting.heads import HeadProposer
from specchat.decode.drafting.lookup import DEFAULT_LOOKUP_TOKENS, EarlierAnswers, LookupSource
from specchat.decode.drafting.prompt_lookup import LookupProposer
from specchat.decode.drafting.shapes import (PAPER_DEPTH, PAPER_TOP_K, PAPER_TOTAL_TOKENS, DeagleTree, DynamicTree,
                                             DynamicTreeParams, JakiroTree, StaticTree)
from specchat.decode.drafting.tree import MC_SIM_7B_63, MC_SIM_7B_63_ACCEPTED, parse_static_tree, trim_static_tree
from specchat.decode.engine.engine import Engine, Proposer
from specchat.decode.engine.staged import StagedDraftModel
from specchat.decode.runtime.quantized import quantized_cache
from specchat.decode.options import DRAFT_MODEL_LONGEST, DRAFT_MODEL_TOKENS, HEAD_QUANTIZE, KERNEL_BITS
from specchat.decode.runtime.target import Target
from specchat.answers import AnswerStore
from specchat.methods import MethodError, effective_draft, method
from specchat.settings import Settings
from specchat.sources import load_head

# A CPU verifies a handful of tokens for little more than one, and every draft step is paid in
# full, so CPU trees are smaller than the papers' GPU settings; their size comes from the measured
# cost curve (specchat.decode.runtime.calibrate), within this range. Its floor is the smallest tree: where
# each verified token costs a fifth of a forward (the AVX2 path: 21.5 ms for one token, 32.8 for
# four), the head's one best node (plus the lookup chains that pay for themselves) answered fastest
# (cpu10, T=0, 2-core Zen 4 held to AVX2: 56-57 tok/s with 2-3 tokens verified, 50 with 4, 46 with 6).
# Each beam node a level expands is a row of every head step (the head's products grow by ~0.02 ms
# a row on two Zen 4 cores, its LM head's top-k and the bookkeeping with it), while the budget keeps
# the head's one or two best nodes: a beam of 3 answered 3-8% faster than 6 at T=0 and T=1 (cpu10,
# 128 tokens, `deagle+tree_top_k=N`, 2026-11-26, on 2-core Zen 4 and on its AVX2 path; a beam of 2
# was as fast at T=0 and slower at T=1; docs/cpu-runtime.md).
CPU_DEPTH, CPU_TOP_K = 6, 3
CPU_TOTAL_TOKENS_RANGE = (2, 32)

LoadModel = Callable[[str], Target]


@dataclass(frozen=True)
class DraftInputs:
    """What a builder may draw on besides the settings and the target."""

    load_model: LoadModel | None = None  # `load_model(name)` loads a draft model (sps) the way the target was loaded
    answers: AnswerStore | None = None  # this user's earlier answers, for lookup to draft from

    def earlier(self, settings: Settings) -> EarlierAnswers | None:
        """The earlier answers as lookup reads them (indexed at the first method that looks them up)."""
        return self.answers.index(settings.pld_max_ngram) if self.answers is not None else None

    def lookup_source(self, settings: Settings) -> LookupSource | None:
        """Lookup continuations for a method that drafts with a head or a small model, with `--lookup`
        (hybrid drafting: they join its drafts and compete for the verify budget)."""
        if not settings.lookup:
            return None
        return LookupSource(settings.pld_max_ngram, settings.pld_min_ngram, self.earlier(settings))


def build_proposer(settings: Settings, target: Target, load_model: LoadModel | None = None,
                   answers: AnswerStore | None = None) -> Proposer | None:
    """The proposer for `settings.method` (None for plain decoding), on `target`'s layout (`DraftInputs`)."""
    entry = method(settings.method)
    if entry.peer:
        raise MethodError(f"{entry.name} is another tool's implementation; only `specchat bench` runs it")
    if settings.static_tree and not entry.static_tree:
        takes = ", ".join(name for name, other in methods.METHODS.items() if other.static_tree)
        raise MethodError(f"--static-tree applies to {takes}, not {entry.name}")
    return BUILDERS[entry](dataclasses.replace(settings, draft=effective_draft(settings)), target,
                           DraftInputs(load_model, answers))


def plain(settings: Settings, target: Target, inputs: DraftInputs) -> None:
    return None


def verify_cost_curve(target: Target) -> Curve | None:
    """This machine's verify-cost curve where drafts are sized by it: the growing layout on a CPU,
    where every verified token costs (on a GPU a few more rows cost next to nothing)."""
    return cached_curve(target) if target.device.type == "cpu" and target.envelope is None else None


def lookup(settings: Settings, target: Target, inputs: DraftInputs) -> LookupProposer:
    try:
        return prompt_lookup.for_target(target, draft_tokens=settings.draft_tokens or DEFAULT_LOOKUP_TOKENS,
                                        max_ngram=settings.pld_max_ngram, min_ngram=settings.pld_min_ngram,
                                        curve=verify_cost_curve(target), earlier=inputs.earlier(settings))
    except ValueError as error:
        raise MethodError(str(error)) from error


def draft_model(settings: Settings, target: Target, inputs: DraftInputs) -> DraftModelProposer:
    draft = inputs.load_model(settings.draft)
    try:
        check_tokenizers(target, draft)
    except TokenizerMismatch as error:
        raise MethodError(str(error)) from error
    if target.envelope is not None and draft.own_forward is None:
        raise MethodError(f"the draft model {draft.name} has no fixed-shape forward here (--cuda-graphs off runs it)")
    curve = verify_cost_curve(target)  # where every verified token costs: chains as long as pay, up to the longest
    longest = settings.draft_tokens or (DRAFT_MODEL_LONGEST if curve is not None else DRAFT_MODEL_TOKENS)
    lookup, pace = inputs.lookup_source(settings), settings.plain_when_faster
    engine = own_engine(settings, draft) if settings.staged and curve is not None else None
    if engine is not None:
        return StagedDraftModel(engine, target, longest, lookup=lookup, curve=curve, pace=pace)
    return small_model.for_target(draft, target, longest, lookup=lookup, curve=curve, pace=pace)


def own_engine(settings: Settings, draft: Target) -> Engine | None:
    """The draft model's own engine where it has a bundled head (staged sps): DEAGLE's trees, sized
    by the draft model's verify cost (its own lookup on: a chain that quotes the text drafts faster);
    None without a head."""
    head = methods.default_draft(methods.DEAGLE.name, settings.draft)
    if head is None:
        return None
    own = dataclasses.replace(settings, model=settings.draft, method=methods.DEAGLE.name, draft=head, lookup=True,
                              plain_when_faster=False, total_tokens=None, depth=None, tree_top_k=None)
    return Engine(draft, deagle_tree(own, draft, DraftInputs()))


def static_tree(settings: Settings, target: Target, inputs: DraftInputs) -> HeadProposer:
    return _head_proposer(settings, target, inputs, lambda: StaticTree(_static_paths(settings, target)))


def dynamic_tree(settings: Settings, target: Target, inputs: DraftInputs) -> HeadProposer:
    return _head_proposer(settings, target, inputs, lambda: DynamicTree(dynamic_params(settings, target)))


def deagle_tree(settings: Settings, target: Target, inputs: DraftInputs) -> HeadProposer:
    return _head_proposer(settings, target, inputs,
                          lambda: DeagleTree(dynamic_params(settings, target), deagle_params(settings)))


def jakiro_tree(settings: Settings, target: Target, inputs: DraftInputs) -> HeadProposer:
    if settings.static_tree:  # a Jakiro head drafts a given static tree like any head
        return static_tree(settings, target, inputs)
    return _head_proposer(settings, target, inputs,
                          lambda: JakiroTree(dynamic_params(settings, target), settings.jakiro_reference_attach))


# What builds each of specchat's methods (the peers' are `specchat.bench.run.RUNNERS`).
BUILDERS: dict[methods.Method, Callable[[Settings, Target, DraftInputs], Proposer | None]] = {
    methods.VANILLA: plain, methods.PLD: lookup, methods.SPS: draft_model, methods.EAGLE: static_tree,
    methods.EAGLE2: dynamic_tree, methods.DEAGLE: deagle_tree, methods.JAKIRO: jakiro_tree,
}


def _head_proposer(settings: Settings, target: Target, inputs: DraftInputs, make_shape: Callable[[], object]) -> HeadProposer:
    """The head's proposer; the tree's shape is made once the head has loaded (a head that cannot
    load fails before this machine's verify cost is measured for the shape's size)."""
    head, folder = load_head(settings.draft, target, kind=method(settings.method).head_kind or settings.draft_kind)
    fused = None
    if target.spec.quantize in KERNEL_BITS:  # the head runs every cycle: on the target's kernel, in HEAD_QUANTIZE's bits
        quantized.quantize_linears(head, KERNEL_BITS[HEAD_QUANTIZE], quantized_cache(folder, HEAD_QUANTIZE, loaded_on=target),
                                   what="the draft head's linear layers")
        cpu_decoder.fuse_head(head)  # each draft step's layer in one call
        rows = head.draft_logits_layer()  # the target LM head's rows of a draft vocabulary (EAGLE, Jakiro)
        if rows is not None and quantized.packable(rows):  # as float32 rows torch took ~10 ms a step on a Zen 3; packed <1
            head.set_draft_logits_layer(quantized.QuantizedLinear.from_linear(rows, KERNEL_BITS[HEAD_QUANTIZE]))
        if target.envelope is None and cpu_decoder.FusedEagle3Step.fits(head):  # and an EAGLE-3 head's whole step
            fused = cpu_decoder.FusedEagle3Step(head)  # and its top-k (the growing layout's drafting)
    lookup, curve = inputs.lookup_source(settings), None
    if settings.lookup or settings.plain_when_faster:  # both weigh what a verified token costs here
        curve = verify_cost_curve(target)
    try:
        return heads.for_target(head, target, make_shape(), lookup=lookup, curve=curve,
                                pace=settings.plain_when_faster, lookup_paths=settings.lookup_paths, fused=fused)
    except ValueError as error:
        raise MethodError(str(error)) from error


def cpu_total_tokens(target: Target) -> int:
    """The largest verified tree this CPU runs for about the price of one token (measured once, cached)."""
    low, high = CPU_TOTAL_TOKENS_RANGE
    return min(high, max(low, cached_curve(target).best_total_tokens()))


def dynamic_params(settings: Settings, target: Target) -> DynamicTreeParams:
    """The tree budget: the flags, else the papers' numbers on CUDA, else this CPU's."""
    if target.device.type == "cuda":
        total, depth, top_k = PAPER_TOTAL_TOKENS, PAPER_DEPTH, PAPER_TOP_K
    else:
        total = settings.total_tokens or cpu_total_tokens(target)  # measured only when not given
        depth, top_k = CPU_DEPTH, CPU_TOP_K
    # the settings' values were checked where they were parsed (`settings.FIELDS`' checks)
    return DynamicTreeParams(total_tokens=settings.total_tokens or total, depth=settings.depth or depth,
                             top_k=settings.tree_top_k or top_k)


def default_static_tree(settings: Settings, target: Target) -> tuple:
    """EAGLE-1's mc_sim_7b_63, trimmed to its most accepted nodes where the verify budget is smaller."""
    nodes = dynamic_params(settings, target).total_tokens - 1
    if nodes >= len(MC_SIM_7B_63):
        return MC_SIM_7B_63
    return trim_static_tree(MC_SIM_7B_63, nodes, MC_SIM_7B_63_ACCEPTED)


def _static_paths(settings: Settings, target: Target) -> tuple:
    if not settings.static_tree:
        return default_static_tree(settings, target)
    try:
        return parse_static_tree(settings.static_tree)
    except ValueError as error:
        raise MethodError(f"--static-tree: {error}") from error


def deagle_params(settings: Settings) -> DeagleParams:
    try:
        return DeagleParams(
            tau_s=settings.deagle_tau_s, tau_rho=settings.deagle_tau_rho, min_depth=settings.deagle_min_depth,
            mass_nodes=settings.deagle_mass_nodes, expected_over=settings.deagle_expected_over,
            expected_plus_bonus=settings.deagle_count_bonus, consecutive=settings.deagle_consecutive,
        )
    except ValueError as error:
        raise MethodError(str(error)) from error

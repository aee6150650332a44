"""Drafters for the fixed envelope (`specchat.decode.fixed_engine.FixedProposer`) that need no draft
head: prompt lookup (pld), a small draft model (sps), and an oracle that drafts a continuation it
already knows (for measuring the runtime: `benchmarks/gpu_runtime.py`).

The head drafters are in `specchat.decode.head_proposer` (`FixedTreeProposer`), next to the host's.
"""

from __future__ import annotations

import torch

from specchat.decode.engine import PREFILL_CHUNK
from specchat.decode.envelope import Envelope, FixedTree, HostInputs, causal_block, pick, window_mask
from specchat.decode.model_proposer import DEFAULT_DRAFT_TOKENS
from specchat.decode.sampling import sample_rows, target_probs
from specchat.decode.lookup import DEFAULT_LOOKUP_TOKENS, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, LookupSource
from specchat.decode.tree import DraftTree
from specchat.decode.verify import FixedAcceptance


class FixedLookupProposer:
    """`pld` on the fixed envelope. The lookup runs on the host, which knows every committed token
    after a cycle's read; the chain reaches the draft step as a host input, padded to a bucket
    (verifying a few padding rows costs a GPU next to nothing; a chain's length costs a graph each)."""

    feature_layers = None
    reach = 0

    def __init__(self, envelope: Envelope, device: torch.device, draft_tokens: int = DEFAULT_LOOKUP_TOKENS,
                 max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        self.k, self.envelope = draft_tokens, envelope
        self.source = LookupSource(max_ngram, min_ngram)
        self.chain = HostInputs(device, "count", *(f"token{i}" for i in range(draft_tokens)))

    def describe(self) -> str:
        return (f"chains of up to {self.k} tokens that followed the latest {self.source.context.min_ngram}-"
                f"{self.source.context.max_ngram}-gram match (fixed-shape steps)")

    def rewind(self, length: int) -> int:
        return self.source.rewind(length)

    def forget(self) -> None:
        self.source.forget()

    def observe(self, tokens: list[int], features) -> None:
        self.source.observe(tokens)

    def start(self, root: torch.Tensor) -> None:
        pass

    def prepare(self, root: int) -> int:
        found = self.source.matches(root, self.k)
        if not found:
            return 0
        tokens = found[0].tokens
        self.chain.write(count=len(tokens), **{f"token{i}": token for i, token in enumerate(tokens)})
        return self.envelope.rows_for(len(tokens) + 1) - 1

    def draft(self, nodes: int, root: torch.Tensor, length: torch.Tensor, span: int, sampling, rng) -> FixedTree:
        width = min(nodes, self.k)
        tokens = self.chain.device[1 : 1 + width]
        return FixedTree.chain(tokens, torch.arange(width, device=tokens.device) < self.chain["count"])

    def commit(self, tree: FixedTree, acceptance: FixedAcceptance, root: torch.Tensor, features) -> None:
        pass

    def committed(self, tokens: list[int], cycle) -> None:
        self.source.observe(tokens)


class FixedModelProposer:
    """`sps` on the fixed envelope: a small draft model drafts a chain of k tokens in one step (k + 1
    forwards, captured together), greedily or drawn from q, on the device.

    The draft's cache follows the target's positions. A cycle at context length L first feeds the
    token at L - 1 (the last one committed: the previous chain's last token when the whole chain was
    accepted, else already in the cache and recomputed to the same entry) with the root at L, then
    each drafted token; whatever the target accepts, every entry before the next cycle's L - 1 is
    then right, and the rest is overwritten."""

    feature_layers = None

    def __init__(self, draft, target_vocab_size: int, envelope: Envelope, draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        self.model, self.vocab_size, self.envelope, self.k = draft, target_vocab_size, envelope, draft_tokens
        self.reach = draft_tokens + 1
        self.cache = draft.new_cache(capacity=envelope.capacity)
        self.context: list[int] = []  # the committed tokens (to feed the draft after a prompt)
        self.fed = 0  # positions whose draft entries are right
        self.last = torch.zeros(1, dtype=torch.long, device=draft.device)  # the token at L - 1

    def describe(self) -> str:
        return f"chains of {self.k} tokens from {self.model.name} (fixed-shape steps)"

    def rewind(self, length: int) -> int:
        del self.context[length:]
        self.fed = min(self.fed, length)
        return length

    def forget(self) -> None:
        pass

    def observe(self, tokens: list[int], features) -> None:
        self.context.extend(tokens)

    @torch.inference_mode()
    def start(self, root: torch.Tensor) -> None:
        """The prompt through the draft model (eagerly, in chunks padded to a bucket)."""
        device = root.device
        while self.fed < len(self.context):
            chunk = self.context[self.fed : self.fed + PREFILL_CHUNK]
            rows = self.envelope.rows_for(len(chunk))
            at = torch.tensor(self.fed, device=device)
            slots = at + torch.arange(rows, device=device)
            span = self.envelope.span_for(self.fed + rows)
            self.model.forward_at(torch.tensor([chunk + [0] * (rows - len(chunk))], device=device), self.cache,
                                  positions=slots[None], slots=slots, span=span, logits_for="none",
                                  mask=window_mask(causal_block(rows, device), at, at, span))
            self.fed += len(chunk)
        self.last.fill_(self.context[-1])

    def prepare(self, root: int) -> int:
        return self.envelope.rows_for(self.k + 1) - 1

    def draft(self, nodes: int, root: torch.Tensor, length: torch.Tensor, span: int, sampling, rng) -> FixedTree:
        device = root.device
        ids = torch.cat([self.last, root])
        tokens, probs, qs = [], [], []
        for step in range(self.k):
            at = length - 1 + step if step == 0 else length + step
            rows = 2 if step == 0 else 1
            slots = at + torch.arange(rows, device=device)
            block = causal_block(rows, device)
            out = self.model.forward_at(ids[None], self.cache, positions=slots[None], slots=slots, span=span,
                                        mask=window_mask(block, at, at, span), logits_for=rows - 1)
            logits = self._vocabulary(out.logits.float())
            if sampling.greedy:  # `draw_rows`, with q computed once where it is kept
                token = logits.argmax(-1)
            else:
                q_row = target_probs(logits, sampling)
                token = sample_rows(q_row, rng)
                qs.append(q_row[0])
            probs.append(torch.softmax(logits, -1)[0].gather(0, token)[0])
            tokens.append(token)
            ids = token
        q = torch.stack(qs) if qs else None
        return FixedTree.chain(torch.cat(tokens), torch.ones(self.k, dtype=torch.bool, device=device),
                               torch.stack(probs), q)

    def _vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (a smaller embedding table's padding rows: never drafted)."""
        if logits.shape[-1] < self.vocab_size:
            logits = torch.cat([logits, logits.new_full((1, self.vocab_size - logits.shape[-1]), float("-inf"))], -1)
        return logits[:, : self.vocab_size]

    def commit(self, tree: FixedTree, acceptance: FixedAcceptance, root: torch.Tensor, features) -> None:
        last_accepted = pick(tree.tokens, (acceptance.count - 1).clamp(min=0))
        self.last.copy_(torch.where(acceptance.count > 0, last_accepted, root[0])[None])

    def committed(self, tokens: list[int], cycle) -> None:
        self.context.extend(tokens)
        self.fed = len(self.context) - 1  # the entries before the newest committed token are right


class ScriptedTree:
    """An oracle: drafts, from a continuation it knows (`script`, the whole sequence of a plain
    greedy run: prompt and answer), a tree of `nodes` nodes whose right path is `depth` deep,
    every other node a wrong sibling hanging off it, so that exactly `depth` tokens are accepted per
    cycle (τ = depth + 1) and the verify step pays for the whole tree. The drafting itself costs
    one gather: what is left of a cycle is the runtime's own cost.

    It drafts for both engines: `draft` on the fixed envelope, `propose` on the host's
    (`specchat.decode.engine.Proposer`), so the two runtimes can be compared on the same trees."""

    feature_layers = None
    reach = 0

    def __init__(self, script: list[int], vocab_size: int, nodes: int, depth: int, device: torch.device):
        if not 1 <= depth <= nodes:
            raise ValueError(f"a scripted tree of {nodes} nodes cannot be {depth} deep")
        self.nodes, self.depth, self.vocab_size = nodes, depth, vocab_size
        self.script_ids = list(script)
        self.script = torch.tensor(script, device=device)
        self.length = 0  # context tokens so far (the host engine's protocol)
        # Levels 1..depth hold one right node each; the wrong ones are spread over the levels,
        # children of the right node above (the root for level 1). Parents come before children.
        levels = [[0] for _ in range(depth)]  # per level: 0 = the right node, w > 0 = the w-th wrong one
        for extra in range(nodes - depth):
            levels[extra % depth].append(len(levels[extra % depth]))
        self.layout: list[tuple[int, int, int]] = []  # (parent, depth, offset) per node
        right = -1
        for level, members in enumerate(levels, start=1):
            first = len(self.layout)
            self.layout += [(right, level, member) for member in members]
            right = first  # this level's right node, the parent of the next level
        parents, depths, offsets = zip(*self.layout)
        self.parents = torch.tensor(parents, device=device)
        self.depths = torch.tensor(depths, device=device)
        self.offsets = torch.tensor(offsets, device=device)  # added to the right token: the wrong ones differ

    def describe(self) -> str:
        return f"an oracle: {self.nodes} nodes, the right path {self.depth} deep"

    def rewind(self, length: int) -> int:
        self.length = min(self.length, length)
        return self.length

    def forget(self) -> None:
        pass

    def observe(self, tokens, features, cycle=None) -> None:
        self.length += len(tokens)

    def start(self, root) -> None:
        pass

    def prepare(self, root: int) -> int:
        return self.nodes

    def draft(self, nodes: int, root: torch.Tensor, length: torch.Tensor, span: int, sampling, rng) -> FixedTree:
        at = (length + self.depths).clamp(max=len(self.script) - 1)
        tokens = (self.script[at] + self.offsets) % self.vocab_size
        valid = torch.ones(self.nodes, dtype=torch.bool, device=tokens.device)
        return FixedTree(tokens, self.parents, self.depths, valid, torch.ones(self.nodes, device=tokens.device),
                         self.depth)

    def commit(self, tree, acceptance, root, features) -> None:
        pass

    def committed(self, tokens, cycle) -> None:
        self.length += len(tokens)

    def propose(self, root: int, settings, rng, max_depth: int, max_nodes: int) -> DraftTree:
        last = len(self.script_ids) - 1
        kept = [node for node, (_, depth, _) in enumerate(self.layout) if depth <= max_depth][:max_nodes]
        slot = {node: index for index, node in enumerate(kept)}
        return DraftTree(
            tokens=[(self.script_ids[min(self.length + depth, last)] + offset) % self.vocab_size
                    for _, depth, offset in (self.layout[node] for node in kept)],
            parents=[slot[self.layout[node][0]] if self.layout[node][0] >= 0 else -1 for node in kept],
            depths=[self.layout[node][1] for node in kept], probs=[1.0] * len(kept))

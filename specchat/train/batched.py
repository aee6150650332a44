"""Many sequences through the target's own layers at once: rows with positions of their own.

Two users, one forward (`rows_forward`, which calls the loaded model's modules as
`specchat.decode.runtime.forward` does, so no weight is copied):

- regeneration (`SlotDecoder`): a KV cache of fixed capacity holds `slots` sequences, one per
  slot. Every decoding step feeds each busy slot its last token; a sequence that ends frees its
  slot, and the next prompt is prefilled into it (chunked, several prompts in one forward) while
  the others go on: continuous batching, rather than a batch that runs until its longest answer
  ends. A conversation's next turn goes to the slot that answered its last one, which still holds
  the conversation so far: only what the cache lacks is prefilled (the new user turn), as a chat
  reuses its cached prefix. The decoding step has one shape per attention span (a few sizes), so
  on CUDA it is captured as a CUDA graph once per span and replayed
  (`specchat.decode.runtime.graphs.StepGraphs`); the host writes the step's inputs and reads the
  drawn tokens, one read per step, and launches the next step before it hands on the answers that
  ended, so that the device decodes while the host writes them and asks the next turns (host work
  the GPU waited for: 20 s of the fourth block's 158 s of answering). Where flash attention and
  Triton run (CUDA), a step's attention reads each slot's own positions (`OwnSpanAttention`) and
  its draw is one pass over the logits (`specchat.train.fused_draw`).
- training (`specchat.train.features.packed_features`): several conversations packed into each
  row, each attending only to itself (`PackedAttention`; `PackedFlashAttention` where flash
  attention runs), give the target's features for a batch on the device, with no feature files.

Greedy answers equal decoding each prompt alone token for token in float32 (on a CPU: masked
positions get exactly zero weight, and each slot reads only its own keys); a sampled token is
drawn from the target's distribution at its slot's temperature, as plain decoding draws it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from drafters.attention import grouped
from specchat.decode import (DecoderForward, StepGraphs, kernel_failure, make_generator, powers_of_two, rotate,
                             sample_rows)
from specchat.train import fused_draw

log = logging.getLogger(__name__)

SMALLEST_SPAN = 128  # captured steps attend over powers of two from here to the capacity
# Prompt tokens per prefill forward (rows x chunk): a CPU's attention scores are float32
# [rows, kv_heads, group x chunk, span]; a GPU wants wide forwards, since each is launched eagerly.
PREFILL_TOKENS = {"cpu": 2048, "cuda": 16384}
PREFILL_CHUNK = {"cpu": 256, "cuda": 512}
# On CUDA a prefill forward is launched eagerly (hundreds of kernels, several ms) while a captured
# step is one launch: so freed slots are refilled together once this share of them is free (at
# most that share idles meanwhile); a CPU pays for tokens, not launches, and refills at once.
REFILL_SHARE = {"cpu": 0.0, "cuda": 1 / 16}
# A prefill's rows run to its longest prompt's chunk, so it takes the oldest pending prompt and those
# nearest its length among the next LOOKAHEAD per free slot: 32 prompts in queue order (the training
# prompts: 75 tokens on average, the longest of 32 some 400) left ~80% of the positions padding, these
# ~30% (a simulation of the admission over 4,000 of them); the oldest always goes, so none waits for long.
LOOKAHEAD = 8
# The prompts admitted together are then prefilled in groups of near lengths (a group's longest at
# most PREFILL_SPREAD times a member's length plus PREFILL_SPREAD_TOKENS), one prefill each: later
# turns, which carry the conversation so far, are few and long (the fourth GPU block's 12,653
# requests: 242 tokens on average, up to 1,023), so a long one's nearest pending neighbours were often
# a third of its length, and 49% of the prefills' positions were padding (50% measured on its H200).
# Grouped, a replay of those requests (docs/scripts/prefill_padding.py) leaves 15% for 1.7x the
# forwards at 1,024 slots (2.4x at 512), each a few ms of launches on a GPU against ~7.5 us a position:
# ~32 s of prefill modelled for ~44.
PREFILL_SPREAD, PREFILL_SPREAD_TOKENS = 1.5, 32


def stacked_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask [R, 1, n, L] as SDPA's additive bias for the query heads of each KV head
    stacked as rows ([R, 1, group x n, L], `stacked_attention`). A forward makes it once for all its
    layers: SDPA would turn a boolean mask into this in every layer, after stacking had copied it."""
    rows, _, n, length = mask.shape
    stacked = mask[:, :, None].expand(rows, 1, group, n, length).reshape(rows, 1, group * n, length)
    return torch.zeros(stacked.shape, dtype=dtype, device=mask.device).masked_fill_(~stacked, float("-inf"))


def stacked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Grouped-query attention of q [R, heads, n, d] over k, v [R, kv_heads, L, d] in one SDPA call,
    the query heads sharing a KV head as its rows (repeat_kv would copy every slot's keys once per
    query head: most of a wide decoding step's memory traffic); `bias` from `stacked_bias`."""
    rows, heads, n, dim = q.shape
    kv_heads = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads * n, dim), k, v, attn_mask=bias,
                                         scale=scale)
    return out.reshape(rows, heads, n, dim)


class MaskedAttention:
    """Attention as a boolean mask [R, 1, n, L] allows, the same for every layer of a forward: on CUDA
    `stacked_attention` with the mask's bias made at the first layer; on a CPU
    `drafters.attention.grouped` (float32, the same without SDPA)."""

    def __init__(self, mask: torch.Tensor, scale: float):
        self.mask, self.scale = mask, scale
        self.bias: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.device.type != "cuda":
            return grouped(q, k, v, self.mask, self.scale)
        if self.bias is None:
            self.bias = stacked_bias(self.mask, q.shape[1] // k.shape[1], q.dtype)
        return stacked_attention(q, k, v, self.bias, self.scale)


def rows_forward(forward: DecoderForward, input_ids: torch.Tensor, positions: torch.Tensor,
                 attention: Callable, feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The final normed states [R, n, H] of `input_ids` [R, n] at `positions` [R, n], and the hidden
    states `feature_layers` names (as `DecoderForward`: 0 = embeddings, i = output of layer i - 1,
    the last index the final state). `attention(layer, q, k, v)` attends (a `SlotAttention`, a
    `PackedAttention`)."""
    rows, n = input_ids.shape
    x = forward.embed_tokens(input_ids)
    cos, sin = forward.rotary_emb(x, positions)  # [R, n, d]
    cos, sin = cos[:, None], sin[:, None]
    hidden = []
    for index, layer in enumerate(forward.layers):
        hidden.append(x)
        module = layer.self_attn
        q, k, v = forward.projections[index](layer.input_layernorm(x))
        q, k = q.view(rows, n, forward.heads, forward.head_dim), k.view(rows, n, forward.kv_heads, forward.head_dim)
        if forward.normalizes_heads:
            q, k = module.q_norm(q), module.k_norm(k)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        v = v.view(rows, n, forward.kv_heads, forward.head_dim).transpose(1, 2)
        out = attention(index, q, k, v)  # [R, heads, n, d]
        x = x + module.o_proj(out.transpose(1, 2).reshape(rows, n, forward.heads * forward.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    final = forward.norm(x)
    hidden.append(final)
    return final, [hidden[i] for i in feature_layers]


class SlotCache:
    """Keys and values of `slots` sequences of up to `capacity` positions: [layers, slots, kv_heads, capacity, d]
    (`apart`: [slots, layers, ...], each slot's part in one piece, as the kernel's `Decoder` takes a
    sequence's cache). Zeros at first: a masked position still meets its zero weight, and 0 * NaN would be NaN."""

    def __init__(self, forward: DecoderForward, slots: int, capacity: int, apart: bool = False):
        shape = ((slots, len(forward.layers)) if apart else (len(forward.layers), slots)) + (
            forward.kv_heads, capacity, forward.head_dim)
        self.keys = torch.zeros(shape, dtype=forward.dtype, device=forward.device)
        self.values = torch.zeros_like(self.keys)
        self.capacity = capacity

    def write(self, layer: int, slots: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values k, v [R, kv_heads, n, d] of rows that extend `slots` (all in
        order when None) at `positions` [R, n]; the layer's keys and values."""
        keys, values = self.keys[layer], self.values[layer]
        rows = slots if slots is not None else torch.arange(keys.shape[0], device=keys.device)
        keys[rows[:, None], :, positions] = k.transpose(1, 2)  # [R, n, kv_heads, d]
        values[rows[:, None], :, positions] = v.transpose(1, 2)
        return keys, values


class SlotAttention(MaskedAttention):
    """Rows that extend slots of a `SlotCache`: row r's new entries go to slot `slots[r]` (all slots
    in order when None) at its `positions[r]`, and each query attends to its slot's first `span`
    positions up to its own."""

    def __init__(self, cache: SlotCache, slots: torch.Tensor | None, positions: torch.Tensor, span: int, scale: float):
        allowed = torch.arange(span, device=positions.device) <= positions[..., None]
        super().__init__(allowed[:, None], scale)  # [R, 1, n, span]
        self.cache, self.slots, self.positions, self.span = cache, slots, positions, span

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        keys, values = self.cache.write(layer, self.slots, self.positions, k, v)
        keys, values = keys[:, :, : self.span], values[:, :, : self.span]
        if self.slots is not None:
            keys, values = keys.index_select(0, self.slots), values.index_select(0, self.slots)
        return self.attend(q, keys, values)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_starts: torch.Tensor,
                 key_starts: torch.Tensor, max_queries: int, max_keys: int, scale: float,
                 used: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Flash attention's kernel over variable-length sequences packed in q [Tq, heads, d] and k, v
    [Tk, kv_heads, d] (query head j reads KV head j // (heads / kv_heads)): sequence i's queries are
    q[query_starts[i] : query_starts[i + 1]], and they attend to its keys from key_starts[i] on, the
    first used[i] of them (to key_starts[i + 1] when `used` is None), each query to every one of them
    or, `causal`, query t to keys 0 .. t (equal lengths). CUDA, fp16 or bf16 only: torch's own op,
    whose `seqused_k` the public `torch.nn.attention.varlen.varlen_attn` lacks in some of the versions
    that have it."""
    return torch.ops.aten._flash_attention_forward(q, k, v, query_starts, key_starts, max_queries, max_keys, 0.0,
                                                   causal, False, scale=scale, seqused_k=used)[0]


@functools.cache
def flash_varlen_failure(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `flash_varlen` cannot run there, or None: flash attention's kernels run on CUDA GPUs from
    Ampere on, in fp16 and bf16, and a captured step runs them in its graph; a tiny call is tried,
    eagerly and captured (no GPU ran these paths before the block that first uses them), once a
    device and dtype, and on CUDA what stops it is said once."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "flash attention runs on CUDA in fp16 or bf16"
    failure = None
    if torch.cuda.get_device_capability(device) < (8, 0):
        failure = "flash attention runs on CUDA GPUs from Ampere on"
    else:
        q = torch.zeros(4, 1, 64, dtype=dtype, device=device)
        starts, used = (torch.tensor(values, dtype=torch.int32, device=device) for values in ([0, 2, 4], [1, 2]))
        failure = kernel_failure(lambda: flash_varlen(q, q, q, starts, starts, 2, 2, 1.0, used))
    if failure is not None:
        log.warning("attention without flash attention's variable-length kernel (%s)", failure)
    return failure


class OwnSpanAttention:
    """A decoding step's rows, one a slot at its `positions[s, 0]`, each attending to its own slot's
    positions up to its own, where `SlotAttention` reads every slot up to the step's common span: with
    hundreds of slots some answer is always deep (the fourth block's 512-slot steps averaged a span of
    1,499 positions), and attention over it was 44-45% of a step on an H100 and on an H200 (their
    blocks' `trace-slots-summary.txt`). Each (slot, KV head) is one of `flash_varlen`'s sequences,
    whose queries are that KV head's query heads and whose keys stay where the cache holds them (a
    layer's [slots, kv_heads, capacity, d] lies as [slots x kv_heads x capacity, 1, d]); an idle slot
    (at `idle`, the scratch position) reads one position. `span` bounds every slot's positions."""

    def __init__(self, cache: SlotCache, positions: torch.Tensor, idle: int, span: int, scale: float, group: int):
        """`group`: the query heads that share a KV head (head j reads KV head j // group, as `grouped`)."""
        slots, kv_heads, capacity = cache.keys.shape[1], cache.keys.shape[2], cache.capacity
        used = torch.where(positions[:, 0] == idle, 1, positions[:, 0] + 1).to(torch.int32)
        self.used = used[:, None].expand(slots, kv_heads).reshape(-1)  # sequence s * kv_heads + h: slot s, KV head h
        sequences = torch.arange(slots * kv_heads + 1, dtype=torch.int32, device=positions.device)
        self.query_starts, self.key_starts = sequences * group, sequences * capacity
        self.cache, self.positions, self.span, self.scale, self.group = cache, positions, span, scale, group

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        keys, values = self.cache.write(layer, None, self.positions, k, v)
        slots, heads, _, dim = q.shape
        out = flash_varlen(q.reshape(slots * heads, 1, dim), keys.view(-1, 1, dim), values.view(-1, 1, dim),
                           self.query_starts, self.key_starts, self.group, self.span, self.scale, self.used)
        return out.reshape(slots, heads, 1, dim)


class PackedAttention(MaskedAttention):
    """Rows holding several sequences each, no cache: a position attends to the earlier positions
    of its own sequence (`documents` [R, n] numbers them within a row)."""

    def __init__(self, documents: torch.Tensor, scale: float):
        n = documents.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=documents.device).tril()
        super().__init__((causal & (documents[:, :, None] == documents[:, None, :]))[:, None], scale)

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        return self.attend(q, k, v)


class PackedFlashAttention:
    """`PackedAttention` through `flash_varlen` (where `flash_varlen_failure` is None): each document of
    each row one of its causal sequences, so no mask is made, where the masked SDPA ran memory-efficient
    attention with a [rows, 1, group x n, n] additive bias, 8.8% of a training step's device time in
    the fourth block's trace (`fmha_cutlassF`, 0.86 ms a layer, for kernels that need ~0.1 ms)."""

    def __init__(self, documents: torch.Tensor, scale: float):
        n, flat = documents.shape[1], documents.flatten()
        starts = torch.ones_like(flat, dtype=torch.bool)
        starts[1:] = flat[1:] != flat[:-1]
        starts[::n] = True  # a row's first document starts there, whatever the row before ended with
        ends = torch.tensor([len(flat)], device=flat.device)
        self.starts = torch.cat([starts.nonzero().flatten(), ends]).to(torch.int32)
        self.longest, self.scale = int((self.starts[1:] - self.starts[:-1]).max()), scale

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        rows, heads, n, dim = q.shape
        packed = [t.transpose(1, 2).reshape(rows * n, t.shape[1], dim) for t in (q, k, v)]  # [R x n, heads, d]
        out = flash_varlen(*packed, self.starts, self.starts, self.longest, self.longest, self.scale, causal=True)
        return out.view(rows, n, heads, dim).transpose(1, 2)


def packed_attention(documents: torch.Tensor, scale: float,
                     dtype: torch.dtype) -> PackedAttention | PackedFlashAttention:
    """The attention of packed rows (`documents` [R, n]) for a forward in `dtype`: through flash
    attention's variable-length kernel where it runs, else the masked one."""
    flash = flash_varlen_failure(documents.device, dtype) is None
    return (PackedFlashAttention if flash else PackedAttention)(documents, scale)


# ---------------------------------------------------------------------------------------------
# Continuous batching


@dataclass(eq=False)
class Request:
    ids: list[int]  # the prompt's token ids
    temperature: float  # 0: greedy
    tag: object = None  # the caller's: what the answer belongs to
    after: Request | None = None  # the request whose answer this one's conversation goes on from


class Seat(NamedTuple):
    """A request admitted into a slot whose cache already holds the first `reused` of its prompt's
    tokens (an earlier turn of its conversation answered there; 0 for most)."""
    slot: int
    request: Request
    reused: int

    @property
    def length(self) -> int:
        """Prompt tokens to prefill."""
        return len(self.request.ids) - self.reused


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share from their start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class Answer:
    request: Request
    tokens: list[int]  # the new tokens, a final stop token left out
    finish: str  # "stop" (a stop token ended it) or "length"


def draw(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None,
         sampled: bool) -> torch.Tensor:
    """The token each row of [R, V] logits draws at its temperature (0: the argmax, as
    `specchat.decode.acceptance.sampling.draw_rows` takes it; else from softmax(logits / T))."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    if not sampled:
        return greedy
    hot = temperatures > 0
    probs = torch.softmax(logits / torch.where(hot, temperatures, 1.0)[:, None], dim=-1)
    return torch.where(hot, sample_rows(probs, generator), greedy)


@dataclass
class SlotTimes:
    """Where a `SlotDecoder`'s time went, in wall seconds: each phase ends by reading its result on
    the host, so on CUDA a phase's seconds include the device's. Capturing (each step shape's eager
    first run and its capture) is counted apart from the steps."""
    slots: int  # sequences decoded at once
    steps: int = 0  # decoding steps (one token for every busy slot)
    step_seconds: float = 0.0
    busy_rows: int = 0  # summed over the steps: the slots that were answering
    span_positions: int = 0  # summed over the steps: the positions every slot attended over (the longest's)
    own_positions: float = 0.0  # summed over the steps: the positions a busy slot holds, on average
    prefills: int = 0  # prefill forwards (each a chunk of several prompts)
    prefill_tokens: int = 0  # prompt tokens run, padding left out
    reused_tokens: int = 0  # prompt tokens not run: their slot held them from the conversation's earlier turn
    prefill_positions: int = 0  # the positions the prefill forwards ran, padding included
    prefill_seconds: float = 0.0
    capture_seconds: float = 0.0

    def padding(self) -> float:
        """The share of the prefill forwards' positions that were padding (rows run past a prompt's end)."""
        return 1 - self.prefill_tokens / self.prefill_positions if self.prefill_positions else 0.0

    def summary(self, seconds: float) -> str:
        """One line; `seconds`: the whole run's, whose rest (tokenizing, writing answers) is said too."""
        if not self.steps:
            return "no decoding step"
        rest = seconds - self.step_seconds - self.prefill_seconds - self.capture_seconds
        return (f"decoding {self.step_seconds:.0f} s ({self.steps:,} steps of {1000 * self.step_seconds / self.steps:.1f} ms, "
                f"{self.busy_rows / self.steps:.0f} of {self.slots} slots busy, "
                f"span {self.span_positions / self.steps:,.0f}, a slot's own {self.own_positions / self.steps:,.0f}), "
                f"prefill {self.prefill_seconds:.0f} s ({self.prefills:,} forwards, {self.prefill_tokens:,} prompt tokens "
                f"and {self.reused_tokens:,} reused from their slots, {self.padding():.0%} of their positions padding), "
                f"capturing {self.capture_seconds:.0f} s, the rest (tokenizing, writing) {rest:.0f} s")


def admitted(pending: deque, free: int, chunk: int, budget: int) -> list[Request]:
    """The requests one prefill admits into `free` slots, taken out of `pending`: the oldest and those
    nearest its length among the next LOOKAHEAD per free slot, while their prompts (each counted up to
    `chunk` tokens) fit the prefill's `budget`; the rest keep their order."""
    window = list(itertools.islice(pending, LOOKAHEAD * free))  # (indexing a deque walks its blocks)
    anchor = len(window[0].ids)
    nearest = sorted(range(len(window)), key=lambda i: (i > 0, abs(len(window[i].ids) - anchor), i))
    taken, tokens = [], 0
    for i in nearest[:free]:
        size = min(len(window[i].ids), chunk)
        if taken and tokens + size > budget:
            break
        taken.append(i)
        tokens += size
    for i in sorted(taken, reverse=True):
        del pending[i]
    return [window[i] for i in taken]


def prefill_chunks(lengths: list[int], chunk: int) -> Iterator[tuple[int, list[int], int]]:
    """A prefill of prompts of these lengths (the tokens each runs), a chunk at a time: (its offset into
    each prompt's part, the prompts that reach it, its width: the longest of them up to `chunk`)."""
    for start in range(0, max(lengths), chunk):
        rows = [i for i, n in enumerate(lengths) if n > start]
        yield start, rows, min(chunk, max(lengths[i] for i in rows) - start)


def near_lengths(seats: list[Seat]) -> list[list[Seat]]:
    """`seats` in groups of near prefill lengths, longest first: a group's longest at most
    PREFILL_SPREAD times each member's length plus PREFILL_SPREAD_TOKENS."""
    groups: list[list[Seat]] = []
    for seat in sorted(seats, key=lambda seat: seat.length, reverse=True):
        if groups and groups[-1][0].length <= PREFILL_SPREAD * seat.length + PREFILL_SPREAD_TOKENS:
            groups[-1].append(seat)
        else:
            groups.append([seat])
    return groups


class SlotBook:
    """Which sequence each free slot's cache still holds (a slot answers, then idles untouched until
    another request takes it), and the seats of each admission: every pending follow-up whose own
    slot holds its conversation goes back there, reusing what it shares with it; other prompts as
    `admitted` takes them, into slots that hold nothing first. No tensor: the policy alone
    (`docs/scripts/prefill_padding.py` replays it)."""

    def __init__(self, slots: int):
        self.held: list[tuple[Request, list[int]] | None] = [None] * slots  # the request a slot answered, and
        # the tokens whose keys and values it holds for it
        self.holders: dict[Request, int] = {}  # ... and back: the slot that holds a request's sequence

    def hold(self, slot: int, request: Request, tokens: list[int]) -> None:
        """`slot` answered `request` and holds `tokens` (its prompt and all but the answer's last token)."""
        self.held[slot] = request, tokens
        self.holders[request] = slot

    def admit(self, pending: deque, free: list[int], chunk: int, budget: int) -> list[Seat]:
        """Seats in `free` slots for the requests one prefill admits, taken out of `pending`."""
        own = {request: self.holders[request.after] for request in pending
               if request.after is not None and request.after in self.holders}
        for request in own:
            pending.remove(request)
        requests = list(own)
        if pending and len(free) > len(requests):
            requests += admitted(pending, len(free) - len(requests), chunk, budget)
        taken = set(own.values())
        others = iter(sorted((slot for slot in free if slot not in taken),
                             key=lambda slot: self.held[slot] is not None))  # holding nothing first
        seats = []
        for request in requests:
            slot = own[request] if request in own else next(others)
            # all but the prompt's last token may come from the cache: that one runs to give the first new token
            reused = min(shared_prefix(request.ids, self.held[slot][1]), len(request.ids) - 1) if request in own else 0
            if self.held[slot] is not None:
                del self.holders[self.held[slot][0]]
                self.held[slot] = None
            seats.append(Seat(slot, request, reused))
        return seats


class SlotDecoder:
    """Answers requests `slots` at a time (continuous batching), each in at most `max_new_tokens`
    tokens, a stop token ending it; prompts of up to `max_prompt_tokens`."""

    def __init__(self, target, slots: int, max_prompt_tokens: int, max_new_tokens: int, stop_ids, seed: int = 0,
                 capture: bool = True, own_spans: bool | None = None, one_pass_draw: bool | None = None):
        """`capture`: the decoding step as CUDA graphs (on CUDA; a CPU runs it eagerly). `own_spans`: each
        slot's decoding attends over its own positions alone (`OwnSpanAttention`); `one_pass_draw`: the
        step draws its tokens in one pass over the logits (`specchat.train.fused_draw`); None: each
        where its kernel runs."""
        self.target, self.forward = target, target.own_forward
        device, kind = target.device, target.device.type if target.device.type in PREFILL_TOKENS else "cpu"
        self.max_new_tokens, self.stops = max_new_tokens, np.array(sorted(stop_ids), dtype=np.int64)
        # Positions 0 .. prompt + answer - 2 are written; the last one is scratch, where idle slots write.
        self.cache = self._new_cache(slots, max_prompt_tokens + max_new_tokens + 1)
        self.scratch = self.cache.capacity - 1
        self.graphs = StepGraphs(device, capture)
        self.spans = powers_of_two(min(SMALLEST_SPAN, self.cache.capacity), self.cache.capacity)
        self.own_spans = flash_varlen_failure(device, self.forward.dtype) is None if own_spans is None else own_spans
        self.one_pass_draw = fused_draw.unavailable(device) is None if one_pass_draw is None else one_pass_draw
        # the one-pass draw's noise key, which each step advances
        self.draw_seed = torch.full((1,), seed, dtype=torch.int64, device=device)
        self.chunk, self.prefill_tokens = PREFILL_CHUNK[kind], PREFILL_TOKENS[kind]
        self.refill_at = max(1, int(slots * REFILL_SHARE[kind]))
        self.generator = make_generator(seed, device)
        # The decoding step's static inputs and output (a captured graph reads and writes these).
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.full((slots,), self.scratch, dtype=torch.long, device=device)
        self.temperatures = torch.zeros(slots, device=device)
        self.drawn = torch.zeros(slots, dtype=torch.long, device=device)
        # The host's view of every slot.
        self.requests: list[Request | None] = [None] * slots
        self.host_tokens = np.zeros(slots, dtype=np.int64)
        self.host_positions = np.full(slots, self.scratch, dtype=np.int64)
        self.host_temperatures = np.zeros(slots, dtype=np.float32)
        self.answers = np.zeros((slots, max_new_tokens), dtype=np.int64)
        self.counts = np.zeros(slots, dtype=np.int64)
        self.book = SlotBook(slots)
        self.times = SlotTimes(slots)
        self.launched: tuple[np.ndarray, int] | None = None  # the step under way: its busy slots and span

    def _new_cache(self, slots: int, capacity: int) -> SlotCache:
        return SlotCache(self.forward, slots, capacity)

    def run(self, pending: deque, admit: Callable[[], bool] = lambda: True) -> Iterator[Answer]:
        """Answer the requests of `pending` (the caller may append more between answers) until none
        is left or `admit()` turns false; the answers under way then finish."""
        while True:
            free = [slot for slot, request in enumerate(self.requests) if request is None]
            busy = len(self.requests) - len(free)
            if pending and free and (busy == 0 or len(free) >= self.refill_at) and admit():
                yield from self._admit(pending, free)
                continue
            if busy == 0:
                return
            yield from self.step()

    def _admit(self, pending: deque, free: list[int]) -> list[Answer]:
        """Prefill into free slots every pending follow-up whose slot holds its conversation, and as many
        other prompts as one prefill's budget takes: the oldest and those nearest its length (`SlotBook`)."""
        seats = self.book.admit(pending, free, self.chunk, self.prefill_tokens)
        assert all(len(seat.request.ids) + self.max_new_tokens < self.cache.capacity for seat in seats), \
            "a prompt longer than the slots hold"
        started = time.perf_counter()
        first = {seat.slot: token for group in near_lengths(seats) for seat, token in zip(group, self._prefill(group))}
        self.times.prefill_seconds += time.perf_counter() - started
        self.times.reused_tokens += sum(seat.reused for seat in seats)
        for slot, request, _ in seats:
            token = first[slot]
            self.requests[slot] = request
            self.host_tokens[slot], self.host_positions[slot] = token, len(request.ids)
            self.host_temperatures[slot] = request.temperature
            self.answers[slot, 0], self.counts[slot] = token, 1
        return self._finished(np.array([seat.slot for seat in seats]))

    @torch.inference_mode()
    def _prefill(self, seats: list[Seat]) -> list[int]:
        """Run the prompts into their slots (each from its first token the slot does not hold), a chunk
        of positions at a time; each one's first token."""
        device, lengths = self.target.device, [seat.length for seat in seats]
        first = [0] * len(seats)
        for offset, rows, width in prefill_chunks(lengths, self.chunk):
            ids = torch.zeros((len(rows), width), dtype=torch.long)  # padding runs past a prompt's end: never attended
            for row, i in enumerate(rows):
                begin = seats[i].reused + offset
                part = seats[i].request.ids[begin : begin + width]
                ids[row, : len(part)] = torch.tensor(part)
            slots = torch.tensor([seats[i].slot for i in rows], device=device)
            begins = torch.tensor([seats[i].reused + offset for i in rows], device=device)
            # (a row that starts late may pad past the cache's end: its padding goes to the scratch position)
            positions = (begins[:, None] + torch.arange(width, device=device)).clamp_(max=self.scratch)
            span = min(max(seats[i].reused for i in rows) + offset + width, self.cache.capacity)
            final, _ = rows_forward(self.forward, ids.to(device), positions,
                                    SlotAttention(self.cache, slots, positions, span, self.forward.scaling))
            self.times.prefills += 1
            self.times.prefill_tokens += sum(min(width, lengths[i] - offset) for i in rows)
            self.times.prefill_positions += len(rows) * width
            ending = [(row, i) for row, i in enumerate(rows) if lengths[i] <= offset + width]
            if ending:
                last = final[[row for row, _ in ending], [lengths[i] - 1 - offset for _, i in ending]]
                hot = [seats[i].request.temperature for _, i in ending]
                drawn = draw(self.target.lm_head(last), torch.tensor(hot, device=device), self.generator, any(hot))
                for (_, i), token in zip(ending, drawn.tolist()):
                    first[i] = token
        return first

    def _decode(self, span: int, sampled: bool) -> None:
        """One token for every slot (idle ones write to the scratch position): the captured step."""
        positions, scale = self.positions[:, None], self.forward.scaling
        group = self.forward.heads // self.forward.kv_heads
        attention = (OwnSpanAttention(self.cache, positions, self.scratch, span, scale, group) if self.own_spans
                     else SlotAttention(self.cache, None, positions, span, scale))
        final, _ = rows_forward(self.forward, self.tokens[:, None], positions, attention)
        logits = self.target.lm_head(final[:, 0])
        if self.one_pass_draw:
            self.draw_seed.add_(1)  # in the captured step: every replay draws afresh
            fused_draw.draw(logits, self.temperatures, self.draw_seed, self.drawn)
        else:
            self.drawn.copy_(draw(logits, self.temperatures, self.generator, sampled))

    def fill(self, lengths: list[int], temperatures: list[float]) -> None:
        """Every slot busy at once, each as if its `lengths[slot]` tokens were in (no prompt is run: the
        cache holds what it holds), at its temperature: where `specchat runtime-check --slots` times steps."""
        for slot, (length, temperature) in enumerate(zip(lengths, temperatures, strict=True)):
            self.requests[slot] = Request([0] * length, temperature)
            self.host_positions[slot], self.host_temperatures[slot], self.counts[slot] = length, temperature, 1

    @torch.inference_mode()
    def step(self) -> list[Answer]:
        """One token for every slot busy when the step was launched; the answers that ended (their slots
        freed). Before it returns, the next step is launched for the slots still busy: on CUDA it runs
        while the caller writes the answers and asks the next turns, and while `run` prefills free
        slots (after it on the device: those slots sit it out idle, and join the step after)."""
        started, capturing = time.perf_counter(), self.graphs.capture_seconds
        if self.launched is None:
            self._launch()
        slots, span = self.launched
        drawn = self.drawn.cpu().numpy()  # waits for the step
        self.launched = None
        self.times.steps += 1
        self.times.busy_rows += len(slots)
        self.times.span_positions += span
        self.times.own_positions += float(self.host_positions[slots].mean()) + 1
        self.answers[slots, self.counts[slots]] = drawn[slots]
        self.counts[slots] += 1
        self.host_tokens[slots] = drawn[slots]
        self.host_positions[slots] += 1
        finished = self._finished(slots)
        if any(request is not None for request in self.requests):
            self._launch()
        captured = self.graphs.capture_seconds - capturing
        self.times.capture_seconds += captured
        self.times.step_seconds += time.perf_counter() - started - captured
        return finished

    def _launch(self) -> None:
        """Start a decoding step for every busy slot: its inputs written, its graph replayed (on CUDA
        the host goes on while the device runs it; `step` reads what it drew)."""
        busy = np.array([request is not None for request in self.requests])
        needed = int(self.host_positions[busy].max()) + 1
        span = next(s for s in self.spans if s >= needed) if self.graphs.capture else needed
        sampled = bool((self.host_temperatures[busy] > 0).any())
        for static, host in ((self.tokens, self.host_tokens), (self.positions, self.host_positions),
                             (self.temperatures, self.host_temperatures)):
            static.copy_(torch.from_numpy(host))  # from pageable memory: read before copy_ returns
        self.graphs.run((span, sampled), lambda: self._decode(span, sampled), self.generator if sampled else None)
        self.launched = np.flatnonzero(busy), span

    def _finished(self, slots: np.ndarray) -> list[Answer]:
        """The answers of `slots` that have ended (their slots freed)."""
        counts = self.counts[slots]
        stopped = np.isin(self.answers[slots, counts - 1], self.stops)
        ended = stopped | (counts >= self.max_new_tokens)
        answers = []
        for slot, count, stop in zip(slots[ended].tolist(), counts[ended].tolist(), stopped[ended].tolist()):
            request, tokens = self.requests[slot], self.answers[slot, : count - 1 if stop else count].tolist()
            answers.append(Answer(request, tokens, "stop" if stop else "length"))
            self.book.hold(slot, request, request.ids + tokens[: count - 1])  # the answer's last token never ran
            self.requests[slot] = None
            self.host_tokens[slot], self.host_positions[slot], self.host_temperatures[slot] = 0, self.scratch, 0.0
        return answers


class KernelSlots(SlotDecoder):
    """A `SlotDecoder` through the CPU kernel's fused forward, for a target of specchat's quantized
    layers on a CPU (`specchat.decode.runtime.cpu_decoder`): a step runs each busy slot's token as a
    row of one call (`Decoder.forward_apart`: the rows share the products, each attends to its own
    slot's cache), and each prompt is prefilled alone into its slot (`Decoder.forward`, as a chat's
    prefill, from the first token the slot does not hold, as a chat reuses its cached prefix). Every
    row gets the bits decoding its sequence alone gives it, so a greedy answer is token for token what
    the chat's plain decoding of that target says, turn after turn. On two AVX-512 Xeon cores,
    32 slots of the 0.5B answered 203 tokens a second against 46 for `SlotDecoder` in bf16 (the
    shared training prompts, 2026-11-30): a row costs the kernel its int8 products over 5-bit weights,
    where torch reads every weight as two bytes. Since follow-ups reuse their slots and the kernel
    draws (`_draw`), 262 tokens a second against 172 (the same prompts, three minutes each)."""

    def _new_cache(self, slots: int, capacity: int) -> SlotCache:
        return SlotCache(self.forward, slots, capacity, apart=True)

    @torch.inference_mode()
    def _prefill(self, seats: list[Seat]) -> list[int]:
        first = []
        for slot, request, reused in seats:
            n = len(request.ids)
            inputs = self.forward.fused_inputs(torch.tensor(request.ids[reused:])[None], torch.arange(reused, n)[None])
            keys, values = self.cache.keys[slot], self.cache.values[slot]
            final, _ = self.forward.fused.forward(*inputs, keys, values, reused, None, [])
            first.append(int(self._draw(final[-1:], torch.tensor([request.temperature]))))
            self.times.prefills += 1
            self.times.prefill_tokens += n - reused
            self.times.prefill_positions += n - reused
        return first

    def _decode(self, span: int, sampled: bool) -> None:
        """One token for every busy slot (idle ones run no row)."""
        slots = torch.tensor([slot for slot, request in enumerate(self.requests) if request is not None])
        positions = self.positions[slots]
        inputs = self.forward.fused_inputs(self.tokens[slots][None], positions[None])
        final = self.forward.fused.forward_apart(*inputs, self.cache.keys, self.cache.values, slots, positions)
        self.drawn[slots] = self._draw(final, self.temperatures[slots])

    def _draw(self, final: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """The token each row draws at its temperature, as `draw`, in one call to the kernel's `sample`
        (kernels/layers.cpp): an argmax pass over a greedy row, three over a sampled one, where torch's
        passes for `draw` (a float32 copy, argmax, division, softmax, cumsum, each over every row) took
        a fifth of a step of 32 slots (a profile of a `data regenerate` run, 2026-11-30)."""
        uniforms = torch.rand(len(final), generator=self.generator)
        return torch.ops.specchat.sample(self.target.lm_head(final).contiguous(), temperatures.float(), uniforms)


def slot_decoder(target) -> type[SlotDecoder]:
    """The slot decoder for `target`'s forward: the kernel's fused one (`KernelSlots`), else torch's."""
    return KernelSlots if target.own_forward.fused is not None else SlotDecoder

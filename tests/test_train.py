"""`specchat train`: data shapes, loss masks, training-time test, and short real training runs."""

import json

import pytest
import torch

from conftest import load_tiny_target, random_head
from specchat.drafters import load_head
from specchat.train.unrolled import UnrolledKeys
from specchat.drafters.layers import HeadCache
from specchat.train.data import encode, read_conversations
from specchat.train.features import extract
from specchat.train.regenerate import regenerate
from specchat.train.trainer import TrainConfig, build_head, draft_vocabulary, sequence_loss, train


@pytest.fixture(scope="module")
def target(qwen_dir):
    model = load_tiny_target(qwen_dir)
    model.model.requires_grad_(False)
    return model


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_every_data_shape_is_read(tmp_path):
    sharegpt = json.dumps([{"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
                           {"conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}])
    truncated = sharegpt[: sharegpt.rindex('{"from": "gpt"') + 12]  # cut inside the second record
    files = [
        write(tmp_path, "sharegpt.json", sharegpt),
        write(tmp_path, "cut.json", truncated),
        write(tmp_path, "chat.jsonl", json.dumps({"messages": [{"role": "user", "content": "u"},
                                                                {"role": "assistant", "content": "a"}]})),
        write(tmp_path, "alpaca.json", json.dumps([{"instruction": "do", "input": "this", "output": "done"},
                                                    {"instruction": "do", "response": "gpteacher style"}])),
        write(tmp_path, "qa.jsonl", json.dumps({"question": "2+2?", "answer": "4"})),
        write(tmp_path, "prompts.jsonl", "\n".join([json.dumps({"turns": ["t1", "t2"]}), json.dumps({"prompt": "p"}),
                                                    json.dumps("bare"), json.dumps({"prompt": {"text": "oasst root"}})])),
    ]
    conversations, report = read_conversations(files)
    assert report.read == len(conversations) == 2 + 1 + 1 + 2 + 1 + 4
    assert report.truncated == ["cut.json"]
    alpaca = [c for c in conversations if c.source.startswith("alpaca")]
    assert alpaca[0].messages == [{"role": "user", "content": "do\n\nthis"}, {"role": "assistant", "content": "done"}]
    assert alpaca[1].messages[-1]["content"] == "gpteacher style"
    prompt_only = [c for c in conversations if not c.has_responses]
    assert sorted(c.messages[0]["content"] for c in prompt_only) == ["bare", "oasst root", "p", "t1"]


def test_malformed_records_are_skipped_counted_and_named(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]})
    lines = [good, '{"messages": [{"role": "robot", "content": "x"}]}', "{broken", json.dumps({"weird": 1}), good]
    conversations, report = read_conversations([write(tmp_path, "mixed.jsonl", "\n".join(lines))])
    assert len(conversations) == 2
    assert report.skipped == {"malformed message": 1, "broken JSON": 1, "unknown shape": 1}
    assert report.examples[0] == "mixed.jsonl:2: malformed message"
    assert "skipped" in report.summary()


def test_an_opening_greeting_without_a_prompt_is_dropped(tmp_path, tokenizer):
    record = {"conversations": [{"from": "system", "value": "S"}, {"from": "gpt", "value": "Hello!"},
                                {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    conversations, _ = read_conversations([write(tmp_path, "greeting.json", json.dumps([record]))])
    assert [m["role"] for m in conversations[0].messages] == ["system", "user", "assistant"]
    assert encode(conversations[0].messages, tokenizer, max_tokens=500) is not None


def test_loss_mask_covers_the_assistant_turns_only(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "ok"}]
    ids, mask = encode(messages, tokenizer, max_tokens=500)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "yo<|im_end|>\nok<|im_end|>\n"


def test_unrolled_steps_see_what_tree_nodes_see(target):
    """Training-time test step i at position t equals drafting a depth-i node under the context up to t."""
    head = random_head("eagle3", target, seed=5)
    torch.manual_seed(0)
    n, t = 9, 5
    features, tokens = torch.randn(n, head.fc.in_features), torch.randint(0, 250, (n + 3,))
    with torch.no_grad():
        keys = UnrolledKeys()
        positions = torch.arange(n)
        step0 = head(features, tokens[1 : n + 1], positions, None, keys)
        step1 = head(step0, tokens[2 : n + 2], positions + 1, None, keys)
        step2 = head(step1, tokens[3 : n + 3], positions + 2, None, keys)
        # Inference: context pass over positions 0..t, then a chain of two nodes under it.
        cache = HeadCache()
        causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None, None]
        context = head(features[: t + 1], tokens[1 : t + 2], positions[: t + 1], causal, cache)
        node1 = head(context[-1:], tokens[t + 2 : t + 3], torch.tensor([t + 1]),
                     torch.ones(1, 1, 1, t + 2, dtype=torch.bool), cache)
        node2 = head(node1, tokens[t + 3 : t + 4], torch.tensor([t + 2]),
                     torch.ones(1, 1, 1, t + 3, dtype=torch.bool), cache)
    torch.testing.assert_close(step0[t], context[-1])
    torch.testing.assert_close(step1[t], node1[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step2[t], node2[0], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def store(target, tmp_path_factory):
    from specchat.sampling import make_generator  # noqa: F401  (keeps the fixture order obvious)

    tokenizer = target.tokenizer
    torch.manual_seed(0)
    sequences = []
    for i in range(12):
        reply = "".join(chr(97 + (i * 7 + j) % 26) for j in range(40))
        sequences.append(encode([{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": reply}],
                                tokenizer, 200))
    return extract(tmp_path_factory.mktemp("features"), sequences, target, (2, 3, 3))


def test_extraction_resumes_after_an_interruption(target, store, tmp_path):
    sequences = [(store.sequence(i)["tokens"].tolist(), store.sequence(i)["mask"].long().tolist()) for i in range(4)]
    calls = []

    def interrupt_after_two(done, total):
        calls.append(done)
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract(tmp_path, sequences, target, None, progress=interrupt_after_two)
    resumed = extract(tmp_path, sequences, target, None, progress=lambda done, total: calls.append(done))
    assert calls == [1, 2, 3, 4] and len(resumed) == 4  # the resumed run did only the last two
    torch.testing.assert_close(resumed.sequence(3)["final"], store.sequence(3)["final"])


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "jakiro"])
def test_a_few_steps_reduce_the_loss_and_the_head_loads_back(kind, target, store, tmp_path):
    vocab, coverage = draft_vocabulary(store, 40, target.vocab_size)
    assert 0.5 < coverage <= 1
    config = TrainConfig(kind=kind, learning_rate=3e-3, warmup_steps=2, max_steps=25, batch_tokens=300,
                         ttt_steps=2, eval_every=25, eval_sequences=2, checkpoint_every=1000)
    head = build_head(kind, target, config, vocab)
    lm_rows = target.lm_head.weight[vocab].float()
    in_vocab = torch.zeros(target.vocab_size, dtype=torch.bool)
    in_vocab[vocab] = True

    def mean_loss():
        with torch.no_grad():
            return sum(float(sequence_loss(head, store.sequence(i), config, lm_rows, vocab, in_vocab)[0]) for i in range(10))

    before = mean_loss()
    state = train(head, target, store, list(range(10)), [10, 11], config, tmp_path / "run")
    after = mean_loss()
    assert after < 0.8 * before, (before, after)
    assert state.step == 25 and state.evaluations and len(state.evaluations[-1]["top1_by_step"]) == config.eval_steps
    from specchat.drafters import save_head

    save_head(head, tmp_path / "head")
    loaded = load_head(str(tmp_path / "head"), target)
    assert loaded.kind == kind and torch.equal(loaded.draft_to_target, head.draft_to_target)


def test_regeneration_answers_prompts_and_resumes(target, tmp_path):
    from specchat.chat import ChatFormat
    from specchat.train.data import TrainingConversation

    prompts = [TrainingConversation([{"role": "user", "content": f"prompt {i}"}], f"x#{i}") for i in range(5)]
    cache = tmp_path / "regenerated.jsonl"
    stop = ChatFormat(target.tokenizer).stop_ids
    seen = []
    first = regenerate(prompts, target, cache, batch_size=2, max_new_tokens=6, stop_ids=stop,
                       progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (5, 5) and len(first) <= 5
    assert all(c.messages[-1]["role"] == "assistant" for c in first)
    seen.clear()
    again = regenerate(prompts, target, cache, batch_size=2, max_new_tokens=6, stop_ids=stop,
                       progress=lambda done, total: seen.append((done, total)))
    assert seen == [] and [c.messages for c in again] == [c.messages for c in first]  # nothing was redone


def test_batched_extraction_equals_one_sequence_at_a_time(target, store, tmp_path):
    """Right-padded rows in one target forward give each sequence's own hidden states and argmax."""
    from specchat.cache import KVCache
    from specchat.train.features import batch_features

    ids = [store.sequence(i)["tokens"].tolist() for i in range(5)]
    ids[1], ids[3] = ids[1][:9], ids[3][:23]  # unequal lengths, so rows are padded
    layers = (2, 3, target.num_layers)
    batched = batch_features(target, ids, layers)
    for sequence, (features, argmax) in zip(ids, batched):
        alone = target.forward(torch.tensor([sequence]), KVCache(), logits_for="all", feature_layers=layers)
        torch.testing.assert_close(features, alone.features, rtol=1e-5, atol=1e-5)
        assert torch.equal(argmax, alone.logits.argmax(-1))
    # The store written in batches holds what one-at-a-time extraction wrote (within a bf16 rounding).
    sequences = [(s, [1] * len(s)) for s in ids]
    one_by_one = extract(tmp_path / "one", sequences, target, (2, 3), batch_tokens=1)
    together = extract(tmp_path / "batched", sequences, target, (2, 3), batch_tokens=4096)
    for i in range(len(ids)):
        a, b = one_by_one.sequence(i), together.sequence(i)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["argmax"], b["argmax"])
        for key in ("final", "aux"):
            torch.testing.assert_close(a[key].float(), b[key].float(), rtol=1e-2, atol=1e-2)


def test_checkpoint_files_stay_under_the_shard_size_and_round_trip(tmp_path):
    from specchat.train import checkpoint

    torch.manual_seed(0)
    tensors = {"big": torch.randn(300, 200), "small": torch.randn(7), "ids": torch.arange(5000),
               "flags": torch.rand(4000) > 0.5}
    meta = checkpoint.save(tmp_path, tensors, {"state": {"step": 3}}, shard_bytes=128 * 1024)
    files = [tmp_path / name for name in meta["files"]]
    assert len(files) > 2 and all(path.stat().st_size <= 128 * 1024 for path in files)
    loaded = checkpoint.load(tmp_path)
    assert all(torch.equal(loaded.tensors[k], v) for k, v in tensors.items())
    checkpoint.save(tmp_path, tensors, {"state": {"step": 4}}, shard_bytes=128 * 1024)  # replaces the first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoint.json"] + checkpoint.load(tmp_path).meta["files"])
    # The compact second moment: 8-bit log2 codes per block; values spanning 20 octaves come back
    # within 2^(20/508) - 1 = 2.8%, zeros exactly.
    values = torch.exp2(torch.rand(10000) * 20 - 30) * (torch.rand(10000) > 0.1)
    codes, ranges = checkpoint.encode_log8(values)
    decoded = checkpoint.decode_log8(codes, ranges, values.shape)
    assert codes.dtype == torch.uint8 and torch.equal(decoded == 0, values == 0)
    torch.testing.assert_close(decoded, values, rtol=0.03, atol=0)

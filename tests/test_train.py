"""`specchat train`: data shapes, loss masks, training-time test, and short real training runs."""

import json

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import invoke, load_tiny_target, random_head
from drafters import load_head
from specchat.train.unrolled import UnrolledKeys
from drafters.cache import HeadCache
from specchat.train.data import encode, read_conversations
from specchat.train.features import extract
from specchat.train.batches import host_batch, to_device
from specchat.train.losses import batch_loss, evaluation_sums
from specchat.train.trainer import TrainConfig, build_head, draft_vocabulary, train


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


def test_many_conversations_are_encoded_on_every_core_as_one_process_would(tokenizer, monkeypatch):
    from specchat.train import data

    conversations = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a" * i},
                      {"role": "user", "content": "and?"}, {"role": "assistant", "content": f"then {i}"}]
                     for i in range(1, 7)]
    alone = [encode(messages, tokenizer, 40) for messages in conversations]
    monkeypatch.setattr(data, "ENCODE_CHUNK", 3)
    monkeypatch.setattr(data.os, "cpu_count", lambda: 2)
    assert data.encode_all(conversations, tokenizer, 40) == alone and None not in alone


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

    def loss_of(i):
        host = host_batch(store, [[i]], config.steps_unrolled(), head.reads_fused_features, in_vocab.numpy(),
                          head.predicts_two_ahead)
        loss = batch_loss(head, to_device(host, target.device), lm_rows, vocab).loss
        return 0.0 if loss is None else float(loss)  # None: no position of the sequence is scored

    def mean_loss():
        with torch.no_grad():
            return sum(loss_of(i) for i in range(10))

    before = mean_loss()
    state = train(head, target, store, list(range(10)), [10, 11], config, tmp_path / "run")
    after = mean_loss()
    assert after < 0.8 * before, (before, after)
    assert state.step == 25 and state.evaluations and len(state.evaluations[-1]["top1_by_step"]) == config.eval_steps
    from drafters import save_head

    save_head(head, tmp_path / "head")
    loaded = load_head(str(tmp_path / "head"), target)
    assert loaded.kind == kind and torch.equal(loaded.draft_to_target, head.draft_to_target)


def test_a_jsonl_record_holding_a_unicode_line_separator_is_one_record(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028, U+0085 and U+001C raw; str.splitlines() splits at
    # them, which cut such records in two ("broken JSON") and made regeneration redo their prompts.
    texts = ["a\u2028b", "c\x85d", "e\x1cf", "g\u2029h"]
    lines = [json.dumps({"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t}]},
                        ensure_ascii=False) for t in texts]
    conversations, report = read_conversations([write(tmp_path, "odd.jsonl", "\r\n".join(lines))])
    assert report.skipped == {} and [c.messages[0]["content"] for c in conversations] == texts

# ---------------------------------------------------------------------------------------------
# Batches, devices, checkpoints


@pytest.fixture(scope="module")
def varied(target, tmp_path_factory):
    """Features of 12 conversations of 30 to 110 tokens, so batched rows get padded."""
    sequences = []
    for i in range(12):
        reply = "".join(chr(97 + (i * 5 + j) % 26) for j in range(5 + (i * 37) % 80))
        sequences.append(encode([{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": reply}],
                                target.tokenizer, 200))
    return extract(tmp_path_factory.mktemp("varied"), sequences, target, (2, 3, 3))


def test_batched_extraction_equals_one_sequence_at_a_time(target, store, tmp_path):
    """Right-padded rows in one target forward give each sequence's own hidden states and argmax."""
    from specchat.train.features import batch_features

    ids = [store.sequence(i)["tokens"].tolist() for i in range(5)]
    ids[1], ids[3] = ids[1][:9], ids[3][:23]  # unequal lengths, so rows are padded
    layers = (2, 3, target.num_layers)
    batched = batch_features(target, ids, layers)
    for sequence, (features, argmax) in zip(ids, batched):
        alone = target.forward(torch.tensor([sequence]), target.new_cache(), logits_for="all", feature_layers=layers)
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


def test_batched_training_time_test_equals_one_sequence_at_a_time(target, varied):
    """Rows of different lengths, padded into one flattened batch, see only their own row."""
    from specchat.train.losses import unrolled_outputs

    head = random_head("eagle3", target, seed=3)
    ids = [0, 4, 7]
    single = []
    with torch.no_grad():
        for i in ids:
            host = host_batch(varied, [[i]], 3, True, None, False)
            single.append([out for out, _ in unrolled_outputs(head, to_device(host, target.device), 3)])
        host = host_batch(varied, [[i] for i in ids], 3, True, None, False)
        assert host.width > min(len(varied.sequence(i)["tokens"]) for i in ids)  # padding happened
        together = [out for out, _ in unrolled_outputs(head, to_device(host, target.device), 3)]
    for row, i in enumerate(ids):
        n = len(varied.sequence(i)["tokens"])
        for step in range(3):
            # Positions whose unrolled inputs stay inside the sequence (later ones repeat its last token).
            usable = n - 1 - step
            mine = together[step][row * host.width : row * host.width + usable]
            torch.testing.assert_close(mine, single[row][step][:usable], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "jakiro"])
def test_a_packed_batch_has_the_loss_of_the_unpacked_one(kind, target, varied, monkeypatch):
    """Four conversations packed two to a row give the loss, the scored positions and the hits of the
    same conversations one per padded row: attention and positions stay within each conversation."""
    head = random_head(kind, target, seed=4)
    monkeypatch.setattr(type(head), "feature_noise", 0.0)  # the noise is drawn per position of the layout
    vocab = head.draft_to_target  # None: the head drafts over the whole vocabulary
    in_vocab = torch.zeros(target.vocab_size, dtype=torch.bool)
    in_vocab[vocab if vocab is not None else slice(None)] = True
    lm_rows = (target.lm_head.weight[vocab] if vocab is not None else target.lm_head.weight).float()
    results = []
    with torch.no_grad():
        for rows in ([[0, 4], [7, 2]], [[0], [4], [7], [2]]):
            host = host_batch(varied, rows, 3, head.reads_fused_features, in_vocab.numpy(), head.predicts_two_ahead)
            results.append((host.rows * host.width, batch_loss(head, to_device(host, target.device), lm_rows, vocab)))
    (packed_size, packed), (padded_size, padded) = results
    assert packed_size < padded_size
    assert packed.counts == padded.counts and all(c > 0 for c in packed.counts)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-5, atol=1e-6)
    assert [int(h) for h in packed.hits] == [int(h) for h in padded.hits]


def test_live_features_are_the_stored_ones_and_train(target, varied):
    """The target's features computed per packed batch on the device (no files) equal the extracted
    ones (within their bf16 rounding), choose the same positions, and a head trains on them."""
    from specchat.train.features import LiveFeatures

    sequences = [(varied.sequence(i)["tokens"].tolist(), varied.sequence(i)["mask"].long().tolist())
                 for i in range(len(varied))]
    live = LiveFeatures(sequences, target, (2, 3, 3))
    assert list(live.lengths()) == list(varied.lengths())
    rows = [[0, 4, 5], [7, 2]]
    stored = to_device(host_batch(varied, rows, 2, True, None, False, evaluation=True), target.device)
    computed = to_device(host_batch(live, rows, 2, True, None, False, evaluation=True), target.device, live)
    real = stored.documents >= 0
    assert torch.equal(stored.argmax[real], computed.argmax[real])
    assert all(torch.equal(a.where, b.where) and torch.equal(a.target, b.target)
               for a, b in zip(stored.steps, computed.steps))
    assert all(torch.equal(a, b) for a, b in zip(stored.valid + stored.follows, computed.valid + computed.follows))
    for name in ("features", "final"):
        torch.testing.assert_close(getattr(computed, name)[real].float(), getattr(stored, name)[real].float(),
                                   rtol=1e-2, atol=1e-2)
    vocab, _ = draft_vocabulary(live, 40, target.vocab_size)
    config = TrainConfig(kind="eagle3", warmup_steps=1, max_steps=3, batch_tokens=300, batch_size=2, ttt_steps=2,
                         eval_every=3, eval_sequences=2, checkpoint_every=1000)
    state = train(build_head("eagle3", target, config, vocab), target, live, list(range(10)), [10, 11], config, None)
    assert state.step == 3 and state.evaluations[-1]["tau"] >= 1


class OneDevicePerOp(TorchDispatchMode):
    """Fails every op whose tensors are on different devices, as CUDA does: a 0-dim CPU tensor may
    join any op, and CPU index tensors may index a tensor on the device, nothing else. Moves between
    devices (`.to`) are the explicit placements."""

    MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten._copy_from.default,
             torch.ops.aten._copy_from_and_resize.default}
    INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                torch.ops.aten._index_put_impl_.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.MOVES:
            checked = list(args)
            if func in self.INDEXING and args and args[0].device.type != "cpu":
                checked[1] = [i for i in args[1] if i is None or i.device.type != "cpu"]
            tensors = [t for t in pytree.tree_leaves((checked, kwargs)) if isinstance(t, torch.Tensor)]
            devices = {str(t.device) for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                raise RuntimeError(f"{func} mixes devices {sorted(devices)}")
        return func(*args, **kwargs)


def on_device(target, device: str):
    """The same target with every weight on `device` (the meta device holds no data: shapes only)."""
    import copy

    from specchat.decode.runtime.target import Target

    return Target(copy.deepcopy(target.model).to(device), target.tokenizer, target.name)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "jakiro"])
def test_training_keeps_every_tensor_on_the_targets_device(kind, target, varied):
    """The whole loop (head built, batches read from the CPU store, losses, backward, AdamW) with the
    target on another device than the store: the meta device, under a check that fails any op that
    mixes devices. No GPU needed, and the loop may not wait on a value: meta tensors have none."""
    meta = on_device(target, "meta")
    with OneDevicePerOp(), pytest.raises(RuntimeError, match="mixes devices"):
        torch.ones(3, device="meta") @ torch.ones(3)  # the check is live
    vocab, _ = draft_vocabulary(varied, 40, target.vocab_size)
    config = TrainConfig(kind=kind, warmup_steps=1, max_steps=2, batch_tokens=200, batch_size=3, ttt_steps=2,
                         checkpoint_every=1000)
    with OneDevicePerOp():
        head = build_head(kind, meta, config, vocab)
        assert {p.device.type for p in head.parameters()} == {"meta"}
        assert head.draft_to_target.device.type == "meta"
        state = train(head, meta, varied, list(range(10)), [], config, None, draft_vocab=vocab)
        host = host_batch(varied, [[10], [11]], 2, head.reads_fused_features, None, False, evaluation=True)
        hits, accepted = evaluation_sums(head, to_device(host, meta.device), head.draft_to_target)
    assert state.step == 2 and hits.device.type == accepted.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "jakiro"])
def test_training_on_cuda(kind, target, store, tmp_path, monkeypatch):
    """The real thing: the target on the GPU, the store on the CPU; train, evaluate, checkpoint, resume;
    every attention with cuDNN's SDPA off (`losses.TRAINING_SDPA`)."""
    cudnn_on, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def noting_the_backend(*args, **kwargs):
        cudnn_on.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", noting_the_backend)
    gpu = on_device(target, "cuda")
    vocab, _ = draft_vocabulary(store, 40, target.vocab_size)
    config = TrainConfig(kind=kind, learning_rate=3e-3, warmup_steps=2, max_steps=6, batch_tokens=300,
                         batch_size=4, ttt_steps=2, eval_every=3, eval_sequences=2, checkpoint_every=3)
    head = build_head(kind, gpu, config, vocab)
    assert {p.device.type for p in head.parameters()} == {"cuda"}
    state = train(head, gpu, store, list(range(10)), [10, 11], config, tmp_path / "run")
    assert state.step == 6 and state.evaluations and state.evaluations[-1]["tau"] >= 1
    resumed = build_head(kind, gpu, config, vocab)
    again = train(resumed, gpu, store, list(range(10)), [10, 11], TrainConfig(**{**config.__dict__, "max_steps": 8}),
                  tmp_path / "run", resume=True)
    assert again.step == 8
    assert cudnn_on and not any(cudnn_on)


def weights(head):
    return {k: v.detach().clone() for k, v in head.trainable_state_dict().items()}


@pytest.mark.parametrize("kind,batch_size", [("eagle", 1), ("eagle3", 3)])
def test_resuming_continues_bit_for_bit(kind, batch_size, target, varied, tmp_path):
    """6 steps in one go == 3 steps, an interruption, then --resume for the other 3 (exact checkpoint:
    weights, AdamW state, RNG states (EAGLE's feature noise draws on them) and the data position)."""
    vocab, _ = draft_vocabulary(varied, 40, target.vocab_size)
    config = TrainConfig(kind=kind, learning_rate=3e-3, warmup_steps=2, max_steps=6, epochs=1, batch_tokens=200,
                         batch_size=batch_size, ttt_steps=2, eval_every=2, eval_sequences=2, checkpoint_every=3,
                         checkpoint_precision="exact")
    whole = build_head(kind, target, config, vocab)
    straight = train(whole, target, varied, list(range(10)), [10, 11], config, tmp_path / "straight")

    def interrupt_at_four(state, *_):
        if state.step == 4:
            raise KeyboardInterrupt

    first = build_head(kind, target, config, vocab)
    with pytest.raises(KeyboardInterrupt):
        train(first, target, varied, list(range(10)), [10, 11], config, tmp_path / "pieces", progress=interrupt_at_four)
    second = build_head(kind, target, config, vocab)
    resumed = train(second, target, varied, list(range(10)), [10, 11], config, tmp_path / "pieces", resume=True)
    assert resumed.step == straight.step == 6 and resumed.tokens_seen == straight.tokens_seen
    assert resumed.evaluations == straight.evaluations
    a, b = weights(whole), weights(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def checkpointed_eagle3(target, store, folder, **changes):
    """An EAGLE-3 head trained a few steps on `store` into `folder`, checkpointing as `changes` say."""
    vocab, _ = draft_vocabulary(store, 40, target.vocab_size)
    config = TrainConfig(kind="eagle3", learning_rate=3e-3, batch_tokens=200, ttt_steps=2, **changes)
    head = build_head("eagle3", target, config, vocab)
    train(head, target, store, list(range(10)), [], config, folder)
    return head, config, vocab


def test_a_compact_checkpoint_resumes_close_by_and_small(target, store, tmp_path):
    from specchat.train import checkpoint

    head, config, vocab = checkpointed_eagle3(target, store, tmp_path / "run", warmup_steps=2, max_steps=4,
                                              checkpoint_every=2, checkpoint_precision="compact")
    meta = json.loads((tmp_path / "run" / "checkpoint" / "checkpoint.json").read_text())
    assert meta["precision"] == "compact" and meta["state"]["step"] == 4
    assert meta["bytes"] < 3.5 * checkpoint.parameter_count(head) + 64 * 1024
    loaded = build_head("eagle3", target, config, vocab)
    again = train(loaded, target, store, list(range(10)), [], TrainConfig(**{**config.__dict__, "max_steps": 4}),
                  tmp_path / "run", resume=True)
    assert again.step == 4  # nothing left to do: the weights are the checkpoint's
    for key, value in weights(head).items():
        if value.is_floating_point():
            torch.testing.assert_close(weights(loaded)[key], value, rtol=1e-2, atol=1e-3)


def test_a_checkpoint_whose_head_weights_do_not_fit_is_refused(target, store, tmp_path):
    """Resuming loads the head's weights strictly: an extra key or another shape is said, not skipped."""
    import dataclasses

    from specchat.train import checkpoint

    head, _, _ = checkpointed_eagle3(target, store, tmp_path / "run", warmup_steps=1, max_steps=1,
                                     checkpoint_every=1, checkpoint_precision="exact")
    loaded = checkpoint.load(tmp_path / "run" / "checkpoint")
    names = [name for name, _ in head.named_parameters() if _.requires_grad]
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad])
    checkpoint.restore(loaded, head, optimizer, names, torch.device("cpu"))  # as saved: fits
    weight = next(key for key in loaded.tensors if key.startswith("head/") and loaded.tensors[key].dim() == 2)
    for tensors, said in ((loaded.tensors | {"head/extra.weight": torch.zeros(2)}, "unexpected key extra.weight"),
                          (loaded.tensors | {weight: loaded.tensors[weight][:-1]}, "has shape")):
        with pytest.raises(checkpoint.ResumeError, match=said):
            checkpoint.restore(dataclasses.replace(loaded, tensors=tensors), head, optimizer, names, torch.device("cpu"))


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


def test_the_simulated_tau_of_an_oracle_head_is_its_chain_length(bigram_dir, tmp_path):
    """A head that always drafts the target's greedy token, on the target's own greedy text: every
    draft is accepted, so tau is 1 + the number of chain steps that stay inside the answer."""
    from conftest import oracle_head

    from specchat.train.losses import evaluate

    bigram = load_tiny_target(bigram_dir)
    sequences = []
    for start in (5, 17, 40):
        prompt = [256 + 1, start, start + 1]  # any ids; the bigram target continues from the last one
        ids = bigram.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0].tolist()
        sequences.append((ids, [0] * len(prompt) + [1] * (len(ids) - len(prompt))))
    store = extract(tmp_path / "features", sequences, bigram, None)
    head = oracle_head(bigram)
    result = evaluate(head, store, [0, 1, 2], None, bigram.device, rows=2, steps=3, batch_tokens=1000)
    assert result["top1_by_step"] == [1.0, 1.0, 1.0]
    host = host_batch(store, [[0], [1], [2]], 3, False, None, False, evaluation=True)
    chain_lengths = sum(host.valid[0] & host.valid[1] & host.valid[2]) * 3 + \
        sum(host.valid[0] & host.valid[1] & ~host.valid[2]) * 2 + sum(host.valid[0] & ~host.valid[1])
    assert result["tau"] == round(1 + chain_lengths / host.valid[0].sum(), 4)


def test_training_has_no_per_format_branches():
    """Recipes are the head classes' attributes; the kind string is only an option value and a record field."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "specchat"
    sources = [p.read_text() for p in (root / "train").glob("*.py")] + [(root / "cli" / "heads.py").read_text()]
    pattern = re.compile(r"kind\s*[!=]=|[!=]=\s*['\"](eagle3?|jakiro)['\"]|in \(['\"](eagle3?|jakiro)['\"]")
    assert not [m.group(0) for text in sources for m in pattern.finditer(text)]


@pytest.mark.parametrize("option, value", [("--eval-every", "0"), ("--checkpoint-every", "0"), ("--limit", "-1"),
                                           ("--batch-tokens", "0"), ("--held-out", "1"), ("--epochs", "0")])
def test_train_refuses_values_it_cannot_train_with_before_loading(option, value, tmp_path, capsys):
    """A count, interval or share out of range is a usage error at once, not a crash after the model loads."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    code, _, err = invoke(["train", "--kind", "eagle3", "--data", str(data), "-o", str(tmp_path / "head"), option, value],
                          capsys)
    assert code == 2 and option in err and "Traceback" not in err, err


def test_the_train_command_and_its_options_agree():
    """Every option of `specchat train` is a TrainOptions field with the field's default, and every field an option."""
    import dataclasses

    from specchat.cli import cli
    from specchat.train.options import TrainOptions

    params = {p.name: p for p in cli.commands["train"].params}
    fields = {f.name: f for f in dataclasses.fields(TrainOptions)}
    assert params.keys() == fields.keys()
    for name, field in fields.items():
        if field.default is dataclasses.MISSING:
            assert params[name].required, name
        else:
            assert params[name].default == field.default, name


def test_the_command_stops_at_its_time_limit_and_resumes(qwen_dir, tmp_path, capsys):
    """`specchat train` in pieces: --max-minutes stops with a checkpoint, the same command with
    --resume finishes; the output is the head with the best simulated tau, recorded in training.json."""

    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                      {"role": "assistant", "content": "answer " + "xyz" * (3 + i % 5)}]})
             for i in range(10)]
    data = write(tmp_path, "chat.jsonl", "\n".join(lines))
    out = tmp_path / "head"
    args = ["train", "--kind", "eagle3", "--data", data, "--model", str(qwen_dir), "--dtype", "float32", "--device", "cpu",
            "-o", str(out), "--work-dir", str(tmp_path / "work"), "--max-steps", "4", "--batch-tokens", "120",
            "--batch-size", "2", "--ttt-steps", "2", "--draft-vocab", "40", "--held-out", "0.2", "--eval-every", "2",
            "--warmup", "1", "--resume"]
    code, _, err = invoke(args + ["--max-minutes", "0.0001"], capsys)
    assert code == 0, err
    assert "no checkpoint" in err and "stopped at step 1 by the time limit" in err
    assert json.loads((out / "checkpoint" / "checkpoint.json").read_text())["state"]["step"] == 1
    code, _, err = invoke(args, capsys)
    assert code == 0, err
    assert "resumed from" in err and "at step 1/4" in err and "simulated tau" in err
    record = json.loads((out / "training.json").read_text())
    assert record["finished"] and record["steps"] == 4 and record["hyperparameters"]["batch_size"] == 2
    code, _, err = invoke([a for a in args if a != "--resume"] + ["--max-minutes", "0.0001"], capsys)
    assert code == 0 and "starting at step 0: this run's checkpoints replace the one" in err
    taus = [e["tau"] for e in record["held_out_top1"]]
    assert len(taus) == 2 and record["selected"]["tau"] == max(taus)
    assert load_head(str(out), load_tiny_target(qwen_dir)).kind == "eagle3"


def test_a_trace_says_where_a_steps_time_goes(qwen_dir, tmp_path, capsys, monkeypatch):
    """`train --trace DIR`: the profiler's summary table of TRACE_STEPS optimizer steps after the
    first TRACE_AFTER, and training.json's step_phases (each phase's seconds, their
    shares, tokens per second); a run that ends first writes what it traced."""
    from specchat.train.trainer import TRACE_AFTER, TRACE_STEPS, StepTrace

    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                      {"role": "assistant", "content": "answer " + "xyz" * (3 + i % 5)}]})
             for i in range(10)]
    data = write(tmp_path, "chat.jsonl", "\n".join(lines))
    common = ["train", "--kind", "eagle3", "--data", data, "--model", str(qwen_dir), "--dtype", "float32",
              "--device", "cpu", "--work-dir", str(tmp_path / "work"), "--batch-tokens", "120", "--ttt-steps", "2",
              "--draft-vocab", "40", "--held-out", "0.2", "--eval-every", "100", "--warmup", "1"]
    for steps, traced in ((TRACE_AFTER + TRACE_STEPS + 1, TRACE_STEPS), (TRACE_AFTER + 1, 1)):
        out, trace = tmp_path / f"head{steps}", tmp_path / f"trace{steps}"
        code, _, err = invoke(common + ["-o", str(out), "--max-steps", str(steps), "--trace", str(trace)], capsys)
        assert code == 0, err
        assert sorted(p.name for p in trace.iterdir()) == ["train-summary.txt"]
        assert "Self CPU" in (trace / "train-summary.txt").read_text()
        phases = json.loads((out / "training.json").read_text())["step_phases"]
        assert phases["steps"] == traced and phases["after_steps"] == TRACE_AFTER and phases["tokens"] > 0
        assert phases["passes"] >= traced and 0 <= phases["padding"] < 1
        assert set(phases["seconds"]) == set(StepTrace.PHASES) and all(s > 0 for s in phases["seconds"].values())
        assert abs(sum(phases["shares"].values()) - 1) < 0.01 and phases["tokens_per_second"] > 0
        assert phases["profiler_failure"] is None
    code, _, err = invoke(common + ["-o", str(tmp_path / "untraced"), "--max-steps", "2"], capsys)
    assert code == 0 and json.loads((tmp_path / "untraced" / "training.json").read_text())["step_phases"] is None
    # a profiler that cannot start (CUPTI busy on a GPU) is said, and training and the phases go on
    from specchat import tracing

    def refuse(self):
        raise RuntimeError("CUPTI busy")

    monkeypatch.setattr(tracing.Profiler, "start", refuse)
    steps = TRACE_AFTER + TRACE_STEPS
    code, _, err = invoke(common + ["-o", str(tmp_path / "refused"), "--max-steps", str(steps), "--trace",
                                    str(tmp_path / "refused-trace")], capsys)
    record = json.loads((tmp_path / "refused" / "training.json").read_text())
    assert code == 0 and record["steps"] == steps and not (tmp_path / "refused-trace").exists()
    assert record["step_phases"]["profiler_failure"] == "the profiler did not start: CUPTI busy"
    assert record["step_phases"]["steps"] == TRACE_STEPS and record["step_phases"]["tokens_per_second"] > 0


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])  # an EAGLE head shares the target's LM head too
def test_training_can_start_from_a_head(kind, qwen_dir, tmp_path, capsys):
    """--init HEAD: its weights and draft vocabulary are where training starts (at a learning rate
    of 0 they come out as they went in), training.json says so, and a size that contradicts the
    head is a one-line usage error."""
    from safetensors.torch import load_file

    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                      {"role": "assistant", "content": "answer " + "xyz" * (3 + i % 5)}]})
             for i in range(10)]
    data = write(tmp_path, "chat.jsonl", "\n".join(lines))
    common = ["train", "--kind", kind, "--data", data, "--model", str(qwen_dir), "--dtype", "float32",
              "--device", "cpu", "--work-dir", str(tmp_path / "work"), "--max-steps", "2", "--batch-tokens", "120",
              "--ttt-steps", "2", "--held-out", "0.2", "--eval-every", "2", "--warmup", "1"]
    code, _, err = invoke(common + ["-o", str(tmp_path / "first"), "--draft-vocab", "40"], capsys)
    assert code == 0, err
    code, _, err = invoke(common + ["-o", str(tmp_path / "second"), "--init", str(tmp_path / "first"), "--lr", "0"],
                          capsys)
    assert code == 0, err
    assert f"starting from {tmp_path / 'first'}: its draft vocabulary of 40 tokens" in err
    first, second = load_file(tmp_path / "first" / "model.safetensors"), load_file(tmp_path / "second" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((tmp_path / "second" / "training.json").read_text())["initialized_from"] == str(tmp_path / "first")
    code, _, err = invoke(common + ["-o", str(tmp_path / "third"), "--init", str(tmp_path / "first"),
                                    "--draft-vocab", "50"], capsys)
    assert code == 2 and "--draft-vocab 50 differs" in err.strip().splitlines()[-1], err

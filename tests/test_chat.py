"""Chat templates, end-of-turn tokens and streaming detokenization."""

import pytest

from specchat.chat import ChatFormat, Conversation, TemplateError


def test_stop_ids_come_from_the_vocabulary(tokenizer):
    fmt = ChatFormat(tokenizer)
    vocab = tokenizer.get_vocab()
    assert fmt.stop_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}

    class Slow:  # transformers' slow tokenizers have no tokenizers backend: their vocabulary is read whole
        chat_template, eos_token_id = tokenizer.chat_template, None

        def get_vocab(self):
            return vocab

    assert ChatFormat(Slow()).stop_ids == fmt.stop_ids


def test_prompt_ids_follow_the_template(tokenizer):
    conversation = Conversation(system="Be brief.")
    conversation.add_user("hi")
    text = tokenizer.decode(ChatFormat(tokenizer).prompt_ids(conversation))
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_without_template_is_a_clear_error(tokenizer):
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(TemplateError, match="no chat template"):
        ChatFormat(bare)


def test_streamed_pieces_add_up_to_the_text_even_across_split_characters(tokenizer):
    text = "naïve café 😀 → ok"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    decoder = ChatFormat(tokenizer).decoder()
    pieces = [decoder.push([token]) for token in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text == decoder.text
    assert all("\ufffd" not in piece for piece in pieces)


def test_streamed_reply_text_equals_the_reply(tokenizer):
    """What a consumer concatenates from the stream is exactly the answer kept in the conversation,
    even when the reply ends inside a multi-byte character (here: cut by the token budget)."""
    from specchat.decode.engine.engine import GenerationSettings, StepResult
    from specchat.chat import ChatSession

    emoji = tokenizer.encode("ok 😀", add_special_tokens=False)

    class StubEngine:  # replays fixed steps: 2 tokens, then 2 more ending mid-character
        max_context = 512

        def generate(self, prompt, settings, rng, prediction=None):
            yield StepResult(tokens=emoji[:2], drafted=[False, False], seconds=0.1)
            yield StepResult(tokens=emoji[2:5], drafted=[True, True, False], seconds=0.1, finish_reason="length")

    session = ChatSession(StubEngine(), ChatFormat(tokenizer), GenerationSettings())
    streamed = "".join(event.text for event in session.reply("hi"))
    assert streamed == session.conversation.messages[-1]["content"] == tokenizer.decode(emoji[:5])


def test_builtin_template_for_tokenizers_without_one(tokenizer):
    from specchat.chat import resolve_template

    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    conversation = Conversation()
    conversation.add_user("hi")
    conversation.add_assistant("hello")
    conversation.add_user("bye")
    text = bare.decode(ChatFormat(bare, template=resolve_template("vicuna")).prompt_ids(conversation))
    assert text.startswith("A chat between a curious user and an artificial intelligence assistant.")
    assert text.endswith("USER: hi ASSISTANT: hello</s>USER: bye ASSISTANT:")
    with pytest.raises(TemplateError, match="not a built-in template"):
        resolve_template("/no/such/template.jinja")

"""This user's earlier answers as a lookup source (`--answer-index`): kept, bounded, and never drafted
from while their own prompt is answered."""

import random

from conftest import invoke
from specchat import answers as answers_mod
from specchat.answers import AnswerStore, tokenizer_key
from specchat.cli import open_chat, resolve_settings
from specchat.decode.drafting.lookup import OCCURRENCES, EarlierAnswers, LookupSource, NgramIndex, prompt_key


def test_the_store_keeps_answers_and_lets_the_oldest_go_past_its_bound(tmp_path, monkeypatch):
    store = AnswerStore(tmp_path / "answers")
    assert store.load() == []
    store.add([1, 2], [10, 11, 12])
    store.add([3], [20, 21])
    assert store.load() == [(prompt_key([1, 2]), [10, 11, 12]), (prompt_key([3]), [20, 21])]
    monkeypatch.setattr(answers_mod, "ANSWER_TOKENS", 8)
    store.add([4], [30, 31, 32, 33])  # 9 tokens > 8: the newest that fit in 4 stay
    assert store.load() == [(prompt_key([4]), [30, 31, 32, 33])]
    store.add([5], [40])
    assert [tokens for _, tokens in AnswerStore(tmp_path / "answers").load()] == [[30, 31, 32, 33], [40]]


def test_an_answer_cut_short_by_a_crash_is_not_read(tmp_path):
    store = AnswerStore(tmp_path / "answers")
    store.add([1], [10, 11, 12])
    with open(store.records_path, "a") as records:
        records.write('{"prompt": "x", "start": 3, "length": 5, "time": 0}\n')  # its tokens never written
    assert store.load() == [(prompt_key([1]), [10, 11, 12])]


def test_an_earlier_answer_is_found_cut_at_its_end_and_left_out_for_its_own_prompt():
    earlier = EarlierAnswers([(prompt_key([7, 7]), [1, 2, 3, 4, 5]), (prompt_key([8]), [6, 6, 6])], ngram=2)
    source = LookupSource(max_ngram=2, earlier=earlier)
    source.observe([9, 9, 2])
    assert [match.tokens for match in source.matches(root=3, limit=8)] == [[4, 5]]  # not into the next answer
    source.forget()
    source.prompted([7, 7])  # a reply to the prompt [7, 7] follows: its earlier answer is not looked at
    source.observe([9, 2])
    assert source.matches(root=3, limit=8) == []
    source.forget()
    source.prompted([7, 8])
    source.observe([2])
    assert source.matches(root=3, limit=8)[0].tokens == [4, 5]


def test_earlier_answers_sorted_as_numbers_find_what_the_dictionary_finds():
    """The earlier answers' n-grams are numbers in a sorted list (fast to build at every start); a
    lookup there finds the occurrences, the continuations and the left-out answers the chat's own
    dictionary index finds, frequent n-grams (past OCCURRENCES) and ids of 21 bits included."""
    rng = random.Random(0)
    vocabulary = [0, 1, 2, 3, 151_935, (1 << 21) - 1]  # few ids: n-grams recur, many past OCCURRENCES times
    weights = [8, 1, 1, 1, 1, 1]  # 0 0 0 recurs most
    answers = [(prompt_key([i % 5]), rng.choices(vocabulary, weights, k=rng.randint(0, 60))) for i in range(40)]
    for ngram in (1, 2, 3):
        earlier = EarlierAnswers(answers, ngram)
        assert earlier.keys is not None and not earlier.ends
        dictionary = NgramIndex(ngram, ngram)
        dictionary.extend(earlier.tokens)
        assert max(map(len, dictionary.ends.values())) > OCCURRENCES + 1
        for _ in range(300):
            tail = [rng.choice(vocabulary + [7]) for _ in range(rng.randint(1, 20))]  # 7: never stored
            assert earlier.occurrences(tail) == NgramIndex.occurrences(dictionary, tail)
            for _, end in earlier.occurrences(tail):
                assert earlier.follow(end, 8) == dictionary.follow(end, 8)[: len(earlier.follow(end, 8))]
        earlier.leave_out(prompt_key([2]))
        assert all(earlier._answer(end) % 5 != 2 for tail in ([0], [1, 2], [3, 3, 3]) for _, end in earlier.occurrences(tail))
    wide = EarlierAnswers(answers, 4)  # four ids do not fit in one number: the dictionary
    assert wide.keys is None and wide.occurrences([0, 1, 2, 3]) == NgramIndex.occurrences(wide, [0, 1, 2, 3])


class Fake:
    def __init__(self, ids, size):
        self.ids, self.size = ids, size

    def __len__(self):
        return self.size

    def encode(self, text):
        return self.ids


def test_each_tokenizer_has_its_own_store():
    assert tokenizer_key(Fake([1, 2, 3], 100)) == tokenizer_key(Fake([1, 2, 3], 100))
    assert tokenizer_key(Fake([1, 2, 3], 100)) != tokenizer_key(Fake([1, 2, 3], 101))
    assert tokenizer_key(Fake([1, 2, 3], 100)) != tokenizer_key(Fake([1, 2, 4], 100))


def lookup_tokens(model_dir, prompt: str, answer_index: str, by_default: bool = True) -> tuple[int, list[int]]:
    """Tokens lookup drafted and had accepted in a pld reply to `prompt`, and the reply."""
    options = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "max_new_tokens": 24,
               "method": "pld", "answer_index": answer_index}
    settings, profile = resolve_settings(options)
    chat = open_chat(settings, profile, answers_by_default=by_default)
    *_, last = chat.reply(prompt)
    return last.turn.stats.accepted_from_lookup, last.turn.tokens


def test_a_chat_drafts_from_an_earlier_answer_but_not_from_one_to_the_same_prompt(bigram_dir):
    """The bigram target answers alike whatever came before the template's last tokens, so an answer
    to one prompt is a perfect draft for another's."""
    alone, answer = lookup_tokens(bigram_dir, "hello there", "off")
    assert lookup_tokens(bigram_dir, "hello there", "on") == (alone, answer)  # kept; nothing earlier yet
    assert lookup_tokens(bigram_dir, "hello there", "on") == (alone, answer)  # its own earlier answer left out
    helped, other = lookup_tokens(bigram_dir, "something else", "on")
    assert helped > lookup_tokens(bigram_dir, "something else", "off")[0] and other == answer
    assert lookup_tokens(bigram_dir, "something else", "auto", by_default=False)[0] < helped  # run, bench: off


def test_bench_and_run_neither_read_nor_keep_answers_unless_asked(bigram_dir, tmp_path):
    lookup_tokens(bigram_dir, "hello there", "auto", by_default=False)
    assert not list((tmp_path / "cache").glob("answers/*/answers.jsonl"))
    lookup_tokens(bigram_dir, "hello there", "auto")
    assert len(list((tmp_path / "cache").glob("answers/*/answers.jsonl"))) == 1


def test_a_bad_answer_index_value_is_refused(capsys):
    status, _, err = invoke(["chat", "--answer-index", "sometimes"], capsys)
    assert status == 2 and "sometimes" in err and "auto" in err

"""IncrementalDetokenizer against a small byte-level BPE tokenizer trained here on multi-byte text.

Byte-level BPE tokens can end in the middle of a UTF-8 character (some even straddle two characters),
which is exactly what the detokenizer must survive without ever emitting U+FFFD.
"""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from deltaserve.engine import detokenize
from deltaserve.engine.detokenize import IncrementalDetokenizer

ALPHABET = [*"abcdefghij éèçàö", "世", "界", "你", "好", "平", "🙂", "👍", "\n", "ST", "OP"]


def _train_tokenizer() -> PreTrainedTokenizerFast:
    sentences = ["héllo 世界 🙂 héllo wörld", "世界世界你好世界 🙂🙂 ça va", "the quick brown fox",
                 "naïve café déjà vu 世界和平 🙂👍", "STOP here and stop there"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    bpe.train_from_iterator(sentences, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


TOKENIZER = _train_tokenizer()


@pytest.fixture(autouse=True, params=["stream", "window"])
def decoding(request, monkeypatch):
    """Every test runs twice: with tokenizers' DecodeStream (a fast tokenizer's path) and with the decode
    window (other tokenizers, and finish())."""
    if request.param == "window":
        monkeypatch.setattr(detokenize, "_decode_stream", lambda *args: None)
    elif detokenize._decode_stream(TOKENIZER, [1, 2], True) is None:
        pytest.skip("this tokenizers has no DecodeStream taking context ids: the window serves")
    return request.param


def _byte_to_symbol() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


BYTE_TO_SYMBOL = _byte_to_symbol()


def random_split_ids(text: str, rng: random.Random) -> list[int]:
    """Token ids for `text` cut at random byte positions (so characters get split across tokens)."""
    data, ids, start = text.encode(), [], 0
    vocab = TOKENIZER.get_vocab()
    while start < len(data):
        for end in range(min(len(data), start + rng.randint(1, 6)), start, -1):
            symbol = "".join(BYTE_TO_SYMBOL[b] for b in data[start:end])
            if symbol in vocab:  # a single byte is always in the vocabulary
                ids.append(vocab[symbol])
                start = end
                break
    return ids


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def stream(ids, prompt=(), **kwargs):
    """Feed ids one by one; return (deltas, detokenizer) with finish()'s text as the last delta."""
    detok = IncrementalDetokenizer(TOKENIZER, list(prompt), **kwargs)
    deltas = [detok.append(i) for i in ids]
    deltas.append(detok.finish())
    return deltas, detok


def test_tokenizer_really_splits_characters():
    split_tokens = [i for i in range(len(TOKENIZER)) if "\ufffd" in TOKENIZER.decode([i])]
    assert len(split_tokens) > 50
    ids = random_split_ids("世界🙂", random.Random(0))
    assert TOKENIZER.decode(ids) == "世界🙂" and any("\ufffd" in TOKENIZER.decode([i]) for i in ids)


@pytest.mark.parametrize("split", ["encode", "random"])
def test_deltas_concatenate_to_full_decode_without_replacement_chars(split):
    rng = random.Random(1)
    for _ in range(150):
        text = random_text(rng, rng.randint(1, 40))
        ids = TOKENIZER.encode(text) if split == "encode" else random_split_ids(text, rng)
        prompt = TOKENIZER.encode(random_text(rng, rng.randint(0, 10)))
        deltas, detok = stream(ids, prompt)
        assert "".join(deltas) == TOKENIZER.decode(ids) == text == detok.text
        assert deltas[-1] == ""  # valid text: nothing is left for finish()
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_arbitrary_ids_match_full_decode(skip_special_tokens):
    # Random ids make invalid UTF-8 too: the real U+FFFD then appear, once the bytes can no longer complete.
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(len(TOKENIZER)) for _ in range(rng.randint(1, 30))]
        deltas, detok = stream(ids, skip_special_tokens=skip_special_tokens)
        expected = TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected == detok.text


def test_special_tokens_are_skipped_or_kept():
    ids = TOKENIZER.encode("ab") + [TOKENIZER.eos_token_id] + TOKENIZER.encode("c")
    assert "".join(stream(ids)[0]) == "abc"
    assert "".join(stream(ids, skip_special_tokens=False)[0]) == "ab<eos>c"


def test_decode_window_stays_bounded():
    calls = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(3)
    text = random_text(rng, 1500)
    ids = random_split_ids(text, rng)
    detok = IncrementalDetokenizer(CountingTokenizer(), TOKENIZER.encode("a long prompt " * 50))
    assert "".join(detok.append(i) for i in ids) == text
    assert len(ids) > 1000 and max(calls) <= 10  # a handful of tokens, never the whole sequence


# ---- stop strings --------------------------------------------------------------------------------------

def assert_stream_never_retracts(deltas, final_text):
    """Every prefix of the stream is a prefix of the final text: nothing shown is taken back later."""
    shown = ""
    for delta in deltas:
        shown += delta
        assert final_text.startswith(shown)
    assert shown == final_text


def test_stop_string_across_token_boundaries_is_never_emitted():
    ids = random_split_ids("héllo 世界 🙂 and more", random.Random(4))
    deltas, detok = stream(ids, stop=[" 世界 🙂"])
    assert detok.stopped_by == " 世界 🙂" and detok.text == "héllo"
    assert_stream_never_retracts(deltas, "héllo")
    assert not any("世" in d for d in deltas)


def test_include_stop_str_in_output_keeps_it_and_drops_what_follows():
    ids = random_split_ids("héllo 世界 🙂 and more", random.Random(5))
    deltas, detok = stream(ids, stop=["界 🙂"], include_stop_str_in_output=True)
    assert detok.stopped_by == "界 🙂" and detok.text == "héllo 世界 🙂"
    assert_stream_never_retracts(deltas, "héllo 世界 🙂")


def test_earliest_stop_wins_and_later_tokens_are_ignored():
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=["world", "lo"])
    deltas = [detok.append(i) for i in TOKENIZER.encode("hello world")]
    assert detok.stopped_by == "lo" and detok.text == "hel" and "".join(deltas) == "hel"
    assert detok.append(TOKENIZER.encode("x")[0]) == "" and detok.finish() == "" and detok.text == "hel"


def test_partial_stop_is_held_back_then_released_by_finish():
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=["STOP"])
    shown = "".join(detok.append(i) for i in random_split_ids("abc ST", random.Random(6)))
    assert shown == "abc " and detok.text == "abc " and detok.stopped_by is None  # "ST" is held, not shown
    assert detok.finish() == "ST" and detok.text == "abc ST"


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings(include):
    rng = random.Random(7)
    for _ in range(200):
        text = random_text(rng, rng.randint(2, 30))
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 5)]
        other = random_text(rng, 3)  # a second stop string that may or may not occur
        cut = min((text.find(s) for s in (stop, other) if s in text))
        winner = stop if text.find(stop) == cut else other
        expected = text[:cut + len(winner)] if include else text[:cut]
        deltas, detok = stream(random_split_ids(text, rng), stop=[stop, other],
                               include_stop_str_in_output=include)
        assert detok.stopped_by == winner and detok.text == expected
        assert_stream_never_retracts(deltas, expected)
        assert not any("\ufffd" in d for d in deltas)


def test_a_failing_decode_stream_hands_over_to_the_window(monkeypatch):
    """If DecodeStream raises (a decoder it cannot follow), the window continues from the text it returned."""
    class FailingStream:
        def __init__(self, inner):
            self.inner, self.steps = inner, 0

        def step(self, backend, token_id):
            self.steps += 1
            if self.steps == 7:
                raise RuntimeError("decoder failed")
            return self.inner.step(backend, token_id)

    def failing_stream(tokenizer, context_ids, skip_special_tokens):
        inner = DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens)
        return FailingStream(inner), tokenizer.backend_tokenizer

    monkeypatch.setattr(detokenize, "_decode_stream", failing_stream)
    rng = random.Random(8)
    for _ in range(20):
        text = random_text(rng, 30)
        deltas, detok = stream(random_split_ids(text, rng), TOKENIZER.encode("a prompt"))
        assert "".join(deltas) == text == detok.text and detok._stream is None

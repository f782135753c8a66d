"""engine/tokenize.encode: the ids tokenizer.encode gives, by the Rust backend's offset-free call where it may."""

from __future__ import annotations

import random
import re

import pytest
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

from deltaserve import demo
from deltaserve.bench import bpe_tokenizer, vocab_tokenizer
from deltaserve.engine import tokenize

TEXTS = ["", "Hello, world!", "<|im_start|>user\nhi there<|im_end|>\n", "  spaced  out\t\ttabs\n\n",
         "naïve café — 日本語 😀", "t1 t22 t333 <|endoftext|> t4", "x" * 2000]


def _bos_tokenizer():
    """A word-level tokenizer whose post-processor puts [BOS] first: add_special_tokens changes the ids."""
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "[BOS]": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="[BOS]", unk_token="[UNK]")


TOKENIZERS = {
    "demo byte-level BPE": demo.build_tokenizer,
    "benchmark words": lambda: vocab_tokenizer.build(4096, 7),
    "benchmark BPE": lambda: bpe_tokenizer.build(4096, 3000),
    "BOS post-processor": _bos_tokenizer,
}


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_equal_the_tokenizers_own_encode(name, add_special_tokens, monkeypatch):
    tokenizer = TOKENIZERS[name]()
    texts = TEXTS + ["a b a c b"]
    expected = [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]
    # the backend's fast call serves these tokenizers as they are configured: encode itself is not called
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("fell back to tokenizer.encode"))
    assert [tokenize.encode(tokenizer, text, add_special_tokens) for text in texts] == expected


def test_the_bos_post_processor_is_applied_only_with_special_tokens():
    tokenizer = _bos_tokenizer()
    assert tokenize.encode(tokenizer, "a b", True) == [1, 2, 3]
    assert tokenize.encode(tokenizer, "a b", False) == [2, 3]


def test_a_backend_configured_to_truncate_or_pad_falls_back_to_encode():
    tokenizer = demo.build_tokenizer()
    text = "one two three four five six seven eight nine ten"
    full = tokenizer.encode(text, add_special_tokens=False)
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert tokenize.encode(tokenizer, text, False) == full  # encode turns the truncation off, as transformers does
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.enable_padding(length=len(full) + 5)
    assert tokenize.encode(tokenizer, text, False) == full
    assert len(full) > 3


def test_split_special_tokens_is_respected():
    tokenizer = demo.build_tokenizer()
    tokenizer.split_special_tokens = True
    text = "<|im_start|>user"
    split = tokenizer.encode(text, add_special_tokens=False)
    assert tokenize.encode(tokenizer, text, False) == split
    assert demo.build_tokenizer().convert_tokens_to_ids("<|im_start|>") not in split


def test_text_the_tokenizer_cannot_take_raises_what_encode_raises():
    tokenizer = demo.build_tokenizer()
    text = "lone \ud800 surrogate"  # not encodable as UTF-8: the server answers 400 for what this raises
    with pytest.raises(TypeError) as raised:
        tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(type(raised.value)):
        tokenize.encode(tokenizer, text, False)


def _qwen35_split(tokenizer):
    """tokenizer with Qwen3.5's pre-tokenizer regex (letters joined by combining marks) in place of Qwen2's."""
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenize.QWEN_SPLIT_PATTERNS[1]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer


def _whitespace_merging_bpe():
    """A byte-level BPE with Qwen3.5's split whose merges join "\\n \\n" into one token: a cut inside a whitespace
    run (after its first newline) changes its ids."""
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"ĊĠ": len(vocab), "ĊĠĊ": len(vocab) + 1})  # byte-level "\\n " and "\\n \\n"
    bpe = Tokenizer(models.BPE(vocab, [("Ċ", "Ġ"), ("ĊĠ", "Ċ")]))
    bpe.normalizer = normalizers.NFC()
    return _qwen35_split(transformers.PreTrainedTokenizerFast(tokenizer_object=bpe))


def _single_word_tokens():
    """The demo tokenizer with added tokens that match only as whole words: "x" and "return" begin and end lines."""
    tokenizer = demo.build_tokenizer()
    tokenizer.backend_tokenizer.add_tokens([AddedToken("x", single_word=True), AddedToken("return", single_word=True)])
    return tokenizer


CUT_TOKENIZERS = {
    "demo byte-level BPE": demo.build_tokenizer,
    "single-word added tokens": _single_word_tokens,
    "Qwen3.5's split": lambda: _qwen35_split(demo.build_tokenizer()),
    "benchmark words": lambda: vocab_tokenizer.build(4096, 7),
    "benchmark BPE": lambda: bpe_tokenizer.build(4096, 3000),
    "BOS post-processor": _bos_tokenizer,
    "whitespace-merging BPE": _whitespace_merging_bpe,
}
# lines and line ends that meet at the cuts: contractions, punctuation runs, special tokens and spaces after a
# newline run, combining marks, CJK and Cyrillic at a line's start, Unicode's other whitespace (and the characters
# older Unicode versions took as whitespace) there, CRLF, blank lines, trailing spaces before a newline
_LINES = ["def f(x):", "    return x", "'s a contraction", "'LL shout", "<|im_start|>user", "naïve café", "日本語",
          "e\u0301 accent", "\u0301 lone mark", "\u0301\u0327 two marks", "x = [1, 2]  ", "--- dashes ---", "",
          "\t tab", "...", "12345", "t1 t22 t333", "<|endoftext|>", "a b a c b", "(((", "Ünïcödé", "Привет мир",
          "\u3000全角", "\u00a0nbsp", "\u0085nel", "\u2028line sep", "\u180emongolian", "\u200bzero width",
          "\ufeffbom", "\x1cfile sep", "\u2003em space", "t7", "t7123 t77 t7", "x", "return x", "xreturn"]
_ENDS = ["\n", "\n\n", "\r\n", " \n", ".\n", "\n\n\n", "  \n  ", "\r\n\r\n", "\n ", " "]


def _long_text(seed: int, chars: int = 6000) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    while sum(map(len, parts)) < chars:
        parts += [rng.choice(_LINES), rng.choice(_ENDS)]
    return "".join(parts)


@pytest.mark.parametrize("name", CUT_TOKENIZERS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_long_text_in_pieces_has_the_ids_of_one_call(name, add_special_tokens, monkeypatch):
    monkeypatch.setattr(tokenize, "MAX_PIECES", 40)
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", 100)
    tokenizer = CUT_TOKENIZERS[name]()
    backend = tokenizer.backend_tokenizer
    for seed in range(4):
        text = _long_text(seed)
        pieces = tokenize._pieces(backend, text, add_special_tokens)
        assert "".join(pieces) == text
        # the BOS tokenizer's post-processor adds a token: with special tokens its text stays whole
        assert (len(pieces) == 1) == (name == "BOS post-processor" and add_special_tokens), len(pieces)
        assert tokenize.encode(tokenizer, text, add_special_tokens) == tokenizer.encode(text, add_special_tokens=
                                                                                      add_special_tokens)


@pytest.mark.parametrize("name", ["demo byte-level BPE", "Qwen3.5's split", "benchmark BPE"])
def test_cutting_byte_level_bpe_after_spaces_would_change_the_ids(name, monkeypatch):
    """The texts above do tell a wrong cut: after a space (" word" is one pre-token) the ids differ."""
    monkeypatch.setattr(tokenize, "MAX_PIECES", 40)
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", 100)
    monkeypatch.setattr(tokenize, "cut_after", lambda backend: " \r\n")
    tokenizer = CUT_TOKENIZERS[name]()
    text = _long_text(0)
    assert tokenize.encode(tokenizer, text, False) != tokenizer.encode(text, add_special_tokens=False)


def test_cutting_where_whitespace_follows_a_newline_would_change_the_ids(monkeypatch):
    """A cut inside a whitespace run would be told: "\\n \\n" is one token of this BPE."""
    monkeypatch.setattr(tokenize, "MAX_PIECES", 40)
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", 100)
    monkeypatch.setattr(tokenize, "NOT_SPACE", r"(?=[\s\S])")  # before any character
    tokenizer = _whitespace_merging_bpe()
    text = "word\n \nword " * 400
    assert tokenize.encode(tokenizer, text, False) != tokenizer.encode(text, add_special_tokens=False)
    monkeypatch.undo()
    monkeypatch.setattr(tokenize, "MAX_PIECES", 40)
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", 100)
    assert len(tokenize._pieces(tokenizer.backend_tokenizer, text, False)) == 40
    assert tokenize.encode(tokenizer, text, False) == tokenizer.encode(text, add_special_tokens=False)


# every code point below the CJK blocks, every one Python or older Unicode takes as whitespace, and a sample above
_CODE_POINTS = ([chr(c) for c in range(0x3400)] + [chr(c) for c in range(0x110000) if chr(c).isspace()]
                + ["\u180e", "\u200b", "\ufeff"] + [chr(c) for c in range(0x3400, 0x110000, 97) if not 0xD800 <= c < 0xE000])


@pytest.mark.parametrize("name", ["demo byte-level BPE", "Qwen3.5's split", "benchmark words"])
def test_the_pre_tokenizer_starts_a_piece_at_every_cut(name):
    """Where the cut rule cuts (a whitespace run ending in one of cut_after's characters, then NOT_SPACE), the
    tokenizers library's own pre-tokenizer starts a pre-token, before any code point and whatever follows it: its
    regex engine's whitespace and Python's agree where the cuts need them to (run over all 1.1M code points once:
    no cut that is not a start)."""
    backend = CUT_TOKENIZERS[name]().backend_tokenizer
    cut = re.compile(f"[{re.escape(tokenize.cut_after(backend))}]+{tokenize.NOT_SPACE}")
    for tail in ("\n\n", "b", " \n"):  # whitespace that a run through c would take, a letter, a space
        text = "".join("x\n" + c + tail for c in _CODE_POINTS)
        starts = {start for _, (start, _) in backend.pre_tokenizer.pre_tokenize_str(text)}
        cuts = {found.end() for found in cut.finditer(text)}
        assert len(cuts) > len(_CODE_POINTS) // 2 and cuts <= starts, sorted(cuts - starts)[:5]


def test_only_long_texts_are_cut_and_only_before_a_non_space(monkeypatch):
    monkeypatch.setattr(tokenize, "MAX_PIECES", 4)
    backend = demo.build_tokenizer().backend_tokenizer
    short = "line\n" * (tokenize.MIN_PIECE_CHARS // 5)
    assert tokenize._pieces(backend, short[:-5], False) == [short[:-5]]
    assert tokenize._pieces(backend, "x" * 100_000, False) == ["x" * 100_000]  # one line: nowhere to cut
    text = ("word " * 1000 + "\n\n    indented\n\u3000wide\n\u00e9t\u00e9") * 8
    pieces = tokenize._pieces(backend, text, False)
    assert "".join(pieces) == text
    assert [piece[0] for piece in pieces] == ["w", "é", "é", "é"]  # not before the spaces, nor U+3000


def _with(tokenizer, **parts):
    for key, value in parts.items():
        setattr(tokenizer.backend_tokenizer, key, value)
    return tokenizer


@pytest.mark.parametrize("case, build", {
    "GPT-2's byte-level regex (splits a newline run from the next word)": lambda: _with(
        demo.build_tokenizer(), pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)),
    "a space put before each piece": lambda: _with(demo.build_tokenizer(), pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenize.QWEN_SPLIT_PATTERNS[0]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])),
    "a normalizer other than NFC": lambda: _with(demo.build_tokenizer(), normalizer=normalizers.Lowercase()),
    "BPE dropout": lambda: _with(bpe_tokenizer.build(4096, 3000), model=models.BPE(
        {"a": 0, "b": 1}, [], dropout=0.5)),
    "no pre-tokenizer": lambda: _with(vocab_tokenizer.build(64, 7), pre_tokenizer=None),
}.items())
def test_configurations_not_known_to_cut_cleanly_stay_whole(case, build):
    backend = build().backend_tokenizer
    assert tokenize.cut_after(backend) is None, case


@pytest.mark.parametrize("token", [AddedToken("<x>", lstrip=True), AddedToken("<x>", rstrip=True),
                                   AddedToken("\n<tool>")])
def test_an_added_token_that_takes_whitespace_keeps_the_text_whole(token):
    tokenizer = demo.build_tokenizer()
    tokenizer.backend_tokenizer.add_tokens([token])
    assert tokenize.cut_after(tokenizer.backend_tokenizer) is None

"""engine/tokenize.encode: the ids tokenizer.encode gives, by the Rust backend's offset-free call where it may."""

from __future__ import annotations

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

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

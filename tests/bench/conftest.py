"""Fixtures for the bench tests: a small byte-level BPE tokenizer on disk and the scripted fake server."""

import json as json_module
from pathlib import Path

import pytest

from tests.bench.fake_server import FakeOpenAIServer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _training_text():
    """Deterministic mixed corpus: stdlib json sources, plus accents, CJK and emoji for multi-byte pieces."""
    for path in sorted(Path(json_module.__file__).parent.glob("*.py")):
        yield path.read_text(encoding="utf-8")
    yield "héllo wörld, ñandú café. 日本語のテキストです。 emoji 🙂🚀 done. " * 50


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer (like Qwen's, 600 ids, 3 special tokens) saved as a HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_training_text(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", additional_special_tokens=specials[1:]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def fake_server():
    server = FakeOpenAIServer()
    server.start()
    yield server
    server.stop()

"""A synthetic byte-level BPE tokenizer of any vocabulary size, for measuring grammar masks at a real model's size.

    python -m deltaserve.bench.bpe_tokenizer Qwen/Qwen3.5-27B OUT_DIR     (or a config.json directory)
    deltaserve serve Qwen/Qwen3.5-27B --load-format dummy --tokenizer OUT_DIR

`vocab_tokenizer.py`'s words "t{i}" cannot spell JSON, so a grammar would allow none of them. This one is built
like Qwen's: byte-level BPE (any text encodes), Qwen2's pre-tokenizer split, and a vocabulary of made-up words
(with and without a leading space, capitalised), punctuation and whitespace runs, digits, and CJK and Cyrillic
pieces, every prefix of each a token too, so a grammar mask walks a token trie shaped like a real one. The demo
model's special and added tokens (and its chat template) follow the learned tokens, from the checkpoint's first
EOS id on; ids past them up to the model's vocabulary size are padding, as in Qwen's checkpoints.
"""

from __future__ import annotations

import random

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from deltaserve import demo
from deltaserve.bench.tokenizer_cli import write_for_model

_CONSONANTS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
               "ch", "sh", "th", "st", "tr", "pr", "gr", "pl", "qu", "ng", "ck", "x", "y"]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "ou", "io", "ai", "y"]
_PUNCTUATION = list("{}[]()<>\"':;,.!?=+-*/\\|&%$#@_`~^")
_WHITESPACE = [" ", "  ", "    ", "\n", "\n\n", "\t", "\n    ", "\n        ", " \n"]


def _word(rng: random.Random) -> str:
    """One made-up vocabulary entry (as text)."""
    kind = rng.random()
    if kind < 0.62:  # a word: 1-4 syllables, often after a space, sometimes capitalised
        text = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 4)))
        text += rng.choice(["", "", "s", "n", "r", "ing", "ed", "tion", "ly"])
        text = text.capitalize() if rng.random() < 0.15 else text
        return " " + text if rng.random() < 0.6 else text
    if kind < 0.72:  # punctuation runs, code and JSON pieces
        return "".join(rng.choice(_PUNCTUATION) for _ in range(rng.randint(1, 4)))
    if kind < 0.76:
        return rng.choice(_WHITESPACE) + rng.choice(["", *_PUNCTUATION])
    if kind < 0.90:  # CJK: 1-3 characters of 3 UTF-8 bytes each
        return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
    return (" " if rng.random() < 0.5 else "") + "".join(chr(rng.randint(0x0430, 0x044F))
                                                        for _ in range(rng.randint(2, 6)))


def build(vocab_size: int, eos_token_id: int, seed: int = 0):
    """A transformers fast tokenizer: ids [0, eos_token_id) learned BPE tokens, then the demo's added tokens
    (<|endoftext|> at eos_token_id); `vocab_size` (the model's, >= the tokenizer's) is not needed beyond the check."""
    import transformers

    if not (256 <= eos_token_id and eos_token_id + len(demo.ADDED_TOKENS) <= vocab_size):
        raise ValueError(f"eos_token_id must be >= 256 and leave room for {len(demo.ADDED_TOKENS)} added tokens "
                         f"below vocab_size {vocab_size}, got {eos_token_id}")
    to_symbols = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < eos_token_id:
        symbols = to_symbols.pre_tokenize_str(_word(rng))[0][0]
        for end in range(2, len(symbols) + 1):  # every prefix is a token: one merge (prefix, next byte) each
            piece = symbols[:end]
            if piece not in vocab:
                merges.append((symbols[:end - 1], symbols[end - 1]))
                vocab[piece] = len(vocab)
                if len(vocab) == eos_token_id:
                    break
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(demo._SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    for content, special in demo.ADDED_TOKENS:  # one at a time, so that ids follow ADDED_TOKENS order
        token = AddedToken(content, special=special, normalized=False)
        (bpe.add_special_tokens if special else bpe.add_tokens)([token])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=demo.ADDED_TOKENS[0][0],
                                                     pad_token=demo.PAD_TOKEN, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = demo.CHAT_TEMPLATE
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    def build_for(cfg):
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else cfg.vocab_size - len(demo.ADDED_TOKENS)
        tokenizer = build(cfg.vocab_size, eos)
        return tokenizer, (f"{len(tokenizer)} tokens (byte-level BPE) for a vocabulary of {cfg.vocab_size}, "
                           f"EOS {tokenizer.eos_token} = {tokenizer.eos_token_id}")

    return write_for_model(argv, "python -m deltaserve.bench.bpe_tokenizer", __doc__, build_for)


if __name__ == "__main__":
    raise SystemExit(main())

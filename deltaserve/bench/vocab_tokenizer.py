"""A synthetic tokenizer of a checkpoint's vocabulary, so that a dummy-weight checkpoint (the published configs
hold only config.json) can be served and benchmarked over HTTP like a real one.

    python -m deltaserve.bench.vocab_tokenizer Qwen/Qwen3.5-27B OUT_DIR     (or a config.json directory)
    deltaserve serve Qwen/Qwen3.5-27B --load-format dummy      (builds the same tokenizer itself)
    deltaserve bench serve --tokenizer OUT_DIR --dataset-name random ...

Token i is the word "t{i}" and text is words split on whitespace, so every id decodes to a word that encodes
back to it (random prompts of an exact length) and every id a random model samples decodes to text. The
checkpoint's first EOS id is the tokenizer's EOS token. No chat template: benchmark the completions endpoint.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from deltaserve.bench.tokenizer_cli import write_for_model


def build(vocab_size: int, eos_token_id: int | None = None):
    """A transformers fast tokenizer whose vocabulary is "t0" .. "t{vocab_size - 1}"."""
    import transformers

    if vocab_size < 1:
        raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
    vocab = {f"t{i}": i for i in range(vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    eos = None
    if eos_token_id is not None and 0 <= eos_token_id < vocab_size:
        # a special token matches inside words unless it is a single word ("t7" in "t7123" when the EOS is 7)
        eos = AddedToken(f"t{eos_token_id}", single_word=True, special=True, normalized=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token=eos,
                                               clean_up_tokenization_spaces=False)


def main(argv: list[str] | None = None) -> int:
    def build_for(cfg):
        tokenizer = build(cfg.vocab_size, cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
        return tokenizer, f"{cfg.vocab_size} tokens t0 .. t{cfg.vocab_size - 1}, EOS {tokenizer.eos_token}"

    return write_for_model(argv, "python -m deltaserve.bench.vocab_tokenizer", __doc__, build_for)


if __name__ == "__main__":
    raise SystemExit(main())

"""What tokenizing a long prompt takes, in one call and in pieces on the cores (deltaserve/engine/tokenize.py).

    python -m benchmarks.tokenize_probe [--tokens 8192,131072] [--repeats 5]

Two tokenizers a served benchmark meets: the word-level one `deltaserve bench serve` sends random prompts in
(bench/vocab_tokenizer.py, at Qwen3.5's vocabulary) and a byte-level BPE built like Qwen's (bench/bpe_tokenizer.py)
on code-like lines. Each text is timed through `tokenize.encode` in up to MAX_PIECES pieces (this machine's cores
but one) and in one (MAX_PIECES = 1), best of --repeats; the ids are checked equal.
"""

from __future__ import annotations

import argparse
import random
import time

from deltaserve.bench import bpe_tokenizer, vocab_tokenizer
from deltaserve.engine import tokenize

QWEN35_VOCAB = 248_320
QWEN35_EOS = 248_044
_CODE_WORDS = ["def", "return", "self.value", "for", "in", "range(10):", "#", "the", "if", "else:", "x", "=", "+"]


def texts(tokens: int, seed: int = 0) -> dict[str, str]:
    """A random prompt of `tokens` words for the word-level tokenizer, and code-like lines of ~4 chars a token."""
    rng = random.Random(seed)
    words = " ".join(f"t{rng.randrange(QWEN35_VOCAB)}" for _ in range(tokens))
    lines, chars = [], 0
    while chars < 4 * tokens:
        line = " " * 4 * rng.randrange(3) + " ".join(rng.choice(_CODE_WORDS) for _ in range(rng.randint(1, 10)))
        lines.append(line)
        chars += len(line) + 1
    return {"words": words, "code": "\n".join(lines)}


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tokenize_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,131072", help="prompt lengths in words")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    tokenizers = {"words": vocab_tokenizer.build(QWEN35_VOCAB, QWEN35_EOS),
                  "code": bpe_tokenizer.build(QWEN35_VOCAB, QWEN35_EOS)}
    cores = tokenize.MAX_PIECES
    print(f"up to {cores} pieces of >= {tokenize.MIN_PIECE_CHARS} chars")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, text in texts(tokens).items():
            tokenizer = tokenizers[name]
            pieces = len(tokenize._pieces(tokenizer.backend_tokenizer, text, True))
            ids = tokenize.encode(tokenizer, text, True)
            tokenize.MAX_PIECES = 1
            whole = tokenize.encode(tokenizer, text, True)
            one_ms = best_ms(lambda: tokenize.encode(tokenizer, text, True), args.repeats)
            tokenize.MAX_PIECES = cores
            if ids != whole:
                raise SystemExit(f"{name} at {tokens} words: the pieces' ids differ from one call's")
            pieces_ms = best_ms(lambda: tokenize.encode(tokenizer, text, True), args.repeats)
            print(f"{name:5} {tokens:>7} words, {len(text):>9,} chars, {len(ids):>7,} ids: one call {one_ms:7.2f} ms, "
                  f"{pieces} pieces {pieces_ms:7.2f} ms ({one_ms / pieces_ms:.1f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

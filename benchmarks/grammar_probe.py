"""What a grammar costs on the host, per library: tokenizer set-up, compiling a JSON schema up to its first mask,
and per later token the bitmask fill and the accept, over a valid document of the schema. The numbers behind
docs/structured_output.md.

    python -m benchmarks.grammar_probe                          # the demo tokenizer (1,024 ids)
    python -m benchmarks.grammar_probe --tokenizer DIR --vocab-size 248320
        (DIR from `python -m deltaserve.bench.bpe_tokenizer Qwen/Qwen3.5-27B DIR`)

Each library runs with its own defaults for threads unless --threads is given; the document is tokenized by the
tokenizer itself (its BPE), so the grammar sees the tokens a model would most likely write.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# An order form: nested objects, an enum, arrays, bounded strings and integers, optional fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string"},
            "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "tier"]},
        "items": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
            "gift": {"type": "boolean"}},
            "required": ["sku", "quantity"]}},
        "notes": {"type": "string"},
    },
    "required": ["customer", "items"],
}
DOCUMENT = {
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "enterprise"},
    "items": [{"sku": "ABC-1234", "quantity": 2, "gift": False}, {"sku": "XYZ-0042", "quantity": 17}],
    "notes": "Leave the parcel with the neighbour at number 12, please; 東京 is fine too.",
}


def _xgrammar(tokenizer, vocab_size: int, threads: int | None):
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, max_threads=threads or 8, cache_enabled=False)
    setup = time.perf_counter() - start

    def compile_():
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)

    def matcher(compiled):
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        m = xgrammar.GrammarMatcher(compiled)
        return (lambda: m.fill_next_token_bitmask(bitmask, 0)), m.accept_token, bitmask
    return setup, compile_, matcher


def _llguidance(tokenizer, vocab_size: int, threads: int | None):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - start
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile_():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)
        error = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(grammar):
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        m = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        return (lambda: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)), m.consume_token, bitmask
    return setup, compile_, matcher


LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance}


def probe(name: str, tokenizer, vocab_size: int, threads: int | None, repeats: int) -> dict:
    setup, compile_, matcher = LIBRARIES[name](tokenizer, vocab_size, threads)
    compile_times, fills, accepts = [], [], []
    tokens = tokenizer.encode(json.dumps(DOCUMENT, ensure_ascii=False), add_special_tokens=False)
    for _ in range(repeats):
        start = time.perf_counter()
        fill, accept, bitmask = matcher(compile_())
        for i, token in enumerate(tokens):
            if i:
                start = time.perf_counter()
            fill()
            middle = time.perf_counter()
            allowed = bool(bitmask[0, token // 32] >> (token % 32) & 1)
            if not allowed or not accept(token):
                raise RuntimeError(f"{name} refused token {token} ({tokenizer.decode([token])!r}) of the document")
            # the first mask is what a request waits for before its first token (llguidance builds lazily)
            (compile_times if i == 0 else fills).append(middle - start)
            accepts.append(time.perf_counter() - middle)
    fills.sort()
    return {"library": name, "vocab_size": vocab_size, "tokens": len(tokens),
            "tokenizer_setup_ms": 1e3 * setup, "first_mask_ms": 1e3 * statistics.median(compile_times),
            "fill_us_mean": 1e6 * statistics.fmean(fills), "fill_us_p50": 1e6 * fills[len(fills) // 2],
            "fill_us_p99": 1e6 * fills[int(0.99 * (len(fills) - 1))], "fill_us_max": 1e6 * fills[-1],
            "accept_us_mean": 1e6 * statistics.fmean(accepts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grammar_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the demo tokenizer)")
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's (padded) vocabulary size "
                        "(default: the tokenizer's)")
    parser.add_argument("--library", choices=sorted(LIBRARIES), action="append", default=None)
    parser.add_argument("--threads", type=int, default=None, help="compile threads (xgrammar)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from deltaserve.demo import build_tokenizer
        tokenizer = build_tokenizer()
    else:
        import transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = args.vocab_size or len(tokenizer)
    torch.set_num_threads(1)
    for name in args.library or sorted(LIBRARIES):
        try:
            print(json.dumps(probe(name, tokenizer, vocab_size, args.threads, args.repeats)))
        except ImportError as exc:  # the library not chosen is not a dependency: pip install it to compare
            print(json.dumps({"library": name, "skipped": f"not installed ({exc})"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

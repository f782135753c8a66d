"""Text to token ids, as `tokenizer.encode` gives them, without the character offsets nobody here reads, and a long
text in pieces on the cores.

A transformers fast tokenizer's `encode` runs the Rust tokenizer's `encode_batch`, which also computes every
token's character offsets. `encode_batch_fast` skips them and returns the same ids in less time (an 8,192-token
prompt of the benchmark's word-level tokenizer: ~22 -> ~12 ms on the CPU; a byte-level BPE one: ~15% less),
time that a long prompt's first token waits for. The backend is called directly only while it is configured as
transformers would configure it for that call (no truncation, no padding, special tokens matched as the
tokenizer says); otherwise, and for tokenizers without a Rust backend, `tokenizer.encode` runs.

A text of several pieces' length is cut where the backend's pre-tokenizer always ends a piece whatever follows, and
the pieces go to the batch call, which encodes them in parallel: the ids are the same, because the model (BPE or
word-level) only ever sees one pre-token at a time. The cuts are where a whitespace run ends in one of
`cut_after(backend)`'s characters (NOT_SPACE: the next character is not whitespace), and are made only for the
configurations whose pre-tokenizer is known to start a new pre-token there:
- Qwen's byte-level split (the Qwen2/3 and Qwen3.5 regexes, then ByteLevel without its own regex): no alternative
  takes a newline and the non-space after it (a word's optional leading character excludes \\r and \\n, and the
  alternatives that take newlines end at the whitespace run's end), so a whitespace run ending in a newline always
  ends a pre-token; one ending in a space does not (" word" is one pre-token).
- Whitespace splitting (the benchmark's word-level tokenizer): every whitespace run ends a word.
Python's whitespace holds every character the Rust tokenizer's regex engine and splitter take as whitespace, and
NOT_SPACE also refuses U+180E, U+200B and U+FEFF, whitespace in older Unicode versions. The normalizer may be none
or NFC (no composition starts at a newline, space or tab, and canonical reordering stays within the marks after a
starter), no added token may hold whitespace or strip it (so no match spans a cut; a single-word token sees a
boundary on both sides of a cut, whitespace on its left and the piece's start on its right, as in the whole text),
BPE may not drop merges at random, and a post-processor that adds special tokens keeps the text whole.
"""

from __future__ import annotations

import json
import os
import re

from tokenizers import models

# Qwen2/3's and Qwen3.5's pre-tokenizer regexes, as their tokenizer.json files write them
QWEN_SPLIT_PATTERNS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
)
NOT_SPACE = r"(?=[^\s\u180e\u200b\ufeff])"  # lookahead: a character no tokenizer takes as whitespace
MIN_PIECE_CHARS = 4096  # ~1K tokens: a piece this long already gains more than the batch call spends on it
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
MAX_PIECES = max(1, _CORES - 1)  # a core stays with the engine thread, whose launches keep the GPU busy meanwhile


class CheckedTokenIds(list):
    """Prompt token ids their maker has checked are Python ints in [0, the model's vocab_size): the engine takes
    them as they are instead of scanning them again (the server checks its requests' ids on its tokenizer thread,
    and the engine thread's scan of a long prompt delays every other stream's next step)."""


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=add_special_tokens)'s ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode_fast = getattr(backend, "encode_batch_fast", None)
    if (encode_fast is None or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False))):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    pieces = _pieces(backend, text, add_special_tokens)
    if len(pieces) == 1:
        return encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
    return [token for encoding in encode_fast(pieces, add_special_tokens=False) for token in encoding.ids]


def _pieces(backend, text: str, add_special_tokens: bool) -> list[str]:
    """text cut into up to MAX_PIECES pieces of at least MIN_PIECE_CHARS whose ids, joined, are text's."""
    count = min(MAX_PIECES, len(text) // MIN_PIECE_CHARS)
    if count < 2:
        return [text]
    post = backend.post_processor
    if add_special_tokens and post is not None and post.num_special_tokens_to_add(False) > 0:
        return [text]
    separators = cut_after(backend)
    if separators is None:
        return [text]
    cut = re.compile(f"[{re.escape(separators)}]+{NOT_SPACE}")
    starts = [0]
    for i in range(1, count):
        found = cut.search(text, max(i * len(text) // count, starts[-1] + MIN_PIECE_CHARS))
        if found is None or len(text) - found.end() < MIN_PIECE_CHARS:
            break
        starts.append(found.end())
    return [text[start:end] for start, end in zip(starts, starts[1:] + [len(text)])]


def cut_after(backend) -> str | None:
    """The characters after whose runs, before a character that is not whitespace, this backend's pre-tokenizer
    always ends a pre-token (see the module's docstring); None where cutting is not known to give the same ids."""
    normalizer = backend.normalizer
    if normalizer is not None and json.loads(normalizer.__getstate__()) != {"type": "NFC"}:
        return None
    model = backend.model
    if not (isinstance(model, models.WordLevel) or (isinstance(model, models.BPE) and model.dropout is None)):
        return None
    if any(token.lstrip or token.rstrip or any(c.isspace() for c in token.content)
           for token in backend.get_added_tokens_decoder().values()):
        return None
    if backend.pre_tokenizer is None:
        return None
    pre = json.loads(backend.pre_tokenizer.__getstate__())
    if pre == {"type": "WhitespaceSplit"}:
        return " \t\r\n"
    if pre.get("type") == "Sequence" and len(pre["pretokenizers"]) == 2:
        split, byte_level = pre["pretokenizers"]
        if (split.get("type") == "Split" and split.get("pattern") in [{"Regex": p} for p in QWEN_SPLIT_PATTERNS]
                and split.get("behavior") == "Isolated" and not split.get("invert")
                and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
                and not byte_level.get("use_regex")):
            return "\r\n"
    return None

"""Random text with an exact token count under a given tokenizer.

Synthetic benchmark prompts must have exactly the requested number of tokens, or the measured TTFT and
throughput belong to a different workload. Decoding N random token ids does not give text of N tokens:
re-encoding merges neighbours ("Ġcall" + "s" -> "Ġcalls"), and byte-level pieces of a split UTF-8 character
decode to U+FFFD, which re-encodes to several tokens.

Method (counts exclude special tokens: `encode(text, add_special_tokens=False)`):
1. The sampling vocabulary is every ordinary id (no special or added token) whose decoded string is
   non-empty, holds no U+FFFD, and re-encodes to that same single id. Ids outside it can never round-trip.
2. Sample N ids uniformly from it, decode them to text.
3. Re-encode. Too many tokens: keep the first N re-encoded ids and decode them. Too few: append fresh random
   ids to the re-encoded ids and decode. Repeat until the count is exactly N (a few rounds at most in
   practice); after MAX_REPAIR_ROUNDS start over from new random ids, and give up with a ValueError after
   MAX_FRESH_STARTS fresh starts.
A prompt that extends a shared prefix (`extend`) is built in token space, as vLLM's prefix_repetition
dataset builds it: the prefix's ids and the new ids are decoded together, so the tokenizer's decoder joins
them (a word-level vocabulary puts a space between its words; gluing two decoded texts would fuse the last
word of one with the first of the other). The count is taken on the whole prompt, and the prefix's own ids
must come out unchanged, so the prefix is token-for-token identical in every prompt that shares it (what a
server's prefix cache hashes). Shared prefixes come from `prefix()`, which keeps only texts that random
text can follow (a trial continuation must succeed).
"""

import numpy as np

MAX_REPAIR_ROUNDS = 16
MAX_FRESH_STARTS = 16
PROBE_TOKENS = 8  # length of the trial continuation that vets a shared prefix


class RandomTextGenerator:
    """Makes random strings of an exact token count; reproducible for a given seed."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.sampling_ids = _round_trip_ids(tokenizer)
        self._context: tuple[str, list[int]] = ("", [])  # the last context `extend` encoded, and its ids

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (the count every length here refers to)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites " ." as "." and would change the count after decoding.
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def sample_ids(self, num_tokens: int) -> list[int]:
        """`num_tokens` ids drawn uniformly from the round-trip vocabulary."""
        picks = self.rng.integers(0, len(self.sampling_ids), size=num_tokens)
        return self.sampling_ids[picks].tolist()

    def text(self, num_tokens: int) -> str:
        """Random text of exactly `num_tokens` tokens."""
        return self.extend("", num_tokens)

    def extend(self, context: str, num_tokens: int) -> str:
        """A prompt P that is `context` followed by `num_tokens` random tokens, in token space:
        encode(P) == encode(context) + exactly num_tokens more ids."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:
            return context
        context_ids = self._ids_of(context)
        for _ in range(MAX_FRESH_STARTS):
            prompt = self._repair(self.sample_ids(num_tokens), num_tokens, context_ids)
            if prompt is not None:
                return prompt
        raise ValueError(
            f"could not build random text of exactly {num_tokens} tokens after {MAX_FRESH_STARTS} tries "
            f"(context of {len(context_ids)} tokens); the tokenizer does not round-trip its own output"
        )

    def prefix(self, num_tokens: int) -> str:
        """Random text of `num_tokens` tokens meant to be shared as an `extend` context: kept only if random
        tokens can follow it with its own intact (under byte-level BPE a context ending in a run of spaces
        merges with anything after it, so no suffix could ever be generated)."""
        for _ in range(MAX_FRESH_STARTS):
            candidate = self.text(num_tokens)
            if not candidate:
                return candidate
            probe = self._repair(self.sample_ids(PROBE_TOKENS), PROBE_TOKENS, self._ids_of(candidate))
            if probe is not None:
                return candidate
        raise ValueError(f"could not build a {num_tokens}-token prefix that random text can follow")

    def _ids_of(self, context: str) -> list[int]:
        """encode(context), remembered for the last context (a shared prefix is extended many times)."""
        if context != self._context[0]:
            self._context = (context, self.encode(context))
        return self._context[1]

    def _repair(self, ids: list[int], num_tokens: int, context_ids: list[int]) -> str | None:
        """Steps 2-3 of the module docstring from `ids`, decoded after `context_ids`; the whole prompt, or
        None if it did not converge."""
        num_context = len(context_ids)
        for _ in range(MAX_REPAIR_ROUNDS):
            prompt = self.decode(context_ids + ids)
            full_ids = self.encode(prompt)
            if full_ids[:num_context] != context_ids:
                return None  # the new tokens merged into the context's last token: start over
            new_ids = full_ids[num_context:]
            if len(new_ids) == num_tokens:
                return prompt
            if len(new_ids) > num_tokens:
                ids = new_ids[:num_tokens]
            else:
                ids = new_ids + self.sample_ids(num_tokens - len(new_ids))
        return None


def _round_trip_ids(tokenizer) -> np.ndarray:
    """Ordinary ids whose decoded string re-encodes to exactly that id (step 1 of the method)."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    candidates = [i for i in range(tokenizer.vocab_size) if i not in excluded]
    pieces = tokenizer.batch_decode(
        [[i] for i in candidates], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    keep = [
        i for i, piece, ids in zip(candidates, pieces, encoded)
        if piece and "\ufffd" not in piece and ids == [i]
    ]
    if not keep:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no token that decodes and re-encodes "
            "to itself; cannot build random prompts with it"
        )
    return np.array(keep, dtype=np.int64)

"""Incremental detokenization of one output sequence, with stop strings (CPU only).

Decoding the whole output after every token costs O(n) per token, O(n^2) per sequence. Instead we decode
a short window of recent token ids (the prefix-offset / read-offset technique of HF text-generation-
inference and vLLM):

    ids:  ... | prefix_offset ........ read_offset ........ end |
                 context: already returned   new, not yet final

With a fast (Rust) tokenizer, `tokenizers.decoders.DecodeStream` does the same in Rust, about three times faster
than two Python decode calls of the window (docs/performance.md, 'Host work a step'); the window below serves
other tokenizers, any that cleans up spaces after decoding (DecodeStream would not), `finish()`, and a stream
that fails.

The window starts one step back (`prefix_offset`) so that tokenizers whose decoding depends on the
neighbour (SentencePiece drops the leading space of the first token) decode the new tokens exactly as they
would inside the full text. `emitted` counts the window's characters already handed out. When the window's
text ends in U+FFFD, its last bytes are an unfinished UTF-8 character (byte-level BPE tokens may split one):
everything before it is final and is returned, the tail waits for the next token. Once the window decodes
cleanly, it slides forward: prefix_offset <- read_offset, read_offset <- end.

Stop strings: a match cuts the text before the stop string (or after it with include_stop_str_in_output)
and sets `stopped_by`. Without include_stop_str_in_output, a tail that could still grow into a stop string
is held back, so a stream never shows characters that are later removed. Such a tail can only be in the
held-back text, never in text already returned, so the search only looks there.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the first output token (vLLM uses 5 too)


def _decode_stream(tokenizer, context_ids: list[int], skip_special_tokens: bool):
    """(DecodeStream primed with the context ids, the Rust tokenizer it steps with), or None where the window
    must serve: no Rust tokenizer, one whose decode() also cleans up spaces, or tokenizers too old for it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
        return DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens), backend
    except (ImportError, TypeError):  # tokenizers before DecodeStream, or before it took context ids
        return None


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas, cutting at the first stop string.

    `append(token_id)` returns the new text (maybe ""); `finish()` returns what was held back once the
    sequence is over (a tail that might have started a stop string, an undecodable trailing byte).
    The last few prompt tokens are decoded in front of the output as context, so the first output
    token decodes as it would inside the full text (e.g. keeps its leading space).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_by: str | None = None  # the stop string that ended the text, once one did
        self.finished = False

        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])  # context tail + output token ids
        self._stream = _decode_stream(tokenizer, self._ids, skip_special_tokens)
        self._released = len(self._ids)  # with the stream: ids whose text it has returned
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted = len(self._decode(self._ids))  # characters of the window text already accounted for

        self._pieces: list[str] = []  # output text returned so far, in order (joined lazily by .text)
        self._held = ""  # decoded output text not returned yet: it could be the start of a stop string
        # With include_stop_str_in_output nothing is held back, so a stop string may begin in text already
        # returned: `_recent` keeps its last (longest stop - 1) characters for the search.
        longest_stop = max((len(s) for s in self.stop), default=0)
        self._stop_context = longest_stop - 1 if include_stop_str_in_output and longest_stop else 0
        self._recent = ""

    @property
    def text(self) -> str:
        """The output text returned so far (the deltas joined), cut at the stop string. A tail held back
        because it may start a stop string is not in it until `finish()` releases it: every text a stream
        shows is a prefix of the final one."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, token_id: int) -> str:
        """Add one output token; return the text that became final because of it (maybe "")."""
        if self.stopped_by is not None or self.finished:
            return ""  # the request is over; the engine stops calling us, but stray tokens change nothing
        self._ids.append(token_id)
        if self._stream is not None:
            stream, backend = self._stream
            try:
                piece = stream.step(backend, token_id)
            except Exception:  # a decoder DecodeStream cannot follow: the window takes over from here
                logger.warning("tokenizers' DecodeStream failed; decoding this output by windows", exc_info=True)
                self._window_from_released()
            else:
                if piece is None:  # an unfinished character: nothing is final yet
                    return ""
                self._released = len(self._ids)
                return self._add_text(piece, final=False)
        window = self._decode(self._ids[self._prefix_offset:])
        stable = window.rstrip(_REPLACEMENT_CHAR)
        new_text = stable[self._emitted:]
        self._emitted = max(self._emitted, len(stable))  # returned text is never taken back
        if len(stable) == len(window):
            # Clean window: all its characters are final; slide it so that it stays a few tokens long.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._emitted = len(self._decode(self._ids[self._prefix_offset:self._read_offset]))
        return self._add_text(new_text, final=False)

    def finish(self) -> str:
        """End of sequence: return everything still held (a trailing U+FFFD stays if the bytes were bad)."""
        if self.stopped_by is not None or self.finished:
            return ""
        self.finished = True
        if self._stream is not None:
            self._window_from_released()
        window = self._decode(self._ids[self._prefix_offset:])
        return self._add_text(window[self._emitted:], final=True)

    def _window_from_released(self) -> None:
        """Leave the stream for the window, which starts where the stream's returned text ends."""
        self._stream = None
        self._prefix_offset = max(0, self._released - _PROMPT_CONTEXT_TOKENS)
        self._read_offset = self._released
        self._emitted = len(self._decode(self._ids[self._prefix_offset:self._released]))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _add_text(self, new_text: str, final: bool) -> str:
        """Append decoded text, apply stop strings and hold-back, and return the part now safe to show."""
        pending = self._held + new_text
        if not pending:
            return ""
        match = self._first_stop(self._recent + pending)  # _recent is "" unless include_stop_str_in_output
        if match is not None:
            position, stop = match
            end = position + len(stop) if self.include_stop_str_in_output else position
            out = pending[:max(end - len(self._recent), 0)]
            self.stopped_by = stop
            self._held = ""
        else:
            hold = 0 if final or self.include_stop_str_in_output else self._partial_stop_length(pending)
            out, self._held = pending[:len(pending) - hold], pending[len(pending) - hold:]
        self._pieces.append(out)
        if self._stop_context:
            self._recent = (self._recent + out)[-self._stop_context:]
        return out

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest (position, stop string) occurring in `text`, or None."""
        best = None
        for stop in self.stop:
            position = text.find(stop)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

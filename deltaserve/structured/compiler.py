"""GrammarCompiler: StructuredOutputsParams -> CompiledConstraint (an xgrammar CompiledGrammar and the reasoning
gate), for one tokenizer and vocabulary size.

The tokenizer's xgrammar view (`xgrammar.TokenizerInfo`, about 2-3 s at a 248K vocabulary) is built at the first
compile, or by `prepare` (the engine's GPU warm-up). Its special tokens are blanked: a detokenizer that skips
them would drop text the grammar counted on, so a grammar never spells anything with them; the engine's EOS ids
are the grammar's stop tokens, the only ones it allows once the output is complete. Compiled grammars are
cached by xgrammar (per schema text and options, up to CACHE_BYTES): the server compiles a request's constraint
off the event loop before queueing it, and the engine's compile for each of its sequences is then a cache hit.

JSON schemas compile in xgrammar's strict mode (no properties or items the schema does not name), after
json_schema.prepare_schema (what xgrammar 0.2.9 needs to enforce them as written). Whitespace between JSON
items is free, as in vLLM, but a run of it is at most MAX_WHITESPACE characters, so a model cannot loop on
whitespace; `disable_any_whitespace` leaves only ", " and ": ".
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass

from deltaserve.structured.json_schema import prepare_schema
from deltaserve.structured.params import GrammarError, StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_BYTES = 512 << 20  # compiled grammars kept (xgrammar's cache): ~1 MB each for a form-sized schema at 248K ids
MAX_WHITESPACE = 16  # characters in a run of JSON whitespace


@dataclass(frozen=True)
class CompiledConstraint:
    grammar: object | None  # xgrammar.CompiledGrammar; None: only a thinking budget, the answer is free
    reasoning_end_id: int | None  # the constraint starts after this token (None: at the first output token)
    thinking_token_budget: int | None


# xgrammar's errors start with a timestamp, its source position and sometimes a failed check's text
_ERROR_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+\.cc:\d+:\s*)?(Check failed: .*? is false:\s*)?")


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return _ERROR_PREFIX.sub("", text, count=1).strip() or type(exc).__name__


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server's thread and the engine's both call it)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], max_threads: int = 8):
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this engine has none")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._max_threads = max_threads
        self._lock = threading.Lock()
        self._compiler = None  # xgrammar.GrammarCompiler, built at the first compile

    def prepare(self) -> None:
        """Build xgrammar's view of the vocabulary now rather than at the first compile (seconds at 248K ids)."""
        self._xgrammar_compiler()

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                start = time.perf_counter()
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids or None)
                metadata = json.loads(info.dump_metadata())
                metadata["stop_token_ids"] = self.stop_token_ids
                special = {i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special}
                vocab = [""] * self.vocab_size  # ids past the tokenizer's (padding) stay blank: never allowed
                for token, i in self.tokenizer.get_vocab().items():
                    if i < self.vocab_size and i not in special:
                        vocab[i] = token
                info = xgrammar.TokenizerInfo.from_vocab_and_metadata(vocab, json.dumps(metadata))
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._max_threads,
                                                          cache_limit_bytes=CACHE_BYTES)
                logger.info("structured output: xgrammar's view of the %d-id vocabulary took %.1f s",
                            self.vocab_size, time.perf_counter() - start)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> CompiledConstraint:
        """Raises GrammarError (a ValueError) naming the field and why it cannot be compiled."""
        gate = None if spec.reasoning_end is None else self._single_token(spec.reasoning_end)
        kind = spec.kind
        grammar = None
        if kind is not None:
            try:
                grammar = self._compile(self._xgrammar_compiler(), spec, kind)
            except GrammarError:
                raise
            except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's and pydantic's errors
                raise GrammarError(kind, _reason(exc)) from exc
        return CompiledConstraint(grammar, gate, spec.thinking_token_budget)

    def _compile(self, compiler, spec: StructuredOutputsParams, kind: str):
        import xgrammar
        from xgrammar import structural_tag as tags

        whitespace = dict(any_whitespace=not spec.disable_any_whitespace,
                          max_whitespace_cnt=None if spec.disable_any_whitespace else MAX_WHITESPACE)
        if kind == "json":
            try:
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            except ValueError as exc:
                raise GrammarError("json", f"the schema is not valid JSON: {exc}") from exc
            schema = json.dumps(prepare_schema(schema), ensure_ascii=False)
            return compiler.compile_json_schema(schema, strict_mode=True, **whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            options = tags.OrFormat(elements=[tags.ConstStringFormat(value=c) for c in spec.choice])
            return compiler.compile_structural_tag(tags.StructuralTag(format=options))
        if kind == "grammar":
            text = spec.grammar
            grammar = (xgrammar.Grammar.from_ebnf(text) if "::=" in text else xgrammar.Grammar.from_lark(text))
            return compiler.compile_grammar(grammar)
        tag = spec.structural_tag
        return compiler.compile_structural_tag(tags.StructuralTag.from_json(tag))

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise GrammarError("reasoning_end", f"{text!r} is {len(ids)} tokens in this tokenizer, not one")
        return ids[0]

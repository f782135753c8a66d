"""The structured-output benchmark helpers: the synthetic byte-level tokenizer and the per-token mask probe."""

import json

from deltaserve import demo
from benchmarks import grammar_probe
from deltaserve.bench import bpe_tokenizer


def test_the_bpe_tokenizer_spells_any_text_and_ends_with_the_demo_tokens():
    tokenizer = bpe_tokenizer.build(3000, eos_token_id=2900)
    assert len(tokenizer) == 2900 + len(demo.ADDED_TOKENS)
    assert tokenizer.eos_token_id == 2900 and tokenizer.convert_ids_to_tokens(2900) == demo.ADDED_TOKENS[0][0]
    text = json.dumps({"name": "Ada", "tags": ["東京", 'naïve "quote"'], "n": 12}, ensure_ascii=False) + "\n\t x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())  # merges apply
    assert tokenizer.chat_template == demo.CHAT_TEMPLATE
    assert bpe_tokenizer.build(3000, eos_token_id=2900).get_vocab() == tokenizer.get_vocab()  # deterministic


def test_the_probe_feeds_the_whole_document_through_a_grammar(capsys):
    assert grammar_probe.main(["--library", "xgrammar", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["library"] == "xgrammar" and result["tokens"] > 100 and result["fill_us_mean"] > 0

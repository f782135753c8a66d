"""bench/vocab_tokenizer.py: a tokenizer for a dummy-weight checkpoint, sized to its vocabulary."""

import pytest
import transformers

from deltaserve import LLM, SamplingParams
from deltaserve.bench.datasets import sample_prefix_repetition, sample_random
from deltaserve.bench.randtext import RandomTextGenerator
from deltaserve.bench.vocab_tokenizer import build, main
from deltaserve.config import ModelConfig


def test_every_id_is_a_word_that_encodes_back():
    tokenizer = build(300, eos_token_id=299)
    ids = list(range(300))
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
    assert tokenizer.eos_token == "t299" and tokenizer.eos_token_id == 299
    text = RandomTextGenerator(tokenizer, seed=1).text(50)  # the bench client's random prompts
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 50


def test_the_eos_word_is_not_found_inside_longer_words():
    tokenizer = build(10_000, eos_token_id=7)
    assert tokenizer.encode("t7123 t7 t77", add_special_tokens=False) == [7123, 7, 77]


def test_written_for_a_checkpoint_it_serves_it(make_checkpoint, tmp_path, capsys):
    checkpoint = make_checkpoint("qwen3_5")
    out = tmp_path / "tok"
    assert main([str(checkpoint), str(out)]) == 0
    vocab = ModelConfig.from_pretrained(checkpoint).vocab_size
    assert f"{vocab} tokens t0 .. t{vocab - 1}" in capsys.readouterr().out
    assert len(transformers.AutoTokenizer.from_pretrained(out)) == vocab
    llm = LLM(str(checkpoint), tokenizer=str(out), max_model_len=64)
    output = llm.generate(["t1 t2 t3"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(output.prompt_token_ids) == 3 and len(output.outputs[0].token_ids) == 4
    assert output.outputs[0].text.split() == [f"t{i}" for i in output.outputs[0].token_ids]


def test_a_vocabulary_of_nothing_is_refused():
    with pytest.raises(ValueError, match="vocab_size must be at least 1, got 0"):
        build(0)


def test_a_missing_model_or_config_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing"), str(tmp_path / "tok")])
    assert "nothing': no such file or directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(tmp_path / "tok")])  # a directory, but no config.json in it
    assert "no config.json found at" in capsys.readouterr().err


def test_written_for_a_hub_id_from_its_shipped_config(tmp_path, capsys):
    assert main(["Qwen/Qwen3.5-0.8B", str(tmp_path / "tok")]) == 0
    assert "248320 tokens t0 .. t248319, EOS t248044" in capsys.readouterr().out
    assert len(transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")) == 248320


@pytest.mark.parametrize("dataset", ["prefix_repetition", "random"])
def test_long_shared_prefixes_with_the_vocabulary_tokenizer(dataset):
    """W4's shape (a 36,864-token prefix) through `bench serve`'s datasets: decoded text glued to decoded text
    would fuse two words ("t5" + "t7" -> "t5t7"), so prompts are built in token space."""
    tokenizer = build(5000, eos_token_id=4999)
    gen = RandomTextGenerator(tokenizer, seed=0)
    if dataset == "prefix_repetition":
        requests = sample_prefix_repetition(gen, num_prompts=4, prefix_len=36864, suffix_len=64, num_prefixes=2,
                                            output_len=8)
    else:
        requests = sample_random(gen, num_prompts=4, input_len=64, output_len=8, range_ratio=0.0, prefix_len=36864)
    prefixes = {}
    for request in requests:
        ids = tokenizer.encode(request.prompt, add_special_tokens=False)
        assert len(ids) == request.prompt_len == 36864 + 64
        prefixes.setdefault(tuple(ids[:36864]), []).append(ids[36864:])
    assert sorted(len(suffixes) for suffixes in prefixes.values()) == ([2, 2] if dataset != "random" else [4])

"""Prompt sets: exact token counts, shared prefixes, file datasets, multi-turn growth."""

import asyncio
import json

import pytest

from deltaserve.bench import datasets, multi_turn
from deltaserve.bench.client import RequestInput, RequestOutput
from deltaserve.bench.errors import BenchInputError
from deltaserve.bench.randtext import RandomTextGenerator


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture
def gen(tokenizer):
    return RandomTextGenerator(tokenizer, seed=0)


def test_sampling_vocab_excludes_special_tokens(tokenizer, gen):
    special = set(tokenizer.all_special_ids)
    assert special and not special & set(gen.sampling_ids.tolist())
    assert len(gen.sampling_ids) > 400  # most of the 600 ids round-trip


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 17, 256, 3000])
def test_random_text_has_exact_token_count(tokenizer, gen, num_tokens):
    for _ in range(5):
        assert len(_ids(tokenizer, gen.text(num_tokens))) == num_tokens


def test_random_text_after_context_keeps_context_tokens(tokenizer, gen):
    context = gen.prefix(100)
    context_ids = _ids(tokenizer, context)
    for n in (1, 5, 64):
        for _ in range(10):
            full = _ids(tokenizer, gen.extend(context, n))
            assert full[:100] == context_ids and len(full) == 100 + n


def test_random_dataset_lengths_and_prefix(tokenizer, gen):
    requests = datasets.sample_random(gen, num_prompts=40, input_len=50, output_len=20, range_ratio=0.5,
                                      prefix_len=12)
    assert len(requests) == 40
    prefix_ids = _ids(tokenizer, requests[0].prompt)[:12]
    body_lens, out_lens = set(), set()
    for r in requests:
        ids = _ids(tokenizer, r.prompt)
        assert len(ids) == r.prompt_len and ids[:12] == prefix_ids
        body_lens.add(r.prompt_len - 12)
        out_lens.add(r.expected_output_len)
    assert min(body_lens) >= 25 and max(body_lens) <= 75 and len(body_lens) > 10
    assert min(out_lens) >= 10 and max(out_lens) <= 30 and len(out_lens) > 5

    fixed = datasets.sample_random(RandomTextGenerator(tokenizer, 1), 5, 33, 7, 0.0, 0)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(33, 7)] * 5
    assert len({r.prompt for r in fixed}) == 5
    assert [r.prompt for r in fixed] == [r.prompt for r in datasets.sample_random(
        RandomTextGenerator(tokenizer, 1), 5, 33, 7, 0.0, 0)]  # reproducible for a seed


def test_prefix_repetition_shares_prefixes(tokenizer, gen):
    requests = datasets.sample_prefix_repetition(gen, num_prompts=11, prefix_len=40, suffix_len=9, num_prefixes=3,
                                                 output_len=5)
    assert len(requests) == 11
    groups = {}
    for r in requests:
        ids = _ids(tokenizer, r.prompt)
        assert len(ids) == r.prompt_len == 49 and r.expected_output_len == 5
        groups.setdefault(tuple(ids[:40]), []).append(r.prompt)
    assert sorted(len(g) for g in groups.values()) == [3, 4, 4]  # 11 prompts over 3 prefixes
    for prompts in groups.values():
        assert len(set(prompts)) == len(prompts)  # suffixes differ
    with pytest.raises(BenchInputError, match="--prefix-repetition-num-prefixes 3"):
        datasets.sample_prefix_repetition(gen, 2, 40, 9, 3, 5)


def test_sharegpt_filters_and_oversamples(tmp_path, tokenizer):
    long_text = "word " * 30
    data = [
        {"conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": long_text}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_text}]},  # too short
        {"conversations": [{"from": "human", "value": long_text}]},  # one turn only
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = datasets.sample_sharegpt(str(path), tokenizer, num_prompts=3, output_len=None, seed=0)
    assert len(requests) == 3 and {r.prompt for r in requests} == {long_text}
    assert requests[0].prompt_len == len(tokenizer(long_text).input_ids)
    assert requests[0].expected_output_len == len(tokenizer(long_text).input_ids)
    fixed = datasets.sample_sharegpt(str(path), tokenizer, 1, output_len=2, seed=0)
    assert fixed[0].expected_output_len == 2


def test_custom_jsonl(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "first question"}\n\n{"prompt": "second question"}\n')
    raw = datasets.sample_custom(str(path), tokenizer, 2, 9, apply_chat_template=False, seed=0)
    assert sorted(r.prompt for r in raw) == ["first question", "second question"]
    assert all(r.expected_output_len == 9 and r.prompt_len == len(tokenizer(r.prompt).input_ids) for r in raw)
    templated = datasets.sample_custom(str(path), tokenizer, 2, 9, apply_chat_template=True, seed=0)
    assert all(r.prompt.startswith("<|im_start|>user\n") and r.prompt.endswith("<|im_start|>assistant\n")
               for r in templated)
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(BenchInputError, match="line 1: needs a string \"prompt\" field"):
        datasets.sample_custom(str(path), tokenizer, 1, 9, False, 0)


def test_multi_turn_prompts_grow_by_answer_and_new_text(tokenizer, gen):
    plan = multi_turn.plan_sessions(gen, num_sessions=1, num_turns=3, first_len=20, new_tokens=7, output_len=4)[0]
    assert len(_ids(tokenizer, plan.first_prompt)) == 20
    assert [len(_ids(tokenizer, t)) for t in plan.new_texts] == [7, 7]
    sent = []

    async def send(request: RequestInput) -> RequestOutput:
        sent.append(request)
        return RequestOutput(success=True, generated_text=f" answer{len(sent)}")

    turns = asyncio.run(multi_turn.run_session(plan, chat=False, request_id_prefix="s0-", send=send))
    assert [r.prompt for r in sent] == [
        plan.first_prompt,
        plan.first_prompt + " answer1" + plan.new_texts[0],
        plan.first_prompt + " answer1" + plan.new_texts[0] + " answer2" + plan.new_texts[1],
    ]
    assert [r.request_id for r, _ in turns] == ["s0-t0", "s0-t1", "s0-t2"]

    sent.clear()
    asyncio.run(multi_turn.run_session(plan, chat=True, request_id_prefix="", send=send))
    assert sent[2].prompt == [
        {"role": "user", "content": plan.first_prompt}, {"role": "assistant", "content": " answer1"},
        {"role": "user", "content": plan.new_texts[0]}, {"role": "assistant", "content": " answer2"},
        {"role": "user", "content": plan.new_texts[1]},
    ]


def test_multi_turn_failed_turn_ends_session(gen):
    plan = multi_turn.plan_sessions(gen, 1, 4, 5, 5, 2)[0]

    async def send(request: RequestInput) -> RequestOutput:
        failing = request.request_id.endswith("t1")
        return RequestOutput(success=not failing, error="HTTP 503" if failing else "")

    turns = asyncio.run(multi_turn.run_session(plan, chat=False, request_id_prefix="", send=send))
    assert [out.success for _, out in turns] == [True, False, False, False]
    assert turns[3][1].error == "not sent: turn 1 of this session failed"

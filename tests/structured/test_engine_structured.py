"""Structured output through the engine on the random-weight tiny model, whose free output is noise: only the
grammar can make it valid. Also: free requests are untouched by constrained neighbours, and the engine's tricks
(async scheduling, chunked prefill, preemption, prefix caching, n > 1) give the same constrained outputs."""

import json
import logging
import math

import jsonschema
import pytest
import torch
import transformers

from deltaserve import LLM, SamplingParams
from deltaserve.bench.vocab_tokenizer import build as build_word_tokenizer
from deltaserve.config import ModelConfig
from deltaserve.structured import StructuredOutputsParams as Constraint
from tests.model.helpers import model_bound
from tests.structured.schemas import random_schema
from tests.tolerance import gamma

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Give me the record as JSON:", "The traveller walked from the mountains to the sea", "{"]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return str(make_checkpoint("qwen3_5"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, max_model_len=1024, max_num_seqs=64)


def test_fifty_random_schemas_each_give_json_that_validates(llm):
    schemas = [random_schema(seed) for seed in range(50)]
    # greedy and seeded sampling, with free whitespace and without, all in one batch
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=600, structured_outputs=Constraint(
        json=schema, disable_any_whitespace=i % 3 == 0)) for i, schema in enumerate(schemas)]
    outputs = llm.generate([PROMPTS[i % 3] for i in range(50)], params, use_tqdm=False)
    for schema, output in zip(schemas, outputs):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (Constraint(regex=r"[A-Z]{2}-[0-9]{3}"), lambda t: len(t) == 6 and t[:2].isupper() and t[3:].isdigit()),
        (Constraint(choice=["yes", "no", 'a "quoted" 東京']), lambda t: t in ("yes", "no", 'a "quoted" 東京')),
        (Constraint(grammar='root ::= "(" [0-9] ("+" [0-9])* ")"'), lambda t: t[0] == "(" and t[-1] == ")"),
        (Constraint(grammar='start: "up" | "down"'), lambda t: t in ("up", "down")),  # Lark
    ]
    for seed in range(3):
        outputs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                                                        structured_outputs=c) for c, _ in cases[:3]], use_tqdm=False)
        outputs += llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, seed=seed, max_tokens=20,
                                                            structured_outputs=cases[3][0]), use_tqdm=False)
        for (_, check), output in zip(cases, outputs):
            assert output.outputs[0].finish_reason == "stop" and check(output.outputs[0].text), output.outputs[0].text
    # any JSON object: unbounded, so a noise model may run out of tokens first; these seeds finish
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=300, structured_outputs=Constraint(
        json_object=True, disable_any_whitespace=tight)) for seed, tight in ((3, True), (4, True), (6, False))]
    for output in llm.generate(["x"] * 3, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop" and isinstance(json.loads(output.outputs[0].text), dict)


def _tokens(outputs):
    return [[o.token_ids for o in out.outputs] for out in outputs]


def test_the_grammar_ends_its_sequence_even_with_ignore_eos(llm):
    output = llm.generate("x", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, structured_outputs=
                                              Constraint(choice=["done"])), use_tqdm=False)[0].outputs[0]
    # the grammar's stop tokens are the engine's EOS ids (either may end it)
    assert (output.text, output.finish_reason) == ("done", "stop") and output.token_ids[-1] in llm.engine.eos_token_ids


def logprob_bound(checkpoint: str, ids: list[int]) -> float:
    """How far two float32 evaluations (in a batch, alone) of a logprob over ids may differ: each side's logit
    within model_bound of the exact one, its log-sum-exp within that too (1-Lipschitz in the largest logit error)
    plus its own vocabulary-long sum; the logits' magnitude from transformers over the same tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        magnitude = model(torch.tensor([ids])).logits.abs().max().item()
    cfg = ModelConfig.from_pretrained(checkpoint)
    one_side = 2 * model_bound(cfg, len(ids), magnitude) + gamma(cfg.vocab_size, torch.float32) * (
        magnitude + math.log(cfg.vocab_size))
    return 2 * one_side


def test_free_requests_in_a_constrained_batch_get_the_tokens_they_get_alone(llm, checkpoint):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)]
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    constrained = [SamplingParams(temperature=t, seed=9, max_tokens=200, structured_outputs=Constraint(
        json=random_schema(seed))) for seed, t in ((1, 0.0), (2, 1.0))]
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2]],
                         [free[0], constrained[0], free[1], constrained[1]], use_tqdm=False)
    assert _tokens([mixed[0], mixed[2]]) == _tokens(alone)
    got = [e[t].logprob for e, t in zip(mixed[2].outputs[0].logprobs, mixed[2].outputs[0].token_ids)]
    want = [e[t].logprob for e, t in zip(alone[1].outputs[0].logprobs, alone[1].outputs[0].token_ids)]
    bound = logprob_bound(checkpoint, alone[1].prompt_token_ids + alone[1].outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(got, want)) <= bound, (got, want, bound)
    for output, params in ((mixed[1], constrained[0]), (mixed[3], constrained[1])):
        jsonschema.validate(json.loads(output.outputs[0].text), params.structured_outputs.json)


@pytest.mark.parametrize("setting", [
    {"async_scheduling": False},
    {"max_num_batched_tokens": 7},  # chunked prefill
    {"block_size": 4, "num_gpu_blocks_override": 70},  # preemption by recompute
    {"enable_prefix_caching": False},
])
def test_constrained_outputs_are_the_same_whatever_the_engine_does(checkpoint, llm, setting):
    prompts = [PROMPTS[i % 3] + " " * (i % 4) for i in range(6)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, n=1 + (i == 3), max_tokens=150,
                             structured_outputs=Constraint(json=random_schema(100 + i))) for i in range(6)]
    expected = _tokens(llm.generate(prompts, params, use_tqdm=False))
    other = LLM(checkpoint, max_model_len=256, max_num_seqs=6, **setting)
    engine = other.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    outputs, preempted = {}, set()
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        preempted |= {r.request_id for r in engine.scheduler.waiting if r.num_preemptions}
    assert _tokens([outputs[str(i)] for i in range(6)]) == expected
    if "num_gpu_blocks_override" in setting:
        assert preempted, "the tight pool should have preempted a constrained request"


def test_n_samples_each_follow_their_own_grammar_state(llm):
    schema = random_schema(7)
    output = llm.generate("x", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=300,
                                              structured_outputs=Constraint(json=schema)), use_tqdm=False)[0]
    texts = [o.text for o in output.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1


def test_thinking_is_free_then_the_constraint_applies(llm):
    schema = random_schema(11)
    think = Constraint(json=schema, reasoning_end="</think>", thinking_token_budget=6)
    output = llm.generate("x", SamplingParams(temperature=0, max_tokens=300, structured_outputs=think),
                          use_tqdm=False)[0].outputs[0]
    reasoning, answer = output.text.split("</think>")
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    assert output.token_ids.index(end) == 6 and output.finish_reason == "stop"
    jsonschema.validate(json.loads(answer), schema)
    # a budget alone: the thinking is cut at 3 tokens, the answer after it is free
    free = llm.generate("x", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, structured_outputs=
                                            Constraint(reasoning_end="</think>", thinking_token_budget=3)),
                        use_tqdm=False)[0].outputs[0]
    plain = llm.generate("x", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert free.token_ids[:4] == plain.token_ids + [end] and len(free.token_ids) == 10


def test_a_dead_end_stops_the_request_with_a_logged_reason(checkpoint, tmp_path, caplog):
    """A vocabulary of words "t0".."t1023" can spell "t1t2" but never the "!" after it, nor any JSON."""
    build_word_tokenizer(1024, eos_token_id=1017).save_pretrained(tmp_path)
    words = LLM(checkpoint, tokenizer=str(tmp_path), max_model_len=256)
    with caplog.at_level(logging.WARNING, logger="deltaserve.engine.llm_engine"):
        outputs = words.generate(["t1 t2", "t3"], [
            SamplingParams(temperature=0, max_tokens=20, structured_outputs=Constraint(regex="t1t2!")),
            SamplingParams(temperature=0, max_tokens=20, structured_outputs=Constraint(json={"type": "object"})),
        ], use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs] == [([1, 2], "stop"), ([], "stop")]
    assert caplog.text.count("no token can continue the grammar") == 2
    assert words.engine.scheduler.has_unfinished() is False


def test_invalid_constraints_are_refused_naming_the_field(llm):
    for constraint, fragment in [
        (Constraint(json={"type": "nothing"}), 'json: Unsupported type "nothing"'),
        (Constraint(json='{"type": '), "json: the schema is not valid JSON"),
        (Constraint(regex="([a-z"), "regex: Regex parsing error"),
        (Constraint(grammar='root ::= "a" |'), "grammar: EBNF parser error"),
        (Constraint(json={"type": "integer", "minimum": 5, "maximum": 1}), "json: Invalid range"),
        (Constraint(json={}, reasoning_end="not one token"), "reasoning_end: 'not one token' is"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
            llm.engine.add_request("bad", "x", SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=Constraint(regex="a"))
    with pytest.raises(ValueError, match=r"one constraint, got \['json', 'regex'\]"):
        Constraint(json={}, regex="a")

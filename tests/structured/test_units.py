"""The structured-output parts on their own: the compiler's view of the vocabulary, the schema preparation for
xgrammar (with canaries that fail once xgrammar no longer needs it), the bitmask fill and the sampler's mask."""

import json

import pytest
import torch
import xgrammar

from deltaserve.sampling import SamplingParams
from deltaserve.worker.sampler import Sampler
from deltaserve.structured import StructuredOutputsParams as Constraint
from deltaserve.structured.bitmask import GrammarMask, bitmask_width
from deltaserve.structured.compiler import CompiledConstraint, GrammarCompiler
from deltaserve.structured.json_schema import prepare_schema
from deltaserve.structured.matcher import GrammarState, fill_bitmask
from deltaserve.structured.params import GrammarError

EOS = 1017  # the demo tokenizer's <|im_end|>
PADDED_VOCAB = 1056  # the model's vocabulary may be larger than the tokenizer's (padding ids)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, PADDED_VOCAB, {EOS})


def allowed(state: GrammarState, vocab: int = PADDED_VOCAB) -> set[int]:
    bitmask = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    rows = fill_bitmask([(0, state)], bitmask)
    if not rows:
        return set(range(vocab))
    bits = (bitmask[0, :, None] >> torch.arange(32)) & 1  # [W, 32]
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


def test_special_and_padding_ids_are_never_allowed_and_eos_only_at_the_end(compiler, tokenizer):
    state = GrammarState(compiler.compile(Constraint(json={"type": "object", "properties": {
        "a": {"type": "string"}}, "required": ["a"]})))
    for token in tokenizer.encode('{"a": "', add_special_tokens=False):
        state.accept(token)
    inside_string = allowed(state)
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}  # <|endoftext|> ... <|im_end|>
    assert specials == {1015, 1016, 1017}
    assert not inside_string & specials and not inside_string & set(range(len(tokenizer), PADDED_VOCAB))
    assert tokenizer.convert_tokens_to_ids("<think>") in inside_string  # added but not special: text
    for token in tokenizer.encode('x"}', add_special_tokens=False):
        state.accept(token)
    assert allowed(state) == {EOS}
    state.accept(EOS)
    assert (state.end, state.error) == ("the grammar is complete", False)


def test_a_refused_token_ends_the_state_as_an_error(compiler, tokenizer):
    state = GrammarState(compiler.compile(Constraint(choice=["yes"])))
    state.accept(tokenizer.encode("no", add_special_tokens=False)[0])
    assert state.error and "refused token" in state.end and not state.masks


@pytest.mark.parametrize("token", [5, 31, 63, 1000])
def test_the_thinking_budget_forces_the_end_token_alone(token):
    state = GrammarState(CompiledConstraint(None, reasoning_end_id=token, thinking_token_budget=2))
    assert allowed(state) == set(range(PADDED_VOCAB))  # free while under budget
    state.accept(7)
    state.accept(token if token == 7 else 8)
    assert allowed(state) == {token}
    state.accept(token)
    assert not state.reasoning and allowed(state) == set(range(PADDED_VOCAB))  # no grammar after it: free


def test_the_batch_fill_matches_one_row_at_a_time(compiler, tokenizer):
    specs = [Constraint(json={"type": "integer"}), Constraint(regex="[ab]+c"), Constraint(choice=["x", "yz"])]
    states = [GrammarState(compiler.compile(spec)) for spec in specs]
    one_by_one = [allowed(state) for state in states]
    bitmask = torch.zeros(4, bitmask_width(PADDED_VOCAB), dtype=torch.int32)
    assert fill_bitmask([(3, states[0]), (0, states[1]), (1, states[2])], bitmask) == [0, 1, 3]
    again = torch.zeros_like(bitmask)
    for row, state in ((3, states[0]), (0, states[1]), (1, states[2])):
        fill_bitmask([(row, state)], again)
    assert torch.equal(bitmask[[0, 1, 3]], again[[0, 1, 3]]) and one_by_one[1] != one_by_one[2]


def test_the_sampler_masks_only_the_listed_rows_and_renormalises_their_logprobs():
    torch.manual_seed(0)
    vocab = 70
    logits = torch.randn(3, vocab)
    bitmask = torch.zeros(3, bitmask_width(vocab), dtype=torch.int32)
    bitmask[1, 0] = 1 << 5
    bitmask[1, 2] = 1 << 3  # token 67
    params = [SamplingParams(temperature=0, logprobs=1)] * 3
    plain = Sampler()(logits, params, [None] * 3, [[]] * 3, [[]] * 3, [set()] * 3)
    masked = Sampler()(logits, params, [None] * 3, [[]] * 3, [[]] * 3, [set()] * 3, GrammarMask(bitmask, [1]))
    best = 5 if logits[1, 5] > logits[1, 67] else 67
    assert masked.token_ids == [plain.token_ids[0], best, plain.token_ids[2]]
    assert masked.logprobs[0] == plain.logprobs[0] and masked.logprobs[2] == plain.logprobs[2]
    assert masked.logprobs[1] == pytest.approx(float(logits[1, best] - torch.logsumexp(logits[1, [5, 67]], 0)))
    assert masked.top_logprobs[1][0][0] == best


def test_prepare_schema_rewrites_string_lengths_and_refuses_what_xgrammar_ignores():
    schema = {"type": "object", "properties": {"not": {"type": "string", "maxLength": 3},  # a property named "not"
                                               "tags": {"type": "array", "items": {"type": "string", "minLength": 1}}},
              "default": {"not": {"maxLength": 3}}}
    assert prepare_schema(schema) == {"type": "object", "properties": {
        "not": {"type": "string", "pattern": "^[\\s\\S]{0,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[\\s\\S]{1,}$"}}},
        "default": {"not": {"maxLength": 3}}}
    assert prepare_schema(schema, rewrite_lengths=False) == schema
    for bad, fragment in [
        ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
        ({"properties": {"x": {"not": {"type": "null"}}}}, "'not' (at properties.x)"),
        ({"if": {}, "then": {}}, "'if'"),
        ({"dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "'allOf' of several"),
        ({"type": "string", "pattern": "a+", "maxLength": 3}, "'maxLength' beside 'pattern'"),
        ({"type": "string", "format": "email", "minLength": 3}, "'minLength' beside 'format'"),
    ]:
        with pytest.raises(GrammarError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            prepare_schema(bad)
    assert prepare_schema({"uniqueItems": False, "allOf": [{"type": "integer"}]})


def _xgrammar_accepts(compiler, schema: dict, text: str) -> bool:
    grammar = compiler._xgrammar_compiler().compile_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("schema, invalid", [
    ({"type": "string", "maxLength": 6}, '"ab\x04"'),  # a raw control character: not JSON (xgrammar issue 800)
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"not": {"type": "integer"}}, "4"),
    ({"properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"'),
])
def test_canary_xgrammar_still_needs_prepare_schema(compiler, schema, invalid):
    """When one of these fails, xgrammar enforces that keyword now: drop its handling from json_schema.py."""
    assert _xgrammar_accepts(compiler, schema, invalid)
    prepared_is_strict = True
    try:
        prepared = prepare_schema(schema)
        prepared_is_strict = not _xgrammar_accepts(compiler, prepared, invalid)
    except GrammarError:
        pass
    assert prepared_is_strict


def test_constraint_shapes_are_checked_on_construction():
    for kwargs, fragment in [
        ({}, "needs one of"),
        ({"regex": 5}, "regex must be a string"),
        ({"choice": ["a", 1]}, "non-empty list of strings"),
        ({"grammar": " "}, "grammar must be a non-empty string"),
        ({"json": {}, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
        ({"json": {}, "thinking_token_budget": 3}, "needs a reasoning model's end-of-thinking token"),
        ({"reasoning_end": "</think>", "thinking_token_budget": -1}, "integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            Constraint(**kwargs)
    assert Constraint(json_object=False, regex="a").kind == "regex"
    assert Constraint(reasoning_end="</think>", thinking_token_budget=0).kind is None

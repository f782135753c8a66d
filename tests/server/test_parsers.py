"""Reasoning and tool-call parsing of scripted Qwen3 / Qwen3.5 outputs, non-streaming and streaming.

The central property: for every scripted output, feeding it in any chunking (seeded random cuts, and one
character at a time) and accumulating the deltas gives exactly the non-streaming parse, and streamed tool
arguments concatenate to valid JSON.
"""

import json
import random
import re

import pytest

from deltaserve.server.parsers import (REASONING_PARSERS, TOOL_PARSERS, ChatOutputParser, ParsedDelta,
                                       get_reasoning_parser, get_tool_parser)
from deltaserve.server.reasoning import Qwen3ReasoningParser
from deltaserve.server.tool_calls import HermesToolParser, Qwen3XMLToolParser
from deltaserve.server.tool_types import ContentDelta, ToolCallDelta, convert_parameter

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
        "threshold": {"type": "number"}, "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "options": {"type": "object"},
        "lines": {"type": "array", "items": {"type": "integer"}}}}}},
]


def xml_call(name, **params):
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = xml_call("get_weather", city="Paris", days="3")
WEATHER_ARGS = {"city": "Paris", "days": 3}
FILE_TEXT = 'line "one"\n\tline <two> \\ é 日本\n'
WRITE = xml_call("write_file", path="/tmp/a.py", content=FILE_TEXT, options="{'mode': 'w', 'sync': True}",
                 lines="[1, 2, 3]")
WRITE_ARGS = {"path": "/tmp/a.py", "content": FILE_TEXT, "options": {"mode": "w", "sync": True},
              "lines": [1, 2, 3]}

# name -> (model output, parser kwargs, expected reasoning, content, [(function, arguments)])
CASES = {
    "plain": ("Hello, world!\n\nBye.", {}, "Hello, world!\n\nBye.", None, []),
    "plain_no_reasoning_parser": ("Hello <b>there</b>", {"reasoning_parser": None}, None,
                                  "Hello <b>there</b>", []),
    "reasoning_only": ("Thinking hard\nstill thinking", {}, "Thinking hard\nstill thinking", None, []),
    "reasoning_content": ("Let me think.\n</think>\n\nThe answer is 4.", {}, "Let me think.",
                          "The answer is 4.", []),
    "opening_tag": ("<think>\nHmm.\n</think>\n\nYes.", {}, "Hmm.", "Yes.", []),
    "opening_tag_after_space": ("\n <think>a < b\n\n</think>\n\n\nc", {}, "a < b", "c", []),
    "lookalike_tags": ("</thin>k <thinking> </think>x </think> y", {}, "</thin>k <thinking> ",
                       "x </think> y", []),
    "thinking_disabled": ("No thoughts.\n</think>\n\nStill content", {"thinking_enabled": False}, None,
                          "No thoughts.\n</think>\n\nStill content", []),
    "one_call": (f"Check.\n</think>\n\nLet me look.\n\n{WEATHER}", {}, "Check.", "Let me look.",
                 [("get_weather", WEATHER_ARGS)]),
    "two_calls": (f"</think>\n\n{WEATHER}\n{WRITE}\n", {}, None, None,
                  [("get_weather", WEATHER_ARGS), ("write_file", WRITE_ARGS)]),
    "typed_params": ("</think>" + xml_call("get_weather", city='  "Nice"  \n', days="-7", celsius="False",
                                           threshold="2.5", note="null"), {}, None, None,
                     [("get_weather", {"city": '  "Nice"  \n', "days": -7, "celsius": False,
                                       "threshold": 2.5, "note": None})]),
    "call_inside_thinking": (f"I need the weather.\n{WEATHER}", {}, "I need the weather.", None,
                             [("get_weather", WEATHER_ARGS)]),
    "thinking_disabled_call": (f"Sure.{WEATHER}", {"thinking_enabled": False}, None, "Sure.",
                               [("get_weather", WEATHER_ARGS)]),
    "unterminated_call": ("</think>Writing.\n<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n"
                          "</parameter>\n<parameter=content>\nprint(1)\n</para", {}, None, "Writing.",
                          [("write_file", {"path": "x.py", "content": "print(1)"})]),
    "forgotten_closing_tags": ("</think><tool_call><function=get_weather><parameter=city>Oslo"
                               "<parameter=days>2</function>after", {}, None, "after",
                               [("get_weather", {"city": "Oslo", "days": 2})]),
    "no_function_tag": ("</think>Text <tool_call>\nnot a call</tool_call> end", {}, None,
                        "Text <tool_call>\nnot a call</tool_call> end", []),
    "bad_function_name": ("</think><tool_call><function=a\nb>\n</tool_call>", {}, None,
                          "<tool_call><function=a\nb>\n</tool_call>", []),
    "parameter_outside_function": ("</think><parameter=city>\nParis\n</parameter> ok", {}, None,
                                   "<parameter=city>\nParis\n</parameter> ok", []),
    "garbage_inside_function": ("</think><tool_call><function=get_weather>junk << <parameter=days>5"
                                "</parameter>tail</function></tool_call>", {}, None, None,
                                [("get_weather", {"days": 5})]),
    "unknown_function_and_params": ("</think>" + xml_call("lookup", q="x", n="12", obj='{"a": [1]}'), {},
                                    None, None, [("lookup", {"q": "x", "n": 12, "obj": {"a": [1]}})]),
    "tool_choice_none": (f"</think>{WEATHER}", {"tool_choice": "none"}, None, WEATHER, []),
    "truncated_block_end": (f"</think>{WEATHER[:-4]}", {}, None, None, [("get_weather", WEATHER_ARGS)]),
    "truncated_tool_call_tag": ("</think>Done <tool_ca", {}, None, "Done <tool_ca", []),
    "hermes_calls": ('</think>\n\nOK.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome",'
                     ' "days": 1}}\n</tool_call>\n<tool_call>\n{"name": "x", "arguments": "{\\"a\\": 1}"}\n'
                     "</tool_call>", {"tool_parser": "hermes"}, None, "OK.",
                     [("get_weather", {"city": "Rome", "days": 1}), ("x", {"a": 1})]),
    # too deep for json_limits (a RecursionError from json.loads past ~1,000 levels): not a call
    "hermes_too_deep": ('</think><tool_call>{"name": "f", "arguments": {"a": ' + "[" * 2000 + "]" * 2000 +
                        "}}</tool_call>", {"tool_parser": "hermes"}, None,
                        '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 2000 + "]" * 2000 + "}}</tool_call>",
                        []),
    "hermes_malformed": ("</think><tool_call>{not json}</tool_call><tool_call>[1]", {"tool_parser": "hermes"},
                         None, "<tool_call>{not json}</tool_call><tool_call>[1]", []),
}


def make_parser(**overrides):
    kwargs = {"reasoning_parser": "qwen3", "tool_parser": "qwen3_coder", "tools": TOOLS, **overrides}
    return ChatOutputParser(**kwargs)


def random_chunks(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def stream(parser, chunks):
    """Feed chunks, accumulate like an OpenAI client: (reasoning, content, [(name, arguments)], deltas)."""
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    reasoning = "".join(d.reasoning or "" for d in deltas) or None
    content = "".join(d.content or "" for d in deltas) or None
    calls = {}
    for call in (c for d in deltas for c in d.tool_calls):
        if call.id is not None:
            assert call.index == len(calls) and call.type == "function" and call.arguments == ""
            assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
            calls[call.index] = [call.name, ""]
        else:
            assert call.name is None and call.index in calls
            calls[call.index][1] += call.arguments
    return reasoning, content, [(name, args) for name, args in calls.values()], deltas


@pytest.mark.parametrize("name", sorted(CASES))
def test_non_streaming(name):
    text, kwargs, reasoning, content, calls = CASES[name]
    message = make_parser(**kwargs).parse(text)
    assert message.reasoning == reasoning
    assert message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) and c.type == "function" for c in message.tool_calls)


@pytest.mark.parametrize("name", sorted(CASES))
def test_streaming_equals_non_streaming_for_any_chunking(name):
    text, kwargs, reasoning, content, calls = CASES[name]
    expected = make_parser(**kwargs).parse(text)
    expected_calls = [(c.function.name, c.function.arguments) for c in expected.tool_calls]
    rng = random.Random(name)
    chunkings = [list(text), [text]] + [random_chunks(text, rng) for _ in range(25)]
    for chunks in chunkings:
        got_reasoning, got_content, got_calls, _ = stream(make_parser(**kwargs), chunks)
        assert (got_reasoning, got_content, got_calls) == (expected.reasoning, expected.content,
                                                           expected_calls), chunks
        assert [(n, json.loads(a)) for n, a in got_calls] == calls  # fragments concatenate to valid JSON


TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
        "</parameter>")


@pytest.mark.parametrize("name", ["reasoning_content", "opening_tag", "one_call", "two_calls",
                                  "call_inside_thinking", "unterminated_call"])
def test_no_tag_fragment_is_ever_streamed_as_text(name):
    text, kwargs, *_ = CASES[name]
    for chunks in (list(text), random_chunks(text, random.Random(1))):
        *_, deltas = stream(make_parser(**kwargs), chunks)
        for delta in deltas:
            for piece in (delta.reasoning, delta.content):
                # Every expected text here is tag-free, so no piece may hold any part of a tag.
                assert piece is None or not any(piece.endswith(tag[:k]) for tag in TAGS for k in
                                                range(1, len(tag) + 1)) and "<" not in piece, piece


def test_reasoning_parser_alone_keeps_tool_call_text_as_content_by_default():
    parser = Qwen3ReasoningParser()
    assert parser.extract("plan <tool_call>x</tool_call>") == ("plan <tool_call>x</tool_call>", None)
    assert Qwen3ReasoningParser(content_starts=("<tool_call>",)).extract("plan\n<tool_call>x") == (
        "plan", "<tool_call>x")
    assert parser.extract("") == (None, None)
    assert parser.extract("<think>\n\n</think>\n\n") == (None, None)
    assert Qwen3ReasoningParser(thinking_enabled=False).extract("") == (None, None)


def test_reasoning_streaming_holds_back_only_what_could_be_a_tag():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<thi") == (None, None)  # could still be "<think>"
    assert parser.feed("nk>\nStep one.\n") == ("Step one.", None)  # the newline may precede </think>
    assert parser.feed("Step two.</th") == ("\nStep two.", None)
    assert parser.feed("ink>\n\nDone") == (None, "Done")
    assert parser.feed(" now") == (None, " now")
    assert parser.finish() == (None, None)


def test_string_parameter_streams_before_its_closing_tag():
    parser = Qwen3XMLToolParser(TOOLS)
    head = parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nfirst part ")
    assert isinstance(head[0], ToolCallDelta) and head[0].name == "write_file" and head[0].arguments == ""
    assert "".join(d.arguments for d in head[1:]) == '{"content": "first part '
    assert parser.feed('"quoted"\n') == [ToolCallDelta(0, '\\"quoted\\"')]  # trailing newline held back
    tail = parser.feed("\n</parameter>\n</function>\n</tool_call>") + parser.finish()
    assert "".join(d.arguments for d in tail) == '\\n"}'


def test_a_string_of_fixed_form_is_sent_whole_and_trimmed():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"}}}}}]
    parser = Qwen3XMLToolParser(tools)
    parser.feed("<tool_call>\n<function=f>\n<parameter=city>")
    assert parser.feed("  Os") == []
    assert parser.feed("lo  </parameter>") == [ToolCallDelta(0, '"Oslo"')]


def test_non_string_parameter_is_sent_whole_when_it_ends():
    parser = Qwen3XMLToolParser(TOOLS)
    parser.feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n1")
    assert parser.feed("2") == []
    assert parser.feed("\n</parameter>") == [ToolCallDelta(0, "12")]


def test_delta_shapes_match_openai():
    header = ToolCallDelta(0, "", "call_0123456789abcdef01234567", "function", "f")
    assert header.to_dict() == {"index": 0, "id": "call_0123456789abcdef01234567", "type": "function",
                                "function": {"name": "f", "arguments": ""}}
    assert ToolCallDelta(1, '{"a"').to_dict() == {"index": 1, "function": {"arguments": '{"a"'}}
    _, calls = Qwen3XMLToolParser.extract(WEATHER, TOOLS)
    assert calls[0].to_dict()["function"] == {"name": "get_weather", "arguments": json.dumps(WEATHER_ARGS)}


def test_content_and_calls_from_the_tool_parser_alone():
    assert Qwen3XMLToolParser.extract("just text\n") == ("just text\n", [])
    content, calls = HermesToolParser.extract('a <tool_call>{"name": "f"}</tool_call> b')
    assert content == "ab" and calls[0].function.arguments == "{}"
    items = Qwen3XMLToolParser(TOOLS).feed("Hi <tool")
    assert items == [ContentDelta("Hi")]  # the space and "<tool" are held: they may vanish with a call
    # A hermes block that cannot be JSON is content at once, not only at its closing tag.
    assert HermesToolParser().feed("<tool_call> no") == [ContentDelta("<tool_call> no")]


@pytest.mark.parametrize("value, schema, expected", [
    ("42", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4.0),  # not an integer: falls back to JSON
    ("forty", {"type": "integer"}, "forty"),
    ("1e3", {"type": "number"}, 1000.0),
    ("nan", {"type": "number"}, "nan"),  # NaN is not JSON: kept as text
    ("TRUE", {"type": "boolean"}, True),
    ("None", {"type": ["object", "null"]}, None),
    ("[1, (2, 3)]", {"type": "array"}, [1, [2, 3]]),  # a Python tuple becomes a JSON array
    ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a set has no JSON form: kept as text
    ("{'a': None}", {"type": "object"}, {"a": None}),
    ("[1]", {"type": "object"}, [1]),  # wrong JSON type: generic JSON fallback
    ("007", {"type": "string"}, "007"),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
    ("x y", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x y"),
    ("Infinity", None, "Infinity"),
    ('{"k": 1}', None, {"k": 1}),
    ("7" * 5000, {"type": "integer"}, "7" * 5000),  # more digits than Python converts: kept as text
    ("[" * 300 + "]" * 300, {"type": "array"}, "[" * 300 + "]" * 300),  # deeper than json_limits takes
    # a string whose form the schema fixes is trimmed (a grammar writes the whitespace around it as layout)
    ("  Oslo \n", {"type": "string", "pattern": "^[A-Z][a-z]+$"}, "Oslo"),
    (" celsius", {"enum": ["celsius", 3]}, "celsius"),
    (" 3 ", {"enum": ["celsius", 3]}, 3),
    (" ab ", {"type": "string", "maxLength": 4}, "ab"),
    (" ab ", {"type": "string"}, " ab "),
])
def test_convert_parameter(value, schema, expected):
    assert convert_parameter(value, schema) == expected


def test_registries_and_bad_arguments():
    assert get_reasoning_parser("deepseek_r1") is REASONING_PARSERS["qwen3"]
    assert get_tool_parser("qwen3_xml") is get_tool_parser("qwen3_coder") is TOOL_PARSERS["qwen3_xml"]
    with pytest.raises(ValueError, match=r"'qwen4'.*deepseek_r1, qwen3"):
        get_reasoning_parser("qwen4")
    with pytest.raises(ValueError, match=r"'json'.*hermes, qwen3_coder, qwen3_xml"):
        ChatOutputParser(tool_parser="json", tools=TOOLS)
    with pytest.raises(ValueError, match="tool_choice"):
        ChatOutputParser(tool_parser="qwen3_xml", tools=TOOLS, tool_choice="always")
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        ChatOutputParser(tool_parser="qwen3_xml", tools=[{"type": "function"}])
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert make_parser(tool_choice=named).parse(WEATHER).tool_calls[0].function.name == "get_weather"
    no_tools = make_parser(tools=None, reasoning_parser=None)
    assert no_tools.parse(WEATHER).content == WEATHER  # no tools: nothing to call


@pytest.mark.parametrize("seed", range(40))
def test_random_garbage_never_raises_and_streams_consistently(seed):
    rng = random.Random(seed)
    pieces = list(TAGS) + ["<function=get_weather>", "<parameter=days>", "<parameter=city>", "\n", " ",
                           "x", "12", "{", "}", '"', "<", ">", "=", "é"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
    for tool_parser in ("qwen3_xml", "hermes"):
        expected = make_parser(tool_parser=tool_parser).parse(text)
        chunks = random_chunks(text, rng) if len(text) > 1 else [text]
        got = stream(make_parser(tool_parser=tool_parser), chunks)
        assert got[:2] == (expected.reasoning, expected.content)
        assert got[2] == [(c.function.name, c.function.arguments) for c in expected.tool_calls]
        for _, arguments in got[2]:
            assert isinstance(json.loads(arguments), dict)


def test_parsed_delta_is_empty_for_nothing():
    parser = make_parser()
    assert parser.feed("") == ParsedDelta()
    assert parser.finish() == ParsedDelta()

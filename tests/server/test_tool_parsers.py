"""Reading tool calls out of model outputs (graphrt.server.tool_parsers), on fixed texts: each parser
whole, and streamed in small random fragments, where the deltas must add up to what the whole
output gives and nothing that may begin a call is sent as content."""

from __future__ import annotations

import json
import random

import pytest

for package in ("fastapi", "uvicorn"):  # graphrt.server imports the server stack: not on every GPU image
    pytest.importorskip(package)

from graphrt.server.tool_parsers import (  # noqa: E402
    READERS,
    HermesReader,
    Llama3JsonReader,
    MistralReader,
    NamedReader,
    ParsedToolCall,
    RequiredReader,
    ToolCallStream,
    detect_tool_call_parser,
    markers_are_special_tokens,
    parse_tool_calls,
)

TOOLS = ["get_weather", "get_time"]
WEATHER = ParsedToolCall("get_weather", '{"city": "Paris"}')
TIME = ParsedToolCall("get_time", '{"zone": "UTC"}')

# (reader, output, content, calls)
WELL_FORMED = [
    (HermesReader, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [WEATHER]),
    (HermesReader, 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                   '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>', "Let me look.", [WEATHER, TIME]),
    (HermesReader, '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [TIME]),  # ended before its end marker
    (HermesReader, '<tool_call>{"name": "get_time"}</tool_call>', None, [ParsedToolCall("get_time", "{}")]),  # no arguments
    (HermesReader, '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}</tool_call>', None,
     [ParsedToolCall("get_weather", '{"city": "Pa\\"ris}"}')]),  # a quote and a brace inside a string
    (Llama3JsonReader, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "arguments": {"zone": "UTC"}}',
     None, [WEATHER, TIME]),
    (Llama3JsonReader, '\n{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),  # the tag decoded away
    (Llama3JsonReader, 'Checking. <|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "Checking.", [TIME]),
    (MistralReader, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]',
     None, [WEATHER, TIME]),
    (MistralReader, 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure.", [TIME]),
    (MistralReader, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [WEATHER]),  # the marker decoded away
    (RequiredReader, '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{"zone":"UTC"}}]', None,
     [ParsedToolCall("get_weather", '{"city":"Paris"}'), ParsedToolCall("get_time", '{"zone":"UTC"}')]),
]

# (reader, output): each is content, whole, as vLLM reads it
NOT_CALLS = [
    (HermesReader, "The weather in Paris is <b>sunny</b>; use <tool now."),
    (HermesReader, '<tool_call>{"name": "get_stock", "arguments": {"ticker": "X"}}</tool_call>'),  # not a given tool
    (HermesReader, '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'),  # not JSON
    (HermesReader, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    (HermesReader, '<tool_call>get_weather(city="Paris")</tool_call>'),
    (HermesReader, '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'),  # arguments not an object
    (Llama3JsonReader, '{"answer": 42}'),  # JSON, but no call
    (Llama3JsonReader, 'I would call {"name": "get_weather", "parameters": {"city": "Paris"}}'),  # no tag, not at the start
    (MistralReader, "[1, 2, 3] are numbers."),
    (HermesReader, '<tool_call>{"name": "get\nweather", "arguments": {}}</tool_call>'),  # a raw newline: no JSON string
    (HermesReader, '<tool_call>{"na\\qme": "get_weather", "arguments": {}}</tool_call>'),  # an escape JSON has not
    (MistralReader, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}}]'),
]


def streamed(reader, text: str, rng: random.Random, max_calls: int | None = None) -> tuple[str, list[dict], list[dict]]:
    """The deltas a stream sends for `text` fed in fragments of 1 to 6 characters, as (content,
    calls as a client puts them together, the deltas themselves)."""
    stream = ToolCallStream(reader, max_calls)
    deltas, end = [], 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 6))
        deltas += stream.feed(text[:end])
    deltas += stream.feed(text, final=True)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"name": None, "arguments": ""})
            if "id" in piece:
                assert call["name"] is None and piece["type"] == "function" and piece["function"]["arguments"] == ""
                assert piece["id"].startswith("call_") and len(piece["id"]) == 29
                call["name"] = piece["function"]["name"]
            assert call["name"] is not None  # a call opens before its arguments
            call["arguments"] += piece["function"]["arguments"]
    return "".join(delta.get("content", "") for delta in deltas), list(calls.values()), deltas


@pytest.mark.parametrize(("reader", "text", "content", "calls"), WELL_FORMED, ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_each_parser_reads_the_calls_and_the_content_before_them(reader, text, content, calls):
    assert parse_tool_calls(reader(TOOLS), text) == (content, calls)
    assert all(json.loads(call.arguments) is not None for call in calls)


@pytest.mark.parametrize(("reader", "text", "content", "calls"), WELL_FORMED, ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_streamed_in_fragments_the_deltas_add_up_to_the_whole(reader, text, content, calls):
    rng = random.Random(text)
    for _ in range(20):
        streamed_content, streamed_calls, _ = streamed(reader(TOOLS), text, rng)
        assert streamed_content == (content or "")
        assert streamed_calls == [{"name": call.name, "arguments": call.arguments} for call in calls]


@pytest.mark.parametrize(("reader", "text"), NOT_CALLS, ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_what_is_no_well_formed_call_of_a_given_tool_stays_content(reader, text):
    assert parse_tool_calls(reader(TOOLS), text) == (text, [])


@pytest.mark.parametrize(("reader", "text"), [case for case in NOT_CALLS if "get_weather" not in case[1]], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_a_stream_sends_text_that_is_no_call_as_content(reader, text):
    content, calls, _ = streamed(reader(TOOLS), text, random.Random(text))
    assert (content, calls) == (text, [])


@pytest.mark.parametrize(("reader", "opening"), [(HermesReader, "<tool_call>"), (Llama3JsonReader, "<|python_tag|>"), (MistralReader, "[TOOL_CALLS][")])
def test_text_that_may_begin_a_call_is_held_back_until_it_cannot(reader, opening):
    stream = ToolCallStream(reader(TOOLS))
    assert stream.feed("It is " + opening[:3]) == [{"content": "It is"}]  # the space may come before a call
    assert stream.feed("It is " + opening[:3] + "x") == [{"content": " " + opening[:3] + "x"}]  # no marker after all
    fresh = ToolCallStream(reader(TOOLS))
    assert fresh.feed("Hi " + opening + '{"name": "get_weath') == [{"content": "Hi"}]  # not sent until the name is known
    opened = fresh.feed("Hi " + opening + '{"name": "get_weather", "arguments": {"ci')
    assert opened[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert opened[1]["tool_calls"][0]["function"] == {"arguments": '{"ci'}


@pytest.mark.parametrize(("reader", "start"), [(Llama3JsonReader, '{"name": "get_stock", "parameters": {}}'), (MistralReader, "[TOOL")])
def test_a_bare_start_is_held_while_it_may_be_a_call_and_then_released(reader, start):
    stream = ToolCallStream(reader(TOOLS))
    assert stream.feed("\n ") == []  # whitespace alone may come before a call
    assert stream.feed("\n " + start[:8]) == []
    text = "\n " + start + " is what I would write."
    assert stream.feed(text) == [{"content": text}]  # no call of a given tool, nor "[TOOL_CALLS]"


def test_a_stream_keeps_a_call_whose_arguments_were_cut_off_and_says_nothing_more():
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, _ = streamed(HermesReader(TOOLS), text, random.Random(0))
    assert content == "Sure." and calls == [{"name": "get_weather", "arguments": '{"city": "Par'}]
    assert parse_tool_calls(HermesReader(TOOLS), text) == (text, [])  # whole, it is no call


# (reader, output, content, calls a stream sends): under "auto", a call whose object breaks after its
# name and the start of its arguments went out. Whole, each is content; streamed, the call stays a
# call and the rest of the output is its arguments, never content sent again.
BROKEN_AFTER_OPENING = [
    (HermesReader, 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"} "oops"}</tool_call>', "Sure.",
     [("get_weather", '{"city": "Paris"} "oops"}</tool_call>')]),
    (Llama3JsonReader, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}, 7: 1}', "",
     [("get_weather", '{"city": "Paris"}, 7: 1}')]),
    (MistralReader, 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}] and so on', "Checking.",
     [("get_weather", '{"city": "Paris"}] and so on')]),
    (HermesReader, '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
                   '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}; x</tool_call>', "",
     [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Paris"}; x</tool_call>')]),  # the second call breaks
]


@pytest.mark.parametrize(("reader", "text", "content", "calls"), BROKEN_AFTER_OPENING, ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_a_call_that_breaks_after_it_went_out_stays_a_call_and_the_rest_is_its_arguments(reader, text, content, calls):
    assert parse_tool_calls(reader(TOOLS), text) == (text, [])  # whole, as vLLM reads it, no call
    for seed in range(10):
        streamed_content, streamed_calls, deltas = streamed(reader(TOOLS), text, random.Random(seed))
        assert streamed_content == content
        assert streamed_calls == [{"name": name, "arguments": arguments} for name, arguments in calls]
        first_call = next(number for number, delta in enumerate(deltas) if "tool_calls" in delta)
        assert not any("content" in delta for delta in deltas[first_call:])


def test_a_chat_stream_whose_call_broke_after_it_went_out_ends_with_tool_calls():
    """The chat response's stream (graphrt.server.responses), as a client reads its chunks."""
    from graphrt.server.responses import ChatFormat, ChoiceState
    from graphrt.server.tool_choice import ToolCalling

    text = BROKEN_AFTER_OPENING[0][1]
    chat = ChatFormat("m", tool_calling=ToolCalling(HermesReader(TOOLS), max_calls=None, named=False))
    choice, pieces = ChoiceState(), []
    for end in range(1, len(text) + 1):
        choice.text, choice.num_streamable = text[:end], end
        choice.finish_reason = "stop" if end == len(text) else None
        pieces += chat.delta_choices(0, choice, choice.take_delta())
    assert "".join(piece["delta"].get("content", "") for piece in pieces) == "Sure."
    assert [piece["finish_reason"] for piece in pieces if piece["finish_reason"]] == ["tool_calls"]


def test_a_key_written_again_neither_renames_nor_rewrites_a_call_that_went_out():
    renamed = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}, "name": "get_time"}</tool_call>'
    _, calls, _ = streamed(HermesReader(TOOLS), renamed, random.Random(3))
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}, "name": "get_time"}</tool_call>'}]
    rewritten = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}, "arguments": {"city": "Rome"}}</tool_call>'
    _, calls, _ = streamed(HermesReader(TOOLS), rewritten, random.Random(4))
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}, "arguments": {"city": "Rome"}}</tool_call>'}]
    # Whole, the JSON reads as json.loads reads it: the last key counts.
    assert parse_tool_calls(HermesReader(TOOLS), renamed) == (None, [ParsedToolCall("get_time", '{"city": "Paris"}')])


def test_max_calls_keeps_the_first():
    text = WELL_FORMED[1][1]
    assert parse_tool_calls(HermesReader(TOOLS), text, max_calls=1) == ("Let me look.", [WEATHER])
    assert [call["name"] for call in streamed(HermesReader(TOOLS), text, random.Random(1), max_calls=1)[1]] == ["get_weather"]


def test_a_named_tool_choice_makes_the_whole_output_the_arguments():
    reader = NamedReader("get_weather")
    assert parse_tool_calls(reader, '{"city":"Paris"}') == (None, [ParsedToolCall("get_weather", '{"city":"Paris"}')])
    assert parse_tool_calls(reader, '{"city":"Pa') == ('{"city":"Pa', [])  # cut off at max_tokens
    content, calls, deltas = streamed(reader, '{"city":"Paris"}', random.Random(2))
    assert (content, calls) == ("", [{"name": "get_weather", "arguments": '{"city":"Paris"}'}])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


@pytest.mark.parametrize(("template", "parser"), [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %} <tool_call></tool_call>", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% if message.role == 'ipython' %}{% endif %}", "llama3_json"),
    ("{{ messages[0]['content'] }}", "hermes"),
    (None, "hermes"),
])
def test_the_parser_is_the_one_the_chat_template_writes(template, parser):
    assert detect_tool_call_parser(template) == parser
    assert parser in READERS


def test_the_server_takes_only_a_parser_there_is():
    from graphrt.server import ServerSettings

    assert ServerSettings(model_id="m", tool_call_parser="mistral").tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json, mistral, got 'pythonic'"):
        ServerSettings(model_id="m", tool_call_parser="pythonic")


# --- markers that are special tokens ----------------------------------------------------------

@pytest.fixture(scope="module")
def marked_tokenizer(default_model):
    """SmolLM2's tokenizer with Mistral's and Llama 3's markers added as special tokens, as their
    own tokenizers have them."""
    from transformers import AutoTokenizer

    from graphrt.frontend.tokenizer import Tokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(default_model)
    hf_tokenizer.add_tokens(["[TOOL_CALLS]", "<|python_tag|>"], special_tokens=True)
    return Tokenizer(hf_tokenizer)


@pytest.mark.slow
def test_the_server_keeps_special_tokens_where_a_parsers_marker_is_one(default_model, marked_tokenizer):
    from graphrt.frontend.tokenizer import Tokenizer

    assert markers_are_special_tokens("mistral", marked_tokenizer) and markers_are_special_tokens("llama3_json", marked_tokenizer)
    assert not markers_are_special_tokens("hermes", marked_tokenizer)  # <tool_call> is plain text here, as in Qwen's
    plain = Tokenizer.from_dir(default_model)
    assert not any(markers_are_special_tokens(parser, plain) for parser in READERS)
    assert not markers_are_special_tokens("mistral", None)  # a model without a tokenizer


@pytest.mark.slow
@pytest.mark.parametrize(("reader", "marker", "call"), [
    (MistralReader, "[TOOL_CALLS]", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
    (Llama3JsonReader, "<|python_tag|>", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
])
def test_a_marker_that_is_a_special_token_is_read_only_where_decoding_keeps_it(marked_tokenizer, reader, marker, call):
    """What the parser sees of the model's tokens: with the marker kept (skip_special_tokens=False,
    as the server decodes a tools "auto" request here), the call after a sentence is a call;
    with it dropped (the default) the call runs into the sentence and is content."""
    [marker_id] = marked_tokenizer.encode(marker)
    token_ids = marked_tokenizer.encode("Let me check. " + marker + call)
    assert marker_id in token_ids
    kept = marked_tokenizer.decode(token_ids, skip_special_tokens=False)
    assert parse_tool_calls(reader(TOOLS), kept) == ("Let me check.", [TIME])
    dropped = marked_tokenizer.decode(token_ids)
    assert marker not in dropped and parse_tool_calls(reader(TOOLS), dropped) == (dropped, [])
    content, calls, _ = streamed(reader(TOOLS), kept, random.Random(marker))
    assert (content, calls) == ("Let me check.", [{"name": "get_time", "arguments": '{"zone": "UTC"}'}])


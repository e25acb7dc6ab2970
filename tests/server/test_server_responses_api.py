"""`POST /v1/responses` through the openai client: the Responses API served statelessly, as the chat
route serves the same conversation. The default model's server (conftest.py's, shared with other
modules); the translation itself is tested without one."""

from __future__ import annotations

import json

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx", "jsonschema"):  # not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402

from graphrt.frontend.tokenizer import Tokenizer  # noqa: E402
from graphrt.sampling_params import TokenLogprob  # noqa: E402
from graphrt.server.errors import APIError  # noqa: E402
from graphrt.server.responses import ChatFormat, ChoiceState  # noqa: E402
from graphrt.server.responses_api import parse_responses_request  # noqa: E402
from graphrt.server.responses_output import ResponsesEvents, ResponsesFormat  # noqa: E402
from graphrt.server.tool_choice import ToolCalling  # noqa: E402
from graphrt.server.tool_parsers import HermesReader  # noqa: E402
from helpers import SERVED_API_KEY  # noqa: E402

slow = pytest.mark.slow  # the tests that use the server

API_KEY = SERVED_API_KEY
MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False},
    "strict": True,
}


@pytest.fixture(scope="module")
def server(default_model_process_server):
    return default_model_process_server  # the engine in its own process, shared with other modules (conftest.py)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_dir(default_model)


def test_input_items_become_the_chat_conversation_they_mean():
    request = parse_responses_request(json.dumps({
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Rain."},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Sun."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}], "status": "incomplete"},
        ],
        "max_output_tokens": 8,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": PERSON, "strict": True}},
        "tools": [WEATHER],
        "tool_choice": "auto",
    }).encode())
    chat = request.chat_request()
    call = lambda call_id, city: {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}  # noqa: E731
    assert [m.template_dict() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        # the text said before the calls and both calls are one assistant turn; the empty one at the end is left out
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call("call_1", "Paris"), call("call_2", "Rome")]},
        {"role": "tool", "content": "Rain.", "tool_call_id": "call_1"},
        {"role": "tool", "content": "Sun.", "tool_call_id": "call_2"},
    ]
    assert [source for source, _ in request.conversation()] == ["instructions", "input[0]", "input[1]", "input[4]", "input[5]"]
    assert chat.resolved_max_tokens() == 8 and chat.tool_choice == "auto" and chat.tools[0].function.name == "get_weather"
    assert json.loads(chat.structured_output().json) == PERSON


def test_what_agent_frameworks_pass_through_from_their_settings_is_accepted_and_changes_nothing():
    """The OpenAI Agents SDK's ModelSettings(truncation="auto", verbosity=..., prompt_cache_retention=...)
    and LangChain's and pydantic-ai's equivalents: refused, each failed every request of such an agent."""
    plain = {"input": "Hi", "max_output_tokens": 8, "temperature": 0}
    baseline = parse_responses_request(json.dumps(plain).encode()).chat_request()
    passed = parse_responses_request(json.dumps({
        **plain, "truncation": "auto", "text": {"verbosity": "low"}, "prompt_cache_key": "k", "prompt_cache_retention": "24h",
        "safety_identifier": "user-1",
    }).encode())
    assert passed.chat_request().sampling_params() == baseline.sampling_params() and passed.truncation == "auto"


def test_the_chat_requests_errors_name_what_the_responses_request_sent():
    request = parse_responses_request(json.dumps({
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}],
    }).encode())
    with pytest.raises(APIError) as raised, request.in_own_terms():
        request.chat_request()
    assert raised.value.param == "tools[0].parameters" and raised.value.message.startswith("tools[0].parameters: must be the schema of an object")
    # the chat template's error names the chat message; the client sent it as input[1]
    with pytest.raises(APIError) as raised, request.in_own_terms():
        raise APIError(400, "messages[2]: the model's chat template cannot render this message (x)")
    assert raised.value.message == "input[1]: the model's chat template cannot render this message (x)"
    with pytest.raises(APIError) as raised, request.in_own_terms():
        raise APIError(400, "messages[0].content: must be a non-empty string", param="messages[0].content")
    assert raised.value.param == "instructions"


def test_text_then_a_call_streams_as_a_message_then_a_function_call_that_the_sdk_validates():
    from openai.types import responses as sdk

    classes = [
        sdk.ResponseCreatedEvent, sdk.ResponseInProgressEvent, sdk.ResponseOutputItemAddedEvent, sdk.ResponseContentPartAddedEvent,
        sdk.ResponseTextDeltaEvent, sdk.ResponseTextDoneEvent, sdk.ResponseContentPartDoneEvent, sdk.ResponseOutputItemDoneEvent,
        sdk.ResponseFunctionCallArgumentsDeltaEvent, sdk.ResponseFunctionCallArgumentsDoneEvent, sdk.ResponseCompletedEvent,
    ]
    event_class = {cls.model_fields["type"].annotation.__args__[0]: cls for cls in classes}

    request = parse_responses_request(json.dumps({"input": "Weather in Paris?", "tools": [WEATHER], "stream": True}).encode())
    stream = ResponsesEvents(ResponsesFormat(MODEL, request, ChatFormat(MODEL)))
    chat_deltas = [
        {"content": "Let me "}, {"content": "look."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    sse = stream.opening() + [event for delta in chat_deltas for event in stream.delta(delta)]
    sse += stream.closing(12, ChoiceState(num_tokens=9, finish_reason="tool_calls"))
    payloads = [json.loads(text.split("data: ", 1)[1]) for text in sse]
    events = [event_class[payload["type"]].model_validate(payload) for payload in payloads]  # every field the SDK requires
    assert [text.split("\n", 1)[0] for text in sse] == [f"event: {event.type}" for event in events]
    assert [event.type for event in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",  # the text ends where the call begins
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    message, call = final.output
    assert message.content[0].text == "Let me look." and (call.call_id, call.arguments) == ("call_1", '{"city": "Paris"}')
    assert [event.output_index for event in events if event.type == "response.output_item.done"] == [0, 1]
    assert final.usage.input_tokens == 12 and final.usage.output_tokens == 9 and final.usage.total_tokens == 21


# A message's text, then a call, token by token, as a Hermes model writes them (the last token stops it).
CALL_TOKENS = [
    "Let", " me", " look", ".", "\n", "<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>", "<|im_end|>",
]


def calls_format(tokens: list[str]) -> ResponsesFormat:
    """The format of a request for the output text's logprobs, offering WEATHER to a Hermes model
    whose token ids are indices into `tokens`."""
    request = parse_responses_request(json.dumps({
        "input": "Weather in Paris?", "tools": [WEATHER], "include": ["message.output_text.logprobs"],
    }).encode())
    reader = HermesReader(["get_weather"])
    return ResponsesFormat(MODEL, request, ChatFormat(MODEL, 0, tokens.__getitem__, ToolCalling(reader, None, named=False)))


def test_a_message_before_a_call_carries_its_own_tokens_logprobs_and_the_call_none():
    choice = ChoiceState(text="".join(CALL_TOKENS[:-1]), num_tokens=len(CALL_TOKENS), finish_reason="stop")
    choice.scored = [(token_id, TokenLogprob(token_id, -0.5 - token_id, ())) for token_id in range(len(CALL_TOKENS))]
    message, call = calls_format(CALL_TOKENS).response(12, [choice])["output"]
    [part] = message["content"]
    assert part["text"] == "Let me look." and call["type"] == "function_call" and "logprobs" not in call
    assert [(token["token"], token["logprob"]) for token in part["logprobs"]] == [("Let", -0.5), (" me", -1.5), (" look", -2.5), (".", -3.5)]


def test_a_streamed_message_before_a_call_sends_its_tokens_logprobs_with_its_text():
    def scored(*tokens: str) -> list[dict]:
        return [{"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []} for token in tokens]

    stream = ResponsesEvents(calls_format(CALL_TOKENS))
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    chunks = [
        ({"content": "Let"}, scored("Let", " me")),  # " me" is not final text yet
        ({"content": " me look."}, scored(" look", ".", "\n", "<tool_call>")),  # the text stops before the call
        ({"tool_calls": [call]}, scored(CALL_TOKENS[6])),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}, scored("</tool_call>")),
    ]
    sse = stream.opening() + [event for delta, logprobs in chunks for event in stream.delta(delta, logprobs)]
    sse += stream.closing(12, ChoiceState(num_tokens=8, finish_reason="stop"))
    events = [json.loads(text.split("data: ", 1)[1]) for text in sse]
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert [[token["token"] for token in delta["logprobs"]] for delta in deltas] == [["Let"], [" me", " look", "."]]
    [done] = [event for event in events if event["type"] == "response.output_text.done"]
    message, call_item = events[-1]["response"]["output"]
    assert done["logprobs"] == message["content"][0]["logprobs"] == scored("Let", " me", " look", ".")
    assert call_item["arguments"] == '{"city": "Paris"}' and "logprobs" not in call_item


def chat_answer(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


@slow
def test_text_input_is_answered_as_the_chat_route_answers_one_user_message(client, tokenizer):
    question = "What is the capital of France?"
    raw = client.responses.with_raw_response.create(model=MODEL, input=question, max_output_tokens=16, temperature=0)
    openai.types.responses.Response.model_validate(raw.http_response.json())  # every field the SDK requires
    response = raw.parse()
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    chat = chat_answer(client, [{"role": "user", "content": question}], 16)
    assert response.output_text == chat.choices[0].message.content != ""
    assert response.usage.input_tokens == len(tokenizer.encode_chat([{"role": "user", "content": question}])) == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # what the request left out, the response reports as its default
    assert response.temperature == 0 and response.top_p == 1.0 and response.text.format.type == "text"
    assert response.previous_response_id is None and response.error is None and response.tools == []


@slow
def test_max_output_tokens_leaves_the_response_incomplete(client):
    response = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=4, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 4 and response.max_output_tokens == 4
    assert response.output_text


@slow
def test_instructions_are_a_system_message_ahead_of_the_input(client):
    instructions, question = "You are a pirate. Answer in one sentence.", "Where is the treasure?"
    response = client.responses.create(model=MODEL, instructions=instructions, input=question, max_output_tokens=16, temperature=0)
    chat = chat_answer(client, [{"role": "system", "content": instructions}, {"role": "user", "content": question}], 16)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == instructions


@slow
def test_function_call_items_are_the_chat_routes_tool_calls_and_results(client):
    items = [
        {"role": "developer", "content": "You are a helpful assistant. Answer in one sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Rain all day, 14 C."},
        {"role": "user", "content": "Should I take an umbrella?"},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=16, temperature=0)
    chat = chat_answer(client, [
        {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "content": "Rain all day, 14 C.", "tool_call_id": "call_1"},
        {"role": "user", "content": "Should I take an umbrella?"},
    ], 16)
    assert response.output_text == chat.choices[0].message.content != ""
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    # an earlier response's output goes back as input as it came (ids, status, annotations)
    follow_up = [*items, *response.output, {"role": "user", "content": "Thanks!"}]
    assert client.responses.create(model=MODEL, input=follow_up, max_output_tokens=4, temperature=0).usage.input_tokens > response.usage.input_tokens


@slow
def test_tool_choice_required_makes_a_function_call_whose_output_goes_back_as_input(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice="required", max_output_tokens=32, temperature=0)
    [call] = response.output  # no message: the model only called
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.status == "completed" and response.output_text == ""
    assert response.tool_choice == "required" and [tool.name for tool in response.tools] == ["get_weather"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Rain all day, 14 C."}
    answer = client.responses.create(model=MODEL, input=[*question, *response.output, result], tools=[WEATHER], max_output_tokens=16, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens > response.usage.input_tokens


@slow
def test_a_streamed_call_of_a_named_tool_sends_its_arguments_in_fragments(client):
    choice = {"type": "function", "name": "get_weather"}
    events = list(client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice, max_output_tokens=32, temperature=0, stream=True,
    ))
    types = [event.type for event in events]
    num_deltas = types.count("response.function_call_arguments.delta")
    assert num_deltas > 1
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    added, done, final = events[2].item, events[-2].item, events[-1].response
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert added.type == "function_call" and added.name == "get_weather" and added.arguments == ""
    assert done.arguments == events[-3].arguments == arguments and done.call_id == added.call_id
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    assert [item.model_dump() for item in final.output] == [done.model_dump()]
    assert final.tool_choice.name == "get_weather"


@slow
def test_json_schema_format_holds_the_output_to_the_schema(client):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    response = client.responses.create(
        model=MODEL, instructions="Answer in JSON.", input="Describe a person.", max_output_tokens=48, temperature=0, text=text,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"


@slow
def test_a_stream_sends_openais_events_in_order_and_ends_with_the_whole_response(client):
    question = "Say hello."
    events = list(client.responses.create(model=MODEL, input=question, max_output_tokens=8, temperature=0, stream=True))
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas > 1
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert final.status == "incomplete" and final.output_text == text == events[-4].text
    assert final.usage.output_tokens == 8
    item_id = events[2].item.id
    assert all(getattr(event, "item_id", item_id) == item_id for event in events[2:-1]) and final.output[0].id == item_id
    # the same request, not streamed, says the same
    assert client.responses.create(model=MODEL, input=question, max_output_tokens=8, temperature=0).output_text == text


@slow
def test_the_sdks_stream_helper_reads_a_completed_stream(client):
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=64, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) != ""


LOGPROBS = dict(include=["message.output_text.logprobs"], top_logprobs=2)


def warm(client, question: str) -> None:
    """Put the question's prompt in the prefix cache. Requests that find it there compute the rest in
    the same shapes: bit for bit the same logprobs. One that computes the whole prompt differs from
    them by float32 rounding (up to ~4e-5 here), matmuls of other shapes summing in another order."""
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=1)


def numbers(tokens: list) -> list[tuple]:
    """Each token's text and logprob, and its alternatives', as the SDK parsed them."""
    return [(token.token, token.logprob, [(top.token, top.logprob) for top in token.top_logprobs]) for token in tokens]


@slow
@pytest.mark.parametrize(("max_tokens", "status"), [(8, "incomplete"), (64, "completed")])
def test_output_text_logprobs_are_the_chat_routes_token_by_token(client, max_tokens, status):
    question = "Say hello."
    warm(client, question)
    response = client.responses.create(model=MODEL, input=question, max_output_tokens=max_tokens, temperature=0, **LOGPROBS)
    [part] = response.output[0].content
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=2,
    ).choices[0]
    expected = chat.logprobs.content
    assert response.status == status and response.top_logprobs == 2
    if status == "completed":  # the model ended it with a stop token, which chat lists and which spells no text
        assert expected[-1].token == "<|im_end|>"
        expected = expected[:-1]
    assert len(part.logprobs) == len(expected) == response.usage.output_tokens - (status == "completed")
    assert "".join(token.token for token in part.logprobs) == part.text == chat.message.content != ""
    assert numbers(part.logprobs) == numbers(expected)
    for token in part.logprobs:
        assert token.bytes == list(token.token.encode("utf-8"))
        first, second = token.top_logprobs
        assert first.logprob >= second.logprob and first.bytes == list(first.token.encode("utf-8"))
        assert (first.token, first.logprob) == (token.token, token.logprob)  # greedy: the chosen token is the most likely


@slow
def test_streamed_output_text_logprobs_come_with_the_text_they_spell(client):
    question = "Say hello."
    warm(client, question)
    kwargs = dict(model=MODEL, input=question, max_output_tokens=64, temperature=0, **LOGPROBS)
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    [done] = [event for event in events if event.type == "response.output_text.done"]
    final = events[-1].response
    assert all("".join(token.token for token in delta.logprobs) == delta.delta for delta in deltas)
    streamed = [token for delta in deltas for token in delta.logprobs]
    assert final.status == "completed" and len(streamed) == final.usage.output_tokens - 1  # all but the stop token
    assert numbers(done.logprobs) == numbers(final.output[0].content[0].logprobs) == numbers(streamed)
    whole = client.responses.create(**kwargs).output[0].content[0]
    assert whole.text == done.text and numbers(whole.logprobs) == numbers(streamed)


@slow
@pytest.mark.parametrize(
    "asked",
    [
        {},
        {"top_logprobs": 2},  # as vLLM: alternatives come only with the include that asks for logprobs
        {"include": ["reasoning.encrypted_content"]},  # the Codex CLI's; graphrt's output has no reasoning items
    ],
)
def test_without_the_include_the_output_text_has_no_logprobs(client, asked):
    kwargs = dict(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0, **asked)
    [part] = client.responses.create(**kwargs).output[0].content
    assert part.text and part.logprobs == []  # as OpenAI sends it: an empty list, not null
    events = list(client.responses.create(stream=True, **kwargs))
    text_events = [event for event in events if event.type in ("response.output_text.delta", "response.output_text.done")]
    assert len(text_events) > 2 and all(event.logprobs == [] for event in text_events)
    assert events[-1].response.output[0].content[0].logprobs == []


@slow
@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "graphrt stores no responses"),
        ({"input": "hi", "background": True}, "background", "background is not supported"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]", "an input item is a message"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content[0].type", "input_text"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "'user', 'system', 'developer' or 'assistant'"),
        ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input[0].call_id", "no function_call item"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments", "is required"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty", "unrecognized request argument"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format.schema", "cannot be used"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format.name", "required"),
        ({"input": "hi", "tools": [{"type": "function", "name": "g"}], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "not in tools"),
        ({"input": "hi", "tools": [{"type": "function", "name": "g", "parameters": {"type": "array"}}]}, "tools[0].parameters", "schema of an object"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include", "'file_search_call.results' is not supported"),
        ({"input": "hi", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs", "less than or equal to 20"),
        ({"input": "hi", "max_output_tokens": 9000}, None, "plus max_output_tokens (9000) exceeds it; lower max_output_tokens"),
        ({"input": "hi", "model": "gpt-4o"}, "model", "does not exist"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation", "graphrt stores no conversations"),
        # Chat's shapes, OpenAI's built-in tools and images: said as such, not as a missing name or a wrong type.
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice", "names the function at the top"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
         "tool_choice", "type 'allowed_tools' is not served"),
        ({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]", "takes a function tool flat"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "graphrt runs none of OpenAI's built-in tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "x"}]}]},
         "input[0].content", "input_image parts are not served: graphrt serves text-only models"),
    ],
)
def test_bad_requests_are_refused_naming_the_parameter(server, body, param, message):
    answer = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == (404 if param == "model" else 400), error
    assert error["param"] == param and message in error["message"]


@slow
def test_no_response_is_stored_to_retrieve(client):
    with pytest.raises(openai.NotFoundError, match="graphrt stores no responses"):
        client.responses.retrieve("resp_123")
    with pytest.raises(openai.NotFoundError, match="graphrt stores no responses"):
        client.responses.delete("resp_123")

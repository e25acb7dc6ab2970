"""Structured outputs and tool calls through `graphrt serve` (its engine in a process of its own),
with the openai client, LangChain, instructor, a pydantic-ai agent and LiteLLM: every constrained
output validates against what it was held to, streamed or not; tool_choice "required" and a named
tool give tool_calls whose arguments validate against the tool's schema; "auto" answers in either
form. One server of the default model for the module, and a tiny one whose tokenizer has a tool-call
marker as a special token.

Refused requests (each naming its field) are in test_server_bad_requests.py and
test_server_protocol.py; the parsers on fixed texts in test_tool_parsers.py.
"""

from __future__ import annotations

import json
import re
from typing import Annotated

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx", "jsonschema", "langchain_openai", "xgrammar"):  # not on every GPU image
    pytest.importorskip(package)

import jsonschema  # noqa: E402
import openai  # noqa: E402
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from helpers import RequestLog, running_server  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "test-key-structured"
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone", "parameters": TIME_PARAMETERS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "temperature": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["city", "temperature"],
}


class City(BaseModel):
    name: str = Field(max_length=16)
    population_millions: int = Field(ge=0, le=40)


@pytest.fixture(scope="module")
def server(default_model):
    with running_server("process", dict(api_key=API_KEY), model=default_model, dtype="float32", max_num_seqs=16) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def chat(client, stream: bool = False, **fields):
    fields = {"messages": ASK, "max_tokens": 32, "temperature": 0, **fields}
    return client.chat.completions.create(model=MODEL, stream=stream, **fields)


def assembled(chunks) -> dict:
    """A streamed chat completion put together as a client does: content, calls by index, finish reason."""
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        [choice] = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index not in calls and piece.type == "function" and piece.function.arguments == ""
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return {"content": content, "calls": [(call["name"], call["arguments"]) for call in calls.values()], "finish_reason": finish_reason}


# --- response_format and structured_outputs ----------------------------------------------------

def test_parse_gives_the_pydantic_object(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Name a big city and its population."}], response_format=City,
        max_tokens=32, temperature=0,
    )
    message = out.choices[0].message
    assert isinstance(message.parsed, City) and message.parsed == City.model_validate_json(message.content)
    assert out.choices[0].finish_reason == "stop"


FORMATS = [
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY_SCHEMA, "strict": True}}},
     lambda text: jsonschema.validate(json.loads(text), CITY_SCHEMA)),
    ("json_object", {"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
    ("regex", {"extra_body": {"structured_outputs": {"regex": r"(Sunny|Rainy), [0-9]{1,2} C"}}},
     lambda text: re.fullmatch(r"(Sunny|Rainy), [0-9]{1,2} C", text) or pytest.fail(text)),
    ("choice", {"extra_body": {"structured_outputs": {"choice": ["sunny", "rainy", "cloudy"]}}},
     lambda text: text in ("sunny", "rainy", "cloudy") or pytest.fail(text)),
    ("grammar", {"extra_body": {"structured_outputs": {"grammar": 'root ::= ("hot" | "cold") " and " ("dry" | "wet")'}}},
     lambda text: re.fullmatch("(hot|cold) and (dry|wet)", text) or pytest.fail(text)),
]


@pytest.mark.parametrize(("fields", "valid"), [case[1:] for case in FORMATS], ids=[case[0] for case in FORMATS])
def test_constrained_chat_outputs_validate_streamed_or_not(client, fields, valid):
    out = chat(client, **fields)
    text = out.choices[0].message.content
    valid(text)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
    streamed = assembled(chat(client, stream=True, **fields))
    assert streamed == {"content": text, "calls": [], "finish_reason": "stop"}  # greedy: the same text


def test_completions_take_response_format_and_structured_outputs(client):
    schema_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY_SCHEMA}}
    out = client.completions.create(model=MODEL, prompt="The weather in Paris as JSON:", max_tokens=32, temperature=0,
                                    extra_body={"response_format": schema_format})
    jsonschema.validate(json.loads(out.choices[0].text), CITY_SCHEMA)
    out = client.completions.create(model=MODEL, prompt="Is it raining?", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")


# --- tools --------------------------------------------------------------------------------------

def validate_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_tool_choice_required_calls_tools_with_valid_arguments(client):
    out = chat(client, tools=TOOLS, tool_choice="required", max_tokens=64)
    message, finish_reason = out.choices[0].message, out.choices[0].finish_reason
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls]
    validate_calls(calls)
    assert message.content is None and finish_reason == "tool_calls"
    assert all(re.fullmatch("call_[0-9a-f]{24}", call.id) and call.type == "function" for call in message.tool_calls)
    streamed = assembled(chat(client, stream=True, tools=TOOLS, tool_choice="required", max_tokens=64))
    assert streamed == {"content": "", "calls": calls, "finish_reason": "tool_calls"}


@pytest.mark.parametrize("max_tokens", [2, 5, 9])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"])
def test_calls_cut_short_by_max_tokens_are_calls_as_far_as_they_got_never_content(client, tool_choice, max_tokens):
    """The grammar's own format is no answer to show: a whole response says what its stream said."""
    out = chat(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens)
    message, finish_reason = out.choices[0].message, out.choices[0].finish_reason
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or []]
    assert finish_reason == "length" and message.content in ("", None)
    if tool_choice != "required":  # a named call begins with the output
        assert calls and calls[0][0] == "get_weather" and message.content is None
    streamed = assembled(chat(client, stream=True, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens))
    assert streamed == {"content": "", "calls": calls, "finish_reason": "length"}


def test_without_parallel_tool_calls_required_makes_one_call(client):
    out = chat(client, messages=[{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}], tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False, max_tokens=64, temperature=1.0, seed=7, n=2)
    for choice in out.choices:
        [call] = choice.message.tool_calls
        validate_calls([(call.function.name, call.function.arguments)])


def test_a_named_tool_choice_calls_that_tool(client):
    fields = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    out = chat(client, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], **fields)
    [call] = out.choices[0].message.tool_calls
    validate_calls([(call.function.name, call.function.arguments)])
    assert call.function.name == "get_time" and out.choices[0].message.content is None
    assert out.choices[0].finish_reason == "stop"  # as OpenAI says it for a forced call
    streamed = assembled(chat(client, stream=True, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], **fields))
    assert streamed == {"content": "", "calls": [("get_time", call.function.arguments)], "finish_reason": "stop"}


# SmolLM2's chat template has no place for tools, so the model learns of them from the system prompt.
HERMES_SYSTEM = ("You can call the function get_weather(city, unit). To call it, answer with only "
                 '<tool_call>{"name": "get_weather", "arguments": {"city": "<city>", "unit": "celsius"}}</tool_call>')


def test_auto_answers_with_calls_or_content(client):
    messages = [{"role": "system", "content": HERMES_SYSTEM}, *ASK]
    out = chat(client, messages=messages, tools=TOOLS, max_tokens=24, temperature=0.8, seed=3, n=6)
    num_calls = 0
    for choice in out.choices:
        if choice.message.tool_calls:
            num_calls += 1
            assert choice.finish_reason in ("tool_calls", "length")
            for call in choice.message.tool_calls:
                assert call.function.name in PARAMETERS and isinstance(json.loads(call.function.arguments), dict)
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    print(f"\ntool_choice auto: the default model called a tool in {num_calls} of {len(out.choices)} answers")


def test_auto_reads_the_calls_an_output_makes(client):
    # A regex makes the model write a call in hermes' format (the parser the server chose for a
    # template that shows none), after a sentence: the server reads the call out of it.
    hermes_call = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}</tool_call>'
    fields = dict(tools=TOOLS, extra_body={"structured_outputs": {"regex": hermes_call}}, max_tokens=64)
    out = chat(client, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], **fields)
    message = out.choices[0].message
    [call] = message.tool_calls
    validate_calls([(call.function.name, call.function.arguments)])
    assert message.content == "Sure." and out.choices[0].finish_reason == "tool_calls"
    streamed = assembled(chat(client, stream=True, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], **fields))
    assert streamed == {"content": "Sure.", "calls": [("get_time", call.function.arguments)], "finish_reason": "tool_calls"}


# --- LangChain ------------------------------------------------------------------------------------

def langchain_chat(server, log: RequestLog) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=32, max_retries=0,
                      http_client=log.client())


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    log = RequestLog()
    city = langchain_chat(server, log).with_structured_output(City, method=method).invoke("Name a big city and its population.")
    assert isinstance(city, City)
    [body] = log.bodies
    if method == "json_schema":
        assert body["response_format"]["type"] == "json_schema"
    else:
        assert body["tool_choice"]["function"]["name"] == "City"  # a named tool_choice


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "Rain all day, 14 C."


def test_langchain_tool_loop_feeds_the_result_back(server):
    log = RequestLog()
    llm = langchain_chat(server, log)
    messages = [HumanMessage("What is the weather in Paris?")]
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)  # the first turn must call
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather" and isinstance(tool_call["args"]["city"], str)
    messages += [call, ToolMessage(get_weather.invoke(tool_call["args"]), tool_call_id=tool_call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert answer.content or answer.tool_calls
    sent = log.bodies[1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == tool_call["id"] and sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent[2] == {"role": "tool", "content": "Rain all day, 14 C.", "tool_call_id": tool_call["id"]}


# --- agent frameworks: instructor, pydantic-ai, LiteLLM ---------------------------------------------
# Each skips where its package is not installed (the dev extras have pydantic-ai-slim and LiteLLM; the
# Makefile adds instructor).


# instructor's JSON mode (response_format json_object, the schema in a system message) is left out:
# held to any JSON object, the default model writes one that is not a City.
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_returns_the_validated_model(server, mode):
    instructor = pytest.importorskip("instructor")  # the Makefile installs it without its pins (jiter below openai 3.x's)
    log = RequestLog()
    openai_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, http_client=log.client())
    client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
    city = client.chat.completions.create(
        model=MODEL, response_model=City, messages=[{"role": "user", "content": "Name a big city and its population."}],
        max_tokens=48, temperature=0, max_retries=0,
    )
    assert isinstance(city, City)  # instructor validated it (into a subclass of City of its own)
    City.model_validate(city.model_dump())  # and it holds to City's constraints
    [body] = log.bodies  # one request: no retry was needed
    if mode == "JSON_SCHEMA":
        assert body["response_format"]["json_schema"]["schema"] == City.model_json_schema()
    else:
        assert body["tool_choice"] == {"type": "function", "function": {"name": "City"}}  # a named tool: a grammar


def test_pydantic_ai_agent_calls_its_tool_then_answers_with_the_model(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    def settings(ctx):
        # Step 1 must call the tool, step 2 must answer through pydantic-ai's output tool: each a
        # named tool_choice. Left to choose ("required" over both), the default model answers at once.
        tool = "get_population" if ctx.run_step == 1 else "final_result"
        return {"max_tokens": 48, "temperature": 0, "tool_choice": [tool]}

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key=API_KEY))
    agent = Agent(model, output_type=City, model_settings=settings)
    looked_up = []

    @agent.tool_plain
    def get_population(city: Annotated[str, Field(max_length=16)]) -> int:
        """The population of a city, in millions."""
        looked_up.append(city)
        return 2

    result = agent.run_sync("How many people live in Paris? Look it up.", usage_limits=UsageLimits(request_limit=2))
    assert isinstance(result.output, City)
    parts = [part for message in result.all_messages() for part in message.parts]
    calls = [part for part in parts if isinstance(part, ToolCallPart)]
    assert [call.tool_name for call in calls] == ["get_population", "final_result"]
    assert looked_up == [calls[0].args_as_dict()["city"]] and len(looked_up[0]) <= 16  # called with arguments its schema allows
    [returned] = [part for part in parts if isinstance(part, ToolReturnPart) and part.tool_name == "get_population"]
    assert returned.content == 2 and returned.tool_call_id == calls[0].tool_call_id  # the result went back with the call's id
    assert City.model_validate(calls[1].args_as_dict()) == result.output


@pytest.fixture(scope="module")
def litellm():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else its import fetches a price list from the network
        yield pytest.importorskip("litellm")


def litellm_completion(litellm, server, **fields):
    return litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key=API_KEY, temperature=0, **fields)


def test_litellm_response_format_gives_json_of_the_model(server, litellm):
    out = litellm_completion(litellm, server, messages=[{"role": "user", "content": "Name a big city and its population."}],
                             response_format=City, max_tokens=32)
    City.model_validate_json(out.choices[0].message.content)
    assert out.choices[0].finish_reason == "stop"


def test_litellm_required_tool_choice_gives_a_valid_call(server, litellm):
    out = litellm_completion(litellm, server, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    [call] = out.choices[0].message.tool_calls
    validate_calls([(call.function.name, call.function.arguments)])
    assert out.choices[0].finish_reason == "tool_calls" and re.fullmatch("call_[0-9a-f]{24}", call.id)


# --- a parser's marker that is a special token ----------------------------------------------------

@pytest.fixture(scope="module")
def marked_server(default_model, tmp_path_factory):
    """A tiny random model (a thread of this process, up in a second) whose tokenizer is SmolLM2's
    with Mistral's [TOOL_CALLS] a special token, served with the mistral parser; and that token's id."""
    from transformers import AutoTokenizer

    from graphrt.tools.synthetic import make_tiny_model

    path = tmp_path_factory.mktemp("marked") / "tiny-marked"
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    tokenizer.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    make_tiny_model(path, "llama-gqa-tied", overrides={"vocab_size": len(tokenizer)})
    tokenizer.save_pretrained(path)
    with running_server("thread", dict(tool_call_parser="mistral"), model=path, dtype="float32", max_num_seqs=4) as running:
        yield running, tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")


def test_auto_keeps_the_parsers_marker_that_decoding_would_drop(marked_server):
    running, marker_id = marked_server
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
    # Only the marker may be written: the text shows whether decoding kept it.
    fields = dict(model="tiny-marked", messages=ASK, max_tokens=2, temperature=0, extra_body={"allowed_token_ids": [marker_id]})
    auto = client.chat.completions.create(tools=TOOLS, **fields).choices[0].message
    assert auto.content == "[TOOL_CALLS][TOOL_CALLS]" and auto.tool_calls is None  # kept for the parser; no call follows
    assert not client.chat.completions.create(**fields).choices[0].message.content  # without tools, dropped as usual


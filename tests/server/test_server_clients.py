"""`graphrt serve` through LangChain's OpenAI classes, which send what the openai client alone
does not: batched prompts (`OpenAI.batch`), a tool-using conversation (assistant tool calls with
null content, tool results), and tools with tool_choice "none". One server for the module.
(Tools the model calls, and structured output through LangChain: test_server_structured_outputs.py.)"""

from __future__ import annotations

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx", "langchain_openai"):  # not on every GPU image
    pytest.importorskip(package)

import openai  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI, OpenAI  # noqa: E402

from graphrt.frontend.tokenizer import Tokenizer  # noqa: E402
from helpers import SERVER_MODES, RequestLog, running_server  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "test-key-456"
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
HISTORY = [
    SystemMessage("You are a helpful assistant. Answer in one sentence."),
    HumanMessage("What is the weather in Paris?"),
    AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}]),
    ToolMessage(content="Rain all day, 14 C.", tool_call_id="call_1"),
    HumanMessage("Should I take an umbrella?"),
]
# HISTORY as the openai client takes it, which is what LangChain sends
HISTORY_DICTS = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]},
    {"role": "tool", "content": "Rain all day, 14 C.", "tool_call_id": "call_1"},
    {"role": "user", "content": "Should I take an umbrella?"},
]


@pytest.fixture(scope="module", params=SERVER_MODES)
def server(default_model, request):
    with running_server(request.param, dict(api_key=API_KEY), model=default_model, dtype="float32", max_num_seqs=16) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_dir(default_model)  # the test's own copy: the server's belongs to its engine thread


def test_langchain_batch_is_one_request_with_each_prompts_own_answer(server, client):
    log = RequestLog()
    llm = OpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=24, max_retries=0, http_client=log.client())
    texts = llm.batch(PROMPTS)
    [body] = log.bodies  # one request carrying the three prompts...
    assert body["prompt"] == PROMPTS
    alone = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text for prompt in PROMPTS]
    assert texts == alone  # ...each answered as it is alone, in order
    assert len(set(alone)) == len(PROMPTS) and all(alone)


def test_langchain_chat_with_tool_history(server, client, tokenizer):
    log = RequestLog()
    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=32, max_retries=0, http_client=log.client())
    answer = llm.invoke(HISTORY)
    [body] = log.bodies
    assert body["messages"] == HISTORY_DICTS  # the assistant's content is null: only its tool call
    assert isinstance(answer.content, str) and answer.content.strip()
    # the openai client with the same history gets the same greedy answer, from a prompt that
    # holds the tool's result
    out = client.chat.completions.create(model=MODEL, messages=HISTORY_DICTS, max_tokens=32, temperature=0)
    assert out.choices[0].message.content == answer.content
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    rendered = [*HISTORY_DICTS[:2], {"role": "assistant", "content": "", "tool_calls": [call]}, *HISTORY_DICTS[3:]]
    assert out.usage.prompt_tokens == len(tokenizer.encode_chat(rendered))
    assert "Rain all day, 14 C." in tokenizer.apply_chat_template(rendered)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "Rain all day, 14 C."


def test_langchain_tools_with_tool_choice_none_are_ignored(server):
    log = RequestLog()
    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=16, max_retries=0, http_client=log.client())
    question = [HumanMessage("What is the capital of France?")]
    with_tools = llm.bind_tools([get_weather], tool_choice="none").invoke(question)
    without = llm.invoke(question)
    assert log.bodies[0]["tools"][0]["function"]["name"] == "get_weather" and log.bodies[0]["tool_choice"] == "none"
    assert with_tools.content == without.content != ""  # the model never saw them
    assert with_tools.tool_calls == []

"""Parsing request bodies, without a server: what `parse_request` accepts, what it refuses (with
the parameter named), and the `SamplingParams` and chat-template messages a request turns into."""

from __future__ import annotations

import json

import pytest

for package in ("fastapi", "uvicorn"):  # graphrt.server imports the server stack: not on every GPU image
    pytest.importorskip(package)

from graphrt.engine.grammar import GrammarChecks  # noqa: E402
from graphrt.errors import RequestError  # noqa: E402
from graphrt.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput  # noqa: E402
from graphrt.server.chat_protocol import ChatCompletionRequest  # noqa: E402
from graphrt.server.errors import APIError  # noqa: E402
from graphrt.server.protocol import MAX_CHOICES, CompletionRequest, parse_request  # noqa: E402
from graphrt.server.structured_outputs import check_grammar  # noqa: E402

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# a tool-using conversation as LangChain's ChatOpenAI sends it: the assistant's content is null
TOOL_HISTORY = [
    {"role": "system", "content": "Be brief."},
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_1"},
    {"role": "user", "content": "Should I take an umbrella?"},
]


def completion(**fields) -> CompletionRequest:
    return parse_request(json.dumps({"prompt": "Hello", **fields}).encode(), CompletionRequest)


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(json.dumps({"messages": USER, **fields}).encode(), ChatCompletionRequest)


def refused(parse, **fields) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(**fields)
    assert caught.value.status == 400
    return caught.value


# --- logprobs ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "logprobs", "prompt_logprobs"), [
    ({}, None, None),
    ({"logprobs": None, "echo": None}, None, None),  # SDKs send null for "unset"
    ({"logprobs": 0}, 0, None),  # the chosen token's own log-probability, no alternatives
    ({"logprobs": 5}, 5, None),
    ({"logprobs": MAX_LOGPROBS}, MAX_LOGPROBS, None),
    ({"logprobs": 3, "echo": True}, 3, 3),  # echo with logprobs scores the prompt too
    ({"echo": True}, None, None),  # echo alone prints the prompt, scores nothing
])
def test_completion_logprobs_reach_the_sampling_params(fields, logprobs, prompt_logprobs):
    request = completion(n=2, **fields)
    assert (request.num_logprobs, request.num_prompt_logprobs) == (logprobs, prompt_logprobs)
    assert request.echo is bool(fields.get("echo"))
    assert [(p.logprobs, p.prompt_logprobs) for p in request.sampling_params()] == [(logprobs, prompt_logprobs)] * 2


@pytest.mark.parametrize("fields", [{"logprobs": MAX_LOGPROBS + 1}, {"logprobs": -1}, {"logprobs": True}, {"logprobs": "5"}, {"echo": 1}])
def test_completion_logprobs_out_of_range_are_refused(fields):
    error = refused(completion, **fields)
    assert error.param == next(iter(fields))


@pytest.mark.parametrize(("fields", "logprobs"), [
    ({}, None),
    ({"logprobs": None}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": None}, 0),
    ({"logprobs": True, "top_logprobs": 0}, 0),
    ({"logprobs": True, "top_logprobs": 7}, 7),
    ({"logprobs": True, "top_logprobs": MAX_LOGPROBS}, MAX_LOGPROBS),
])
def test_chat_logprobs_reach_the_sampling_params(fields, logprobs):
    request = chat(**fields)
    assert request.num_logprobs == logprobs and request.num_prompt_logprobs is None
    assert [(p.logprobs, p.prompt_logprobs) for p in request.sampling_params()] == [(logprobs, None)]


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_logprobs": 3}, "top_logprobs"),  # as OpenAI: top_logprobs needs logprobs: true
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ({"logprobs": 5}, "logprobs"),  # chat's logprobs is a bool; the count is top_logprobs
    ({"echo": True}, "echo"),  # completions only
])
def test_chat_logprobs_near_misses_are_refused(fields, param):
    error = refused(chat, **fields)
    assert error.param == param and param in error.message


def test_top_logprobs_is_a_chat_parameter():
    assert refused(completion, top_logprobs=2).param == "top_logprobs"


# --- batched prompts --------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "prompts"), [
    ("Hello", ["Hello"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["Hello"], ["Hello"]),  # a batch of one is that prompt
    ([[1, 2, 3]], [[1, 2, 3]]),
    (["Hello", "Bonjour", "Hallo"], ["Hello", "Bonjour", "Hallo"]),
    ([[1, 2], [3], [4, 5, 6]], [[1, 2], [3], [4, 5, 6]]),
    (["Hello", ""], ["Hello", ""]),  # text that tokenizes to nothing is refused later, as a single "" is
])
def test_prompt_forms(prompt, prompts):
    request = completion(prompt=prompt)
    assert request.prompts() == prompts
    if len(prompts) == 1:
        assert request.prompt == prompts[0]  # one prompt stays one prompt, whatever its wrapping


@pytest.mark.parametrize(("prompt", "says"), [
    ([], "must not be empty"),
    ([[1, 2], []], "element 1"),  # no prompt is an empty list of token ids
    ([[]], "element 0"),
    ([[1, "a"]], "element 0"),
    ([[1, True]], "element 0"),  # a bool is not a token id
    ([[1.0]], "element 0"),
    (["a", [1]], "not a mix"),
    ([1, "a"], "not a mix"),
    ([["a"]], "element 0"),
    ([1.5], "must be"),
    (5, "must be"),
    (None, "is required"),  # a null is the field left out
    ({"text": "a"}, "must be"),
])
def test_malformed_prompts_are_refused(prompt, says):
    error = refused(completion, prompt=prompt)
    assert error.param == "prompt" and says in error.message


def test_prompts_times_choices_is_bounded():
    assert len(completion(prompt=["a"] * MAX_CHOICES).prompts()) == MAX_CHOICES
    assert completion(prompt=["a", "b", "c"], n=MAX_CHOICES // 3).n == MAX_CHOICES // 3  # 126 sequences
    for fields in ({"prompt": ["a"] * (MAX_CHOICES + 1)}, {"prompt": ["a", "b", "c"], "n": MAX_CHOICES // 3 + 1}, {"prompt": [[1], [2]], "n": MAX_CHOICES}):
        error = refused(completion, **fields)
        assert error.param == "prompt"
        assert f"more than the {MAX_CHOICES}" in error.message and "lower n" in error.message


def test_every_prompt_of_a_batch_samples_as_it_would_alone():
    batch = completion(prompt=["a", "b"], n=3, seed=10, temperature=0.7)
    alone = completion(prompt="a", n=3, seed=10, temperature=0.7)
    assert batch.sampling_params() == alone.sampling_params()
    assert [p.seed for p in batch.sampling_params()] == [10, 11, 12]


# --- fields SDKs send, accepted and ignored ---------------------------------------------------

IGNORED_CHAT_FIELDS = [
    {"metadata": {"user_tier": "free", "session": "42"}},
    {"metadata": None},
    {"store": True},
    {"store": False},
    {"service_tier": "auto"},
    {"reasoning_effort": "low"},
    {"verbosity": "low"},  # the OpenAI Agents SDK's and LangChain's settings pass these through
    {"safety_identifier": "user-1"},
    {"prompt_cache_key": "session-7", "prompt_cache_retention": "24h"},
    {"parallel_tool_calls": True},
    {"parallel_tool_calls": False},
    {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    {"tools": [], "tool_choice": "none"},
    {"tool_choice": "none"},
    {"user": "someone"},
]


@pytest.mark.parametrize("fields", IGNORED_CHAT_FIELDS, ids=lambda fields: "+".join(fields))
def test_ignored_fields_change_nothing(fields):
    baseline = chat(temperature=0.5, seed=3, stream=fields.get("stream", False))
    request = chat(temperature=0.5, seed=3, **fields)
    assert request.sampling_params() == baseline.sampling_params()
    assert [m.template_dict() for m in request.messages] == [m.template_dict() for m in baseline.messages]


def test_include_obfuscation_is_accepted_on_completions_too():
    assert completion(stream=True, stream_options={"include_obfuscation": True}).include_usage is False


@pytest.mark.parametrize(("fields", "param"), [
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"metadata": ["k"]}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"service_tier": 1}, "service_tier"),
    ({"reasoning_effort": 2}, "reasoning_effort"),
    ({"parallel_tool_calls": "true"}, "parallel_tool_calls"),
    ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),  # no SDK sends it unasked
    ({"frobnicate": 1}, "frobnicate"),
])
def test_ignored_fields_near_misses_are_refused(fields, param):
    error = refused(chat, **fields)
    assert error.param == param and param.split(".")[0] in error.message


@pytest.mark.parametrize("name", ["metadata", "store", "service_tier", "reasoning_effort", "parallel_tool_calls"])
def test_chat_only_fields_are_unknown_to_completions(name):
    error = refused(completion, **{name: None})
    assert error.param == name and error.message == f"unrecognized request argument: {name}"


# --- tools (graphrt.server.tool_choice) ---------------------------------------------------------

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: it takes none
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_tools_with_tool_choice_none_are_ignored():
    request = chat(tools=TOOLS, tool_choice="none", parallel_tool_calls=False)
    assert request.tool_use() is None
    assert [m.template_dict() for m in request.messages] == [m.template_dict() for m in chat().messages]
    assert request.sampling_params() == chat().sampling_params()


@pytest.mark.parametrize("fields", [{}, {"tool_choice": "auto"}, {"tool_choice": None}], ids=["default", "auto", "null"])
def test_auto_shows_the_model_the_tools_and_constrains_nothing(fields):
    tool_use = chat(tools=TOOLS, **fields).tool_use()
    assert tool_use.choice == "auto" and tool_use.structured_output() is None and tool_use.grammars() == []
    assert tool_use.template_tools() == [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    assert chat(tools=TOOLS, **fields).sampling_params()[0].structured_output is None


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_holds_the_output_to_an_array_of_calls(parallel):
    request = chat(tools=TOOLS, tool_choice="required", **({} if parallel is None else {"parallel_tool_calls": parallel}))
    [params] = request.sampling_params()
    schema = json.loads(params.structured_output.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema.get("maxItems") == (1 if parallel is False else None)
    assert schema["items"]["anyOf"] == [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER_PARAMETERS},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"], "additionalProperties": False},
    ]
    assert [param for _, param in request.grammars()] == ["tools[0].function.parameters", "tools[1].function.parameters"]


def test_required_moves_each_tools_definitions_to_the_top():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
                                                                             "$defs": {"Point": point}}}} for i in range(2)]
    schema = json.loads(chat(tools=tools, tool_choice="required").sampling_params()[0].structured_output.json)
    assert schema["$defs"] == {"Point": point} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    tools[1]["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    assert refused(chat, tools=tools, tool_choice="required").param == "tools[1].function.parameters"


def test_a_named_tool_choice_holds_the_output_to_that_tools_parameters():
    request = chat(tools=TOOLS, tool_choice=NAMED)
    assert json.loads(request.sampling_params()[0].structured_output.json) == WEATHER_PARAMETERS
    assert request.tool_use().named == "get_weather"
    assert [param for _, param in request.grammars()] == ["tools[0].function.parameters"]
    no_parameters = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(no_parameters.sampling_params()[0].structured_output.json) == {"type": "object", "properties": {}}


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tool_choice": NAMED}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"nme": "get_weather"}}}, "tool_choice.function.name", "required"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "function": {"name": "get_weather"}}}, "tool_choice.type", "'function'"),
    ({"tools": "get_weather", "tool_choice": "none"}, "tools", "list"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "city"}}]}, "tools[0].function.parameters", "dictionary"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters", "object"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools[0]", "chat nests the function"),  # the Responses API's shape
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "send one"),
    ({"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "send one"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_tools_near_misses_are_refused_naming_the_parameter(fields, param, says):
    error = refused(chat, **fields)
    assert error.param == param and param.split("[")[0].split(".")[0] in error.message and says in error.message, error.message


def test_auto_tools_may_come_with_a_response_format():
    request = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert request.tool_use().choice == "auto" and request.sampling_params()[0].structured_output.json_object


# --- response_format and structured_outputs (graphrt.server.structured_outputs) -----------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}


@pytest.mark.parametrize(("fields", "expected", "param"), [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True, "description": "A person"}}},
     StructuredOutput(json=SCHEMA), "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json=SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput(json=SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True), "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "[0-9]{3}", "json_object": False}}, StructuredOutput(regex="[0-9]{3}"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=["yes", "no"]), "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a"+'}}, StructuredOutput(grammar='root ::= "a"+'), "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "x"}, "response_format": {"type": "text"}}, StructuredOutput(regex="x"), "structured_outputs.regex"),
    # SGLang's names, at the top of the request
    ({"regex": "[0-9]{3}"}, StructuredOutput(regex="[0-9]{3}"), "structured_outputs.regex"),
    ({"ebnf": 'root ::= "a"+'}, StructuredOutput(grammar='root ::= "a"+'), "structured_outputs.grammar"),
    ({"json_schema": json.dumps(SCHEMA)}, StructuredOutput(json=SCHEMA), "structured_outputs.json"),
])
@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_what_the_output_must_be_reaches_every_choice(parse, fields, expected, param):
    request = parse(n=2, **fields)
    assert [p.structured_output for p in request.sampling_params()] == [expected] * 2
    assert request.grammars() == ([] if expected is None else [(expected, param)])


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"response_format": "json_object"}, "response_format", "valid dictionary"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}}, "response_format.json_schema.name", "pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}}, "response_format.json_schema.schema", "dictionary"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}}, "response_format.json_schema.extra", "unrecognized"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex, choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": " "}}, "structured_outputs.regex", "non-empty"),
    ({"structured_outputs": {"json_schema": SCHEMA}}, "structured_outputs.json_schema", "unrecognized"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json", "dictionary"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "send one"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "structured_outputs", "got regex, grammar"),
    ({"regex": "a", "structured_outputs": {"choice": ["a"]}}, "structured_outputs", "got regex, choice"),
])
@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_output_format_near_misses_are_refused_naming_the_parameter(parse, fields, param, says):
    error = refused(parse, **fields)
    assert error.param == param and param.split(".")[0] in error.message and says in error.message, error.message


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}},
     "response_format.json_schema.schema", "'not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
     "response_format.json_schema.schema", "cannot be used"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "cannot be used"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar", "cannot be used"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"d": {"type": "string", "format": "phone"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters", "'phone'"),
])
def test_grammars_the_engine_refuses_are_refused_naming_the_parameter(fields, param, says):
    pytest.importorskip("xgrammar")
    with pytest.raises(APIError) as caught:
        for spec, name in chat(**fields).grammars():
            check_grammar(spec, name, GrammarChecks())
    assert caught.value.param == param and caught.value.message.startswith(param) and says in caught.value.message, caught.value.message
    for spec, name in chat(tools=TOOLS, tool_choice="required").grammars():  # these are fine
        check_grammar(spec, name, GrammarChecks())


# --- tool-call history ------------------------------------------------------------------------

def test_tool_history_reaches_the_template_as_transformers_expects():
    request = parse_request(json.dumps({"messages": TOOL_HISTORY}).encode(), ChatCompletionRequest)
    assert [m.template_dict() for m in request.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_1"},
        {"role": "user", "content": "Should I take an umbrella?"},
    ]


@pytest.mark.parametrize(("assistant", "content", "arguments"), [
    ({"content": "Let me look.", "tool_calls": [CALL]}, "Let me look.", {"city": "Paris"}),  # text beside the calls
    ({"content": "", "tool_calls": [CALL]}, "", {"city": "Paris"}),
    ({"tool_calls": [CALL]}, "", {"city": "Paris"}),  # content missing
    ({"content": [{"type": "text", "text": "Let me "}, {"type": "text", "text": "look."}], "tool_calls": [CALL]}, "Let me look.", {"city": "Paris"}),
    # arguments that are not a JSON object stay the text the model wrote
    ({"content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{broken"}}]}, "", "{broken"),
    ({"content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1, 2]"}}]}, "", "[1, 2]"),
])
def test_assistant_tool_call_forms(assistant, content, arguments):
    messages = [*USER, {"role": "assistant", **assistant}, {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "call_1"}]
    request = parse_request(json.dumps({"messages": messages}).encode(), ChatCompletionRequest)
    turn, result = (m.template_dict() for m in request.messages[1:])
    assert turn["content"] == content and turn["tool_calls"][0]["function"]["arguments"] == arguments
    assert result == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_a_tool_may_return_nothing():
    messages = [*TOOL_HISTORY[:3], {"role": "tool", "content": "", "tool_call_id": "call_1"}]
    assert parse_request(json.dumps({"messages": messages}).encode(), ChatCompletionRequest).messages[3].template_dict()["content"] == ""


@pytest.mark.parametrize(("message", "param", "says"), [
    ({"role": "assistant", "content": None}, "messages[1].content", "unless the message has tool_calls"),
    ({"role": "assistant"}, "messages[1].content", "unless the message has tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[1].content", "unless the message has tool_calls"),
    ({"role": "assistant", "content": ""}, "messages[1].content", "non-empty"),
    ({"role": "user", "content": None}, "messages[1].content", "is required"),
    ({"role": "user"}, "messages[1].content", "is required"),
    ({"role": "user", "content": ""}, "messages[1].content", "non-empty"),
    ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "messages[1].tool_calls", "only assistant messages"),
    ({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "messages[1].tool_call_id", "only tool messages"),
    ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id", "is required"),
    ({"role": "tool", "content": None, "tool_call_id": "call_1"}, "messages[1].content", "is required"),
    ({"role": "tool", "content": 24, "tool_call_id": "call_1"}, "messages[1].content", "valid"),
    ({"role": "tool", "content": "sunny", "tool_call_id": 1}, "messages[1].tool_call_id", "valid string"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}, "messages[1].tool_calls[0].type", "function"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f"}}]}, "messages[1].tool_calls[0].function.arguments", "required"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"city": "Paris"}}}]},  # JSON text, not an object
     "messages[1].tool_calls[0].function.arguments", "valid string"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}, "messages[1].tool_calls[0].id", "required"),
    ({"role": "assistant", "tool_calls": CALL}, "messages[1].tool_calls", "valid list"),
    ({"role": "function", "content": "x"}, "messages[1].role", "'tool'"),
])
def test_malformed_tool_messages_are_refused(message, param, says):
    error = refused(chat, messages=[*USER, message])
    assert error.param == param, error.message
    assert error.message.startswith(param) and says in error.message


# --- top_p ------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.7, 2.0])
def test_top_p_zero_is_greedy(temperature):
    for request in (completion(top_p=0, temperature=temperature, n=2, seed=1), chat(top_p=0.0, temperature=temperature)):
        for params in request.sampling_params():
            assert params.greedy and params.temperature == 0 and params.top_p == 1.0


def test_top_p_above_zero_is_kept():
    [params] = completion(top_p=1e-9, temperature=0.7).sampling_params()
    assert not params.greedy and params.top_p == 1e-9 and params.temperature == 0.7


@pytest.mark.parametrize("top_p", [-0.1, 1.5, True])
def test_top_p_out_of_range_is_refused(top_p):
    assert refused(completion, top_p=top_p).param == "top_p"


def test_max_tokens_stays_positive():
    assert refused(completion, max_tokens=0).param == "max_tokens"
    assert refused(chat, max_completion_tokens=0).param == "max_completion_tokens"


# --- penalties, bias, masks (graphrt.sampling_params) --------------------------------------------

# What vLLM's `vllm bench serve --backend openai` sends with every request (vllm/benchmarks/lib/endpoint_request_func.py)
VLLM_BENCH_COMPLETION = {
    "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
}


def test_what_vllm_bench_sends_is_accepted_and_changes_nothing():
    request = parse_request(json.dumps(VLLM_BENCH_COMPLETION).encode(), CompletionRequest)
    [params] = request.sampling_params()
    assert params.repetition_penalty == 1.0 and not params.processes_logits and params.ignore_eos


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_every_parameter_reaches_the_sampling_params(parse):
    request = parse(
        presence_penalty=-1.5, frequency_penalty=2, repetition_penalty=1.15, min_p=0.05, min_tokens=3, max_tokens=20,
        logit_bias={"7": -100, "11": 2.5}, stop_token_ids=[2, 5], bad_words=["foo", "bar baz"], allowed_token_ids=[1, 7, 11], n=2,
    )
    for params in request.sampling_params():
        penalties = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
        assert penalties == (-1.5, 2, 1.15) and (params.min_p, params.min_tokens) == (0.05, 3)
        assert params.logit_bias == {7: -100, 11: 2.5} and params.stop_token_ids == [2, 5]
        assert params.bad_words == ["foo", "bar baz"] and params.bad_words_token_ids is None  # the front tokenizes them
        assert params.allowed_token_ids == [1, 7, 11] and params.processes_logits and params.tracks_history


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_skip_special_tokens_reaches_the_sampling_params(parse):
    """vLLM's extension: false keeps the tokenizer's special tokens in the text. The server keeps
    them whatever the request says where a tool-call parser reads markers that are special tokens."""
    assert [params.skip_special_tokens for params in parse(n=2).sampling_params()] == [True, True]
    assert [params.skip_special_tokens for params in parse(n=2, skip_special_tokens=False).sampling_params()] == [False, False]
    assert parse(skip_special_tokens=True).sampling_params(keep_special_tokens=True)[0].skip_special_tokens is False
    for value in ("false", 0):
        assert refused(parse, skip_special_tokens=value).param == "skip_special_tokens"


def test_nulls_mean_the_defaults():
    nulls = dict.fromkeys(
        ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "stop_token_ids",
         "bad_words", "allowed_token_ids"]
    )
    [params] = completion(**nulls).sampling_params()
    assert params == SamplingParams(max_tokens=16) and not params.processes_logits


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_a_null_is_a_field_left_out_as_openai_takes_it(parse):
    """Fields whose default is not null too (OpenAI's, vLLM's and SGLang's servers take these)."""
    fields = ["temperature", "top_p", "top_k", "n", "stream", "ignore_eos", "skip_special_tokens", "seed", "stop"]
    if parse is chat:
        fields += ["logprobs", "add_generation_prompt", "continue_final_message"]
    nulls, left_out = parse(max_tokens=8, **dict.fromkeys(fields)), parse(max_tokens=8)
    assert nulls.sampling_params() == left_out.sampling_params() and nulls.stream is False
    assert nulls.sampling_params()[0].temperature == 1.0


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"presence_penalty": 2.01}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"presence_penalty": "1"}, "presence_penalty", "number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"repetition_penalty": -1.2}, "repetition_penalty", "greater than 0"),
    ({"min_p": -0.1}, "min_p", "[0, 1]"),
    ({"min_p": 1.01}, "min_p", "[0, 1]"),
    ({"min_tokens": -1}, "min_tokens", "0"),
    ({"min_tokens": 17}, "min_tokens", "max_tokens (16)"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"3": 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": [1, 2]}, "logit_bias", "dictionary"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids", ">= 0"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids[0]", "integer"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least one"),
    ({"bad_words": ["ok", ""]}, "bad_words", "empty"),
    ({"bad_words": "word"}, "bad_words", "list"),
])
def test_out_of_range_values_are_refused_naming_the_parameter_and_its_range(fields, param, says):
    error = refused(completion, **fields)
    assert error.param == param and says in str(error), str(error)


# --- the chat template's side -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(default_model):
    from graphrt.frontend.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model)


def template_messages(messages: list[dict]) -> list[dict]:
    return [m.template_dict() for m in parse_request(json.dumps({"messages": messages}).encode(), ChatCompletionRequest).messages]


@pytest.mark.slow
def test_default_template_renders_tool_history(tokenizer):
    # SmolLM2's template knows no tool calls: the call's turn is empty, its result a "tool" turn
    text = tokenizer.apply_chat_template(template_messages(TOOL_HISTORY))
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nsunny, 24 C<|im_end|>" in text
    assert "None" not in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("bad_index", [0, 1, 3, 4])
def test_template_failure_names_the_message(tokenizer, monkeypatch, bad_index):
    # a template that, like many, refuses roles it does not know
    template = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    monkeypatch.setattr(tokenizer._tok, "chat_template", template)
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(6)]
    assert tokenizer.apply_chat_template(messages).endswith("user: turn 5\nassistant: ")
    messages[bad_index] = {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    messages[-1] = {"role": "tool", "content": "rain", "tool_call_id": "call_2"}  # a later one is not named
    with pytest.raises(RequestError) as caught:
        tokenizer.apply_chat_template(messages)
    assert str(caught.value) == f"messages[{bad_index}]: the model's chat template cannot render this message (unknown role tool)"


@pytest.mark.slow
def test_template_failure_search_renders_prefixes_without_the_generation_prompt(tokenizer, monkeypatch):
    # a template that wants the conversation to end with the user when asked for a reply: a prefix
    # ending on the assistant's turn is no error of that turn
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{% if messages[-1]['role'] != 'user' %}{{ raise_exception('reply to what?') }}{% endif %}"
                "assistant: {% endif %}")
    monkeypatch.setattr(tokenizer._tok, "chat_template", template)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "tool", "content": "d"}]
    with pytest.raises(RequestError, match=r"^messages\[3\]: .* \(no tools\)$"):
        tokenizer.apply_chat_template(messages)
    with pytest.raises(RequestError, match=r"^messages\[1\]: .* \(reply to what\?\)$"):  # the whole conversation fails only for its end
        tokenizer.apply_chat_template(messages[:2])


@pytest.mark.slow
def test_tools_reach_the_chat_template(tokenizer, monkeypatch):
    # a template that lists the tools ahead of the conversation, as Qwen's and Hermes' do
    template = ("{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n{% endif %}"
                "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    monkeypatch.setattr(tokenizer._tok, "chat_template", template)
    request = chat(tools=TOOLS)
    text = tokenizer.apply_chat_template([m.template_dict() for m in request.messages], request.tool_use().template_tools())
    listed, conversation = text.removeprefix("<tools>").split("</tools>\n")
    assert [json.loads(line) for line in listed.splitlines()] == TOOLS
    assert conversation == "user: What is the weather in Paris?\nassistant: "
    assert tokenizer.chat_template == template


@pytest.mark.slow
def test_a_template_that_cannot_render_the_tools_says_so(tokenizer, monkeypatch):
    template = ("{% if tools %}{{ raise_exception('tools are not supported') }}{% endif %}"
                "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    monkeypatch.setattr(tokenizer._tok, "chat_template", template)
    messages = [m.template_dict() for m in chat().messages]
    assert tokenizer.apply_chat_template(messages, []) == "user: What is the weather in Paris?\n"
    with pytest.raises(RequestError, match=r"^tools: the model's chat template cannot render them \(tools are not supported\)$"):
        tokenizer.apply_chat_template(messages, chat(tools=TOOLS).tool_use().template_tools())


# Llama 3.1's chat template, cut to what places the tools and refuses things (its lines kept as they
# are): the tools go into the first user message, which must exist, and an assistant turn may make
# one call only.
LLAMA_31_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if not tools is none %}"
    "{%- if messages | length != 0 %}"
    "{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}"
    "{{- raise_exception(\"Cannot put tools in the first user message when there's no first user message!\") }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>'}}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls|length == 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}"
    "{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' + tool_call.arguments | tojson + '}<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.mark.slow
def test_a_template_that_puts_the_tools_in_the_first_user_message_blames_the_message_that_fails(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer._tok, "chat_template", LLAMA_31_STYLE_TEMPLATE)
    tools = chat(tools=TOOLS).tool_use().template_tools()
    text = tokenizer.apply_chat_template(template_messages(TOOL_HISTORY), tools)  # one call a turn: it renders
    assert text.index('"name": "get_weather"') < text.index("What is the weather in Paris?")  # the tools, in the first user message
    two_calls = [*TOOL_HISTORY[:2], {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
                 {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_1"},
                 {"role": "tool", "content": "sunny, 24 C", "tool_call_id": "call_2"}]
    # The system message alone fails with the tools (no user message to put them in), but that is
    # not what is wrong with this conversation.
    with pytest.raises(RequestError) as caught:
        tokenizer.apply_chat_template(template_messages(two_calls), tools)
    assert str(caught.value) == "messages[2]: the model's chat template cannot render this message (This model only supports single tool-calls at once!)"
    # Where the tools are what fails, they are named.
    with pytest.raises(RequestError, match=r"^tools: the model's chat template cannot render them \(Cannot put tools in the first user message"):
        tokenizer.apply_chat_template(template_messages(TOOL_HISTORY[:1]), tools)


@pytest.mark.parametrize(("request_of", "fields", "names"), [
    (completion, {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    (chat, {"response_format": {"type": "json_object"}}, "response_format"),
    (chat, {"response_format": {"type": "text"}, "structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    (chat, {"tools": TOOLS, "tool_choice": "required"}, 'tool_choice "required"'),
])
def test_min_tokens_with_a_grammar_is_refused_naming_min_tokens_and_the_grammars_field(request_of, fields, names):
    error = refused(request_of, min_tokens=2, **fields)
    assert error.param == "min_tokens" and names in error.message
    # A text format is no grammar: min_tokens goes with it.
    assert chat(min_tokens=2, response_format={"type": "text"}).sampling_params()[0].min_tokens == 2


def test_tool_choice_against_structured_outputs_names_the_field_that_was_sent():
    error = refused(chat, tools=TOOLS, tool_choice="required", response_format={"type": "text"}, structured_outputs={"regex": "a"})
    assert error.param == "structured_outputs"


# --- how the chat template renders the conversation ------------------------------------------------

@pytest.mark.parametrize(("fields", "kwargs"), [
    ({}, {"add_generation_prompt": True, "continue_final_message": False}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False, "add_generation_prompt": True, "continue_final_message": False}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": False}),
    ({"continue_final_message": True}, {"add_generation_prompt": False, "continue_final_message": True}),
    ({"continue_final_message": True, "add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}),
])
def test_chat_template_options_reach_the_template_call(fields, kwargs):
    assert chat(**fields).template_kwargs() == kwargs


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "cannot both be true"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "an argument of the template call"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt", "send the request's own field"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "dictionary"),
])
def test_chat_template_option_near_misses_are_refused_naming_the_parameter(fields, param, says):
    error = refused(chat, **fields)
    assert error.param == param and says in error.message, error.message


def test_chat_template_variables_and_continuation_reach_the_rendered_prompt(tokenizer, monkeypatch):
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}assistant: {% endif %}")
    monkeypatch.setattr(tokenizer._tok, "chat_template", template)
    partial = [*USER, {"role": "assistant", "content": "It is"}]

    def rendered(messages, **fields):
        request = parse_request(json.dumps({"messages": messages, **fields}).encode(), ChatCompletionRequest)
        return tokenizer.apply_chat_template(template_messages(messages), **request.template_kwargs())

    assert rendered(USER) == "user: What is the weather in Paris?\nassistant: "
    assert rendered(USER, chat_template_kwargs={"enable_thinking": True}) == "user: What is the weather in Paris?\n<think>assistant: "
    assert rendered(partial, continue_final_message=True) == "user: What is the weather in Paris?\nassistant: It is"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
def test_media_content_parts_say_the_models_are_text_only(part):
    error = refused(chat, messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
    assert error.param == "messages[0].content"
    assert f"{part['type']} parts are not served: graphrt serves text-only models" in error.message, error.message


def test_logprobs_true_on_completions_says_it_is_a_count_there():
    error = refused(completion, logprobs=True)
    assert error.param == "logprobs" and "an integer in [0, 20]" in error.message and "chat's form" in error.message


def test_a_null_max_tokens_on_completions_is_the_rest_of_the_context_not_16():
    """vLLM's reading, and graphrt's before nulls were read as left out."""
    assert completion(max_tokens=None).sampling_params()[0].max_tokens is None
    assert completion().sampling_params()[0].max_tokens == 16


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_sglangs_structured_fields_sent_as_null_are_not_given(parse):
    """SGLang's client sends them as null when unset."""
    assert parse(regex=None, ebnf=None, json_schema=None).sampling_params()[0].structured_output is None
    assert parse(regex="[0-9]+", ebnf=None).sampling_params()[0].structured_output == StructuredOutput(regex="[0-9]+")
    error = refused(parse, regex="a", structured_outputs={"regex": "b"})
    assert "structured_outputs.regex is given twice" in error.message


def test_a_failure_a_template_variable_causes_is_not_blamed_on_the_tools(tokenizer, monkeypatch):
    template = "{% if bad %}{{ raise_exception('bad asked for') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    monkeypatch.setattr(tokenizer._tok, "chat_template", template)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(RequestError) as caught:
        tokenizer.apply_chat_template(template_messages(USER), tools, bad=True)
    assert "bad asked for" in str(caught.value) and not str(caught.value).startswith("tools:"), caught.value

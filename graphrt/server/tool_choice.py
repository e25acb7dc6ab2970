"""Function tools on a chat request, and what `tool_choice` makes of them, as vLLM serves them.

- "none": the tools are ignored; the model never sees them.
- "auto" (the default with tools): the chat template shows the model the tools, and the server's
  tool-call parser (graphrt.server.tool_parsers) reads the calls it makes out of its output.
- "required": a grammar makes the output a JSON array of one or more calls (just one with
  parallel_tool_calls false), each `{"name": <a tool's name>, "parameters": <arguments its schema
  allows>}`.
- `{"type": "function", "function": {"name": ...}}`: a grammar makes the whole output that tool's
  arguments.

The model sees the tools in each case but "none".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from graphrt.sampling_params import StructuredOutput
from graphrt.server.errors import APIError
from graphrt.server.structured_outputs import structured_output
from graphrt.server.tool_parsers import READERS, NamedReader, RequiredReader, ToolCallReader
from graphrt.server.validation import StrictModel

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes no arguments
_DEFINITIONS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s point to


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # as OpenAI's: letters, digits, _ and -
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no arguments
    strict: bool | None = None  # graphrt holds forced calls to the schema, strict or not

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _chats_shape(cls, tool: Any) -> Any:
        if isinstance(tool, dict) and "name" in tool and "function" not in tool:
            raise ValueError('chat nests the function: {"type": "function", "function": {"name": ..., "parameters": ...}}; '
                             "the flat shape is the Responses API's")
        return tool


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


def _choice_tag(value: Any) -> str:
    return "named-choice" if isinstance(value, (dict, NamedToolChoice)) else "mode-choice"


# Hyphenated tags: validation_error leaves them out of the parameter it names.
ToolChoice = Annotated[
    Union[Annotated[Literal["none", "auto", "required"], Tag("mode-choice")], Annotated[NamedToolChoice, Tag("named-choice")]],
    Discriminator(_choice_tag),
]


@dataclass(frozen=True)
class ToolCalling:
    """How a chat response reads tool calls out of each choice's output."""

    reader: ToolCallReader
    max_calls: int | None  # 1 with parallel_tool_calls false
    named: bool  # a named tool_choice: the finish reason stays "stop", as OpenAI's does
    constrained: bool = False  # "required" or named: a grammar writes the calls, so the output is never content


@dataclass(frozen=True)
class ToolUse:
    """The tools a request lets the model call, and how (tool_choice "auto", "required" or named)."""

    tools: list[Tool]
    choice: str | NamedToolChoice
    parallel: bool

    @staticmethod
    def of(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None, parallel_tool_calls: bool | None) -> ToolUse | None:
        """None where no tool can be called (none given, or tool_choice "none"); raises APIError
        naming what does not fit together."""
        names = [tool.function.name for tool in tools or []]
        repeated = next((name for index, name in enumerate(names) if name in names[:index]), None)
        if repeated is not None:
            raise APIError(400, f"tools: two tools are named {repeated!r}; each name must be unique", param="tools")
        if tool_choice == "none":
            return None
        if not names:
            if tool_choice is None:
                return None
            shown = f'"{tool_choice}"' if isinstance(tool_choice, str) else "naming a function"
            raise APIError(400, f"tool_choice {shown} needs tools: send the functions the model may call in tools", param="tool_choice")
        if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
            raise APIError(
                400, f"tool_choice names the function {tool_choice.function.name!r}, which is not in tools "
                f"({', '.join(map(repr, names))})", param="tool_choice",
            )
        for index, tool in enumerate(tools):
            schema_type = tool.function.parameters_schema.get("type", "object")
            if schema_type != "object":
                param = f"tools[{index}].function.parameters"
                raise APIError(400, f"{param}: must be the schema of an object (type: object), got type {schema_type!r}", param=param)
        return ToolUse(list(tools), tool_choice or "auto", parallel_tool_calls is not False)

    @property
    def named(self) -> str | None:
        return self.choice.function.name if isinstance(self.choice, NamedToolChoice) else None

    @property
    def constrains_output(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict]:
        """As transformers' chat templates take them (`apply_chat_template(tools=...)`)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def structured_output(self) -> StructuredOutput | None:
        """The grammar tool_choice "required" or a named tool puts on the output; None for "auto"."""
        if self.named is not None:
            index = self._index(self.named)
            return structured_output(self._param(index), json=self.tools[index].function.parameters_schema)
        if self.choice == "required":
            return structured_output("tools", json=required_schema(self.tools, self.parallel))
        return None

    def grammars(self) -> list[tuple[StructuredOutput, str]]:
        """Each schema the output is held to, with the parameter that gave it, to check one by one."""
        if self.named is not None:
            indices = [self._index(self.named)]
        elif self.choice == "required":
            indices = list(range(len(self.tools)))
        else:
            indices = []
        return [(structured_output(self._param(i), json=self.tools[i].function.parameters_schema), self._param(i)) for i in indices]

    def calling(self, parser: str) -> ToolCalling:
        """How to read the output: `parser` (a name in tool_parsers.READERS) for "auto"."""
        names = [tool.function.name for tool in self.tools]
        max_calls = None if self.parallel else 1
        if self.named is not None:
            return ToolCalling(NamedReader(self.named), 1, named=True, constrained=True)
        if self.choice == "required":
            return ToolCalling(RequiredReader(names), max_calls, named=False, constrained=True)
        return ToolCalling(READERS[parser](names), max_calls, named=False)

    def _index(self, name: str) -> int:
        return next(index for index, tool in enumerate(self.tools) if tool.function.name == name)

    @staticmethod
    def _param(index: int) -> str:
        return f"tools[{index}].function.parameters"


def required_schema(tools: list[Tool], parallel: bool) -> dict:
    """A JSON array of calls, each `{"name": <tool>, "parameters": <its arguments>}` (anyOf the
    tools), at least one, at most one without parallel calls. Each tool's `$defs` move to the top,
    where its `$ref`s ("#/$defs/...") point from there."""
    definitions: dict[str, dict] = {}
    calls = []
    for index, tool in enumerate(tools):
        parameters = dict(tool.function.parameters_schema)
        for keyword in _DEFINITIONS:
            for name, schema in (parameters.pop(keyword, None) or {}).items():
                if definitions.setdefault(keyword, {}).setdefault(name, schema) != schema:
                    raise APIError(
                        400, f"tools[{index}].function.parameters: {keyword}.{name} differs from another tool's; with "
                        'tool_choice "required" the tools share their definitions, so rename one', param=f"tools[{index}].function.parameters",
                    )
        calls.append({
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return {**schema, **definitions}

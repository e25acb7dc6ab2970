"""What a request says its output must be, as the engine's `StructuredOutput`: OpenAI's
`response_format` and vLLM's `structured_outputs`, on completions and chat completions alike.

Each becomes a grammar the engine compiles (graphrt.engine.grammar). Errors name the request's own
field (`response_format.json_schema.schema`, not the engine's `structured_output.json`): the
engine's checks run here first, on a worker thread (`check_grammar`; importing xgrammar takes
seconds the event loop must not wait).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from graphrt.engine.grammar import GrammarChecks
from graphrt.errors import RequestError
from graphrt.sampling_params import StructuredOutput
from graphrt.server.errors import APIError
from graphrt.server.validation import StrictModel

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class JSONSchemaFormat(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # as OpenAI's: letters, digits, _ and -
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # graphrt holds every output to its schema, strict or not


class ResponseFormatParam(StrictModel):
    """OpenAI's `response_format`: plain text (the default), any JSON object, or JSON a schema describes."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def check(self) -> None:
        if self.type != "json_schema" and self.json_schema is not None:
            raise APIError(400, f"response_format.json_schema belongs to type json_schema, not {self.type}", param="response_format.json_schema")
        if self.type == "json_schema" and self.json_schema is None:
            raise APIError(400, "response_format.json_schema is required with type json_schema", param="response_format.json_schema")
        if self.type == "json_schema" and self.json_schema.schema_ is None:
            raise APIError(
                400, "response_format.json_schema.schema is required: graphrt builds the grammar from it "
                '(for any JSON object, send {"type": "json_object"})', param="response_format.json_schema.schema",
            )

    @property
    def param(self) -> str:
        return "response_format.json_schema.schema" if self.type == "json_schema" else "response_format"

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            return structured_output(self.param, json=self.json_schema.schema_)
        return None


class StructuredOutputsParam(StrictModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, any JSON object, a regular
    expression, a choice of strings, or an EBNF grammar (xgrammar's dialect)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a schema, or its JSON text
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def check(self) -> None:
        given = [kind for kind in KINDS if getattr(self, "json_" if kind == "json" else kind) not in (None, False)]
        if len(given) != 1:
            got = f"got {', '.join(given)}" if given else "got none"
            raise APIError(400, f"structured_outputs takes exactly one of {', '.join(KINDS)}; {got}", param="structured_outputs")
        self.structured_output()  # empty strings and choices are refused here

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, "json_" if kind == "json" else kind) not in (None, False))

    @property
    def param(self) -> str:
        return f"structured_outputs.{self.kind}"

    def structured_output(self) -> StructuredOutput:
        kind = self.kind
        value = True if kind == "json_object" else getattr(self, "json_" if kind == "json" else kind)
        return structured_output(self.param, **{kind: value})


def structured_output(param: str, **fields) -> StructuredOutput:
    """StructuredOutput(**fields), its ValueError a 400 naming `param`."""
    try:
        return StructuredOutput(**fields)
    except ValueError as exc:
        raise APIError(400, _renamed(str(exc), param), param=param) from None


def check_grammar(spec: StructuredOutput, param: str, checks: GrammarChecks) -> None:
    """The engine's check of a grammar (graphrt.engine.grammar; the first imports xgrammar, which
    takes seconds), its error a 400 naming `param`."""
    try:
        checks.check(spec)
    except RequestError as exc:
        raise APIError(400, _renamed(str(exc), param), param=param) from None


def _renamed(message: str, param: str) -> str:
    """The engine names a grammar `structured_output.<kind>`; the request named it `param`."""
    for kind in sorted(KINDS, key=len, reverse=True):  # json_object before json
        prefix = f"structured_output.{kind}"
        if message.startswith(prefix):
            return param + message[len(prefix):]
    return f"{param}: {message}"

"""The FastAPI app: OpenAI-compatible routes over one `AsyncEngine`, vLLM's and SGLang's extra routes
(/tokenize, /reset_prefix_cache, SGLang's /generate and its kin: graphrt.server.native), /health and /metrics."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from graphrt.engine.grammar import GrammarChecks
from graphrt.frontend.async_engine import AsyncEngine, GenerationJob
from graphrt.sampling_params import SamplingParams
from graphrt.server import native, tokenize
from graphrt.server.body import decode_body
from graphrt.server.chat_protocol import ChatCompletionRequest
from graphrt.server.errors import APIError
from graphrt.server.generation import Generation, GenerationStream
from graphrt.server.metrics import ServerMetrics
from graphrt.server.protocol import CompletionRequest, SamplingFields, parse_request
from graphrt.server.responses import ChatFormat, CompletionFormat, ResponseFormat, TokenNames
from graphrt.server.responses_api import parse_responses_request
from graphrt.server.responses_output import ResponsesFormat, ResponsesGeneration
from graphrt.server.structured_outputs import check_grammar
from graphrt.server.tool_parsers import TOOL_CALL_PARSERS, detect_tool_call_parser, markers_are_special_tokens

if TYPE_CHECKING:
    from graphrt.frontend.engine_client import EngineClient

logger = logging.getLogger("graphrt.server")
MAX_DRAIN_BYTES = 64 << 20  # past this, an oversized body is not read to its end before the 413
# The model SGLang's examples and scripts request (SGLang ignores the field); a request naming it gets
# the served model, as one naming no model does.
SGLANG_ANY_MODEL = "default"
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's /health_generate: how long its one-token generation may take
MAX_LOGGED_CHARS = 300  # of a refused request's error message, in its log line


@dataclass
class ServerSettings:
    model_id: str  # the name clients pass as `model`, and responses carry
    other_model_ids: tuple[str, ...] = ()  # more names clients may pass (--served-model-name given several times)
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 1 << 20
    tool_call_parser: str | None = None  # how tool calls are read from outputs (tool_parsers); None: as the chat template says
    sampling_defaults: dict = field(default_factory=dict)  # the model's, for what a request leaves out (frontend.generation_config)
    log_refused: bool = True  # a line on stderr for each refused request (vLLM's --disable-log-requests turns it off)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty; leave it unset to serve without one")

    @property
    def model_ids(self) -> tuple[str, ...]:
        return (self.model_id, *self.other_model_ids)


def build_app(async_engine: AsyncEngine | EngineClient, settings: ServerSettings) -> FastAPI:
    """An app serving an engine on a thread of this process (AsyncEngine) or in a process of its
    own (EngineClient); its lifespan starts and stops it."""
    metrics = ServerMetrics(lambda: async_engine.snapshot, settings.model_id)
    probe_metrics = ServerMetrics(lambda: async_engine.snapshot, settings.model_id)  # /health_generate's, shown nowhere
    created = int(time.time())
    names = TokenNames(async_engine.tokenizer)  # the event loop's: logprobs responses spell tokens with it
    template = async_engine.tokenizer.chat_template if async_engine.tokenizer is not None else None
    tool_call_parser = settings.tool_call_parser or detect_tool_call_parser(template)
    # Mistral's [TOOL_CALLS], Llama 3's <|python_tag|>: decoding must keep them for "auto" to read calls.
    keep_markers = markers_are_special_tokens(tool_call_parser, async_engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        yield
        async_engine.stop()
        await asyncio.to_thread(async_engine.join, 30)

    app = FastAPI(title="graphrt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.count("rejected" if exc.status < 500 else "error")
        if exc.status < 500 and settings.log_refused:  # a 5xx is logged, with its traceback, where it happened
            # A wrong API key goes to INFO: anyone who can reach the port can send those.
            log_refused(request, exc, logging.INFO if exc.status == 401 else logging.WARNING)
        return exc.response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # It closed the connection while sending its body (or sent too slowly: --timeout-body), which
        # uvicorn logged as a 70-line traceback. Not a request the engine ran: no outcome is counted.
        logger.info("%s %s: the client went away while sending its request body", request.method, printable(request.url.path))
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # unknown routes and methods: the same error body as everything else
        served = f"; this server answers {served_routes(app)}" if exc.status_code == 404 else ""
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}{served}")
        if settings.log_refused:
            log_refused(request, error, logging.INFO)  # a route nobody serves: scanners probe hundreds
        return error.response()

    def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # The scheme is case-insensitive (RFC 9110 section 11.1); the key is compared in constant time.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_model(model: str | None, any_model_ok: bool = True) -> None:
        """A 404 unless `model` is served; a request naming none, or SGLang's "default", gets the served one."""
        if model is not None and model not in settings.model_ids and not (any_model_ok and model == SGLANG_ANY_MODEL):
            served = ", ".join(map(repr, settings.model_ids))
            raise APIError(404, f"model {model!r} does not exist; this server serves {served}", param="model", code="model_not_found")

    async def read_request(request: Request, model_cls: type[SamplingFields]) -> SamplingFields:
        check_api_key(request)
        body = await read_body(request, settings.max_body_bytes)
        parsed = parse_request(body, model_cls)
        check_model(parsed.model)
        await check_grammars(parsed)
        return parsed

    grammar_checks = GrammarChecks()

    async def check_grammars(parsed: SamplingFields) -> None:
        grammars = parsed.grammars()
        if grammars:  # on a worker thread: the first one imports xgrammar, which takes seconds
            await asyncio.to_thread(lambda: [check_grammar(spec, param, grammar_checks) for spec, param in grammars])

    async def generate(
        request: Request, job: GenerationJob, parsed: SamplingFields, fmt: ResponseFormat, kind: type[Generation] = Generation
    ) -> Response:
        generation = kind(async_engine, metrics, job, fmt, parsed.include_usage, parsed.continuous_usage)
        try:
            if not await generation.admit(request):
                return Response(status_code=499)  # the client is gone; nobody reads this
            if parsed.stream:
                generation.stop_watching()
                return GenerationStream(generation)
            body = await generation.collect()
            return JSONResponse(body) if body is not None else Response(status_code=499)
        except BaseException:
            generation.close()  # cancelled or failed before the response took over: free the engine's blocks
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await read_request(request, CompletionRequest)
        prompts = parsed.prompts()
        # n choices per prompt, prompt by prompt; a seed gives choice j of every prompt seed + j
        job = GenerationJob(params=sampling_params(parsed, defaults=settings.sampling_defaults) * len(prompts), prompts=prompts)
        fmt = CompletionFormat(
            settings.model_id, parsed.num_logprobs, names, parsed.echo, bool(parsed.return_token_ids), parsed.prompt_logprobs,
        )
        return await generate(request, job, parsed, fmt)

    def chat_job(parsed: ChatCompletionRequest) -> tuple[GenerationJob, ChatFormat]:
        tool_use = parsed.tool_use()  # None: no tool may be called
        messages = [m.template_dict() for m in parsed.messages]
        reads_markers = keep_markers and tool_use is not None and not tool_use.constrains_output  # "auto"
        params = sampling_params(parsed, keep_special_tokens=reads_markers, defaults=settings.sampling_defaults)
        job = GenerationJob(params=params, messages=messages, tools=tool_use and tool_use.template_tools(), template_kwargs=parsed.template_kwargs())
        calling = tool_use and tool_use.calling(tool_call_parser)
        return job, ChatFormat(settings.model_id, parsed.num_logprobs, names, calling, bool(parsed.return_token_ids), parsed.prompt_logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = await read_request(request, ChatCompletionRequest)
        job, fmt = chat_job(parsed)
        return await generate(request, job, parsed, fmt)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        check_api_key(request)
        parsed = parse_responses_request(await read_body(request, settings.max_body_bytes))
        check_model(parsed.model)
        with parsed.in_own_terms():  # served as the chat request it means; errors name what this request sent
            chat = parsed.chat_request()
            await check_grammars(chat)
            job, chat_format = chat_job(chat)
            return await generate(request, job, chat, ResponsesFormat(settings.model_id, parsed, chat_format), ResponsesGeneration)

    @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str) -> Response:
        check_api_key(request)
        raise APIError(404, f"response {response_id!r} was not stored: graphrt stores no responses; send the whole conversation in input")

    def model_card(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "graphrt", "max_model_len": async_engine.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        check_api_key(request)
        return {"object": "list", "data": [model_card(model_id) for model_id in settings.model_ids]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> dict:
        check_api_key(request)
        check_model(model_id, any_model_ok=False)  # "default" names no card
        return model_card(model_id)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        check_api_key(request)
        parsed = tokenize.parse(decode_body(await read_body(request, settings.max_body_bytes)), tokenize.TokenizeRequest)
        check_model(parsed.model)
        return await tokenize.tokenize(async_engine.tokenizer, parsed, async_engine.max_model_len, settings.model_id)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        check_api_key(request)
        parsed = tokenize.parse(decode_body(await read_body(request, settings.max_body_bytes)), tokenize.DetokenizeRequest)
        check_model(parsed.model)
        return await tokenize.detokenize(async_engine.tokenizer, parsed, settings.model_id)

    # SGLang's native API (graphrt.server.native)
    @app.post("/generate")
    async def generate_native(request: Request) -> Response:
        check_api_key(request)
        raw = decode_body(await read_body(request, settings.max_body_bytes))
        requests, options = native.completion_requests(raw)  # one for every prompt, or one per prompt
        prompts, params = [], []
        for parsed, where in requests:
            with native.in_native_terms(options.prompt_field, where):
                await check_grammars(parsed)
                params += sampling_params(parsed, defaults=settings.sampling_defaults) * len(parsed.prompts())
            prompts += parsed.prompts()
        first = requests[0][0]  # stream, logprobs and n are the same in every one
        with native.in_native_terms(options.prompt_field):
            job = GenerationJob(params=params, prompts=prompts)
            return await generate(request, job, first, native.NativeFormat(first, options, names))

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """Healthy when a one-token generation comes back within HEALTH_GENERATE_TIMEOUT_S."""
        if not async_engine.healthy:
            return APIError(503, "the server is shutting down or its engine thread has stopped").response()
        job = GenerationJob(params=[SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)], prompts=[[0]])
        generation = Generation(async_engine, probe_metrics, job, native.NativeFormat(CompletionRequest(prompt=[0]), native.NativeOptions("input_ids"), names))

        async def one_token() -> None:
            if await generation.admit(request):
                await generation.collect()

        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return APIError(503, f"a one-token generation took longer than {HEALTH_GENERATE_TIMEOUT_S:g} s").response()
        finally:
            generation.close()
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict:
        check_api_key(request)
        return native.model_info(async_engine.model_dir, async_engine.max_model_len)

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict:
        check_api_key(request)
        return {**native.model_info(async_engine.model_dir, async_engine.max_model_len), "served_model_name": settings.model_id,
                "version": importlib.metadata.version("graphrt")}

    @app.post("/reset_prefix_cache")  # vLLM's name
    @app.post("/flush_cache")  # SGLang's
    async def reset_prefix_cache(request: Request) -> Response:
        check_api_key(request)
        if not await async_engine.reset_prefix_cache():
            raise APIError(400, "requests are running or waiting: the prefix cache is flushed only while the engine is idle; retry once they are done")
        return JSONResponse({"status": "flushed"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": importlib.metadata.version("graphrt")}

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.healthy:
            return APIError(503, "the server is shutting down or its engine thread has stopped").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def served_routes(app: FastAPI) -> str:
    """Every route by method, for a 404's message: `GET /health, /metrics, ...; POST /generate, ...`."""
    paths: dict[str, list[str]] = {}
    for route in app.routes:
        if isinstance(route, APIRoute):
            for method in sorted(route.methods - {"HEAD"}):
                paths.setdefault(method, []).append(route.path)
    return "; ".join(f"{method} {', '.join(paths[method])}" for method in sorted(paths))


def log_refused(request: Request, error: APIError, level: int) -> None:
    """One line for a refused request, so the server's operator sees what a client (or the agent
    framework wrapping it, which may retry or reword the error) keeps sending. The path and the
    message can hold what the client sent: control characters are escaped, so none reaches a
    terminal or splits the line."""
    message = error.message[:MAX_LOGGED_CHARS]
    logger.log(level, "refused %s %s (%d): %s", request.method, printable(request.url.path), error.status, printable(message))


def printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def sampling_params(parsed: SamplingFields, keep_special_tokens: bool = False, defaults: dict | None = None) -> list:
    try:
        return parsed.sampling_params(keep_special_tokens, defaults)
    except ValueError as exc:  # SamplingParams' own checks
        raise APIError(400, str(exc)) from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes `limit` bytes (the rest is read and dropped, so the
    client, still sending, sees the 413 rather than a reset connection)."""
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        too_large = too_large or size > limit
        if size > MAX_DRAIN_BYTES:
            break
        if not too_large:
            chunks.append(chunk)
    if too_large:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    return b"".join(chunks)

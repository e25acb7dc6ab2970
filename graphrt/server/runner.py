"""Running a server: bind, load and warm up the engine, serve until a stop signal, exit cleanly.

`serve` is what `graphrt serve` runs in the main thread; `ServerThread` runs the same server on a
background thread of the calling process (tests, benchmarks). What a single connection may do is
bounded in `connections.py`.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import uvicorn

from graphrt.engine.startup import load_and_warm_up
from graphrt.errors import GraphrtError
from graphrt.frontend import generation_config
from graphrt.frontend.async_engine import AsyncEngine
from graphrt.frontend.engine_client import EngineClient
from graphrt.frontend.tokenizer import TokenizerLoading
from graphrt.kernels.cpu.placement import CPU_PLACEMENTS, CpuPlacement, plan_cpu_placement, usable_cores
from graphrt.model.default_model import model_dir_for
from graphrt.server.app import ServerSettings, build_app
from graphrt.server.connections import BoundedH11Protocol, ConnectionLimits, RequestFraming
from graphrt.signals import STOP_SIGNALS, StartUpStopped, stop_start_up_on_signals

GRACEFUL_SHUTDOWN_S = 5  # after cancelling in-flight requests, how long connections get to close
ENGINE_STOP_S = 60  # how long the engine thread gets to finish its step and stop


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the banner says which)
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 1 << 20
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    llm_kwargs: dict = field(default_factory=dict)  # graphrt.engine.startup.build_engine's: model, cache, pp, depth, max_num_seqs, ...
    engine_process: bool = True  # the engine in a process of its own (graphrt.engine.process)
    cpu_placement: str = "auto"  # auto, pin or float: where the front and the engine run (graphrt.kernels.cpu.placement)
    tool_call_parser: str | None = None  # hermes, llama3_json or mistral (graphrt.server.tool_parsers); None: from the chat template
    served_model_names: tuple[str, ...] = ()  # what clients may pass as `model`, the first in responses; (): the folder's name
    generation_config: str = "auto"  # auto: the model's sampling defaults; vllm: the API's; or a folder (frontend.generation_config)
    chat_template: str | None = None  # a Jinja file, or the template itself, for the model's own (vLLM's --chat-template)
    log_refused: bool = True  # a line on stderr per refused request (off: vLLM's --disable-log-requests)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key_value(self.api_key, "the API key")
        generation_config.check_choice(self.generation_config)
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        for name in self.served_model_names:
            if not name or name != name.strip():
                raise ValueError(f"--served-model-name {name!r} is empty or starts or ends with whitespace; give the name clients send as model")
        if self.cpu_placement not in CPU_PLACEMENTS:
            raise ValueError(f"cpu_placement {self.cpu_placement!r} is not one of {', '.join(CPU_PLACEMENTS)}")


def read_chat_template(given: str) -> str:
    """--chat-template: a file's text, or, where no file has that name, the template itself, as
    vLLM reads it; either must look like Jinja."""
    path = Path(given)
    try:
        template = path.read_text() if path.is_file() else given
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {given}: cannot read it ({exc}); give a readable Jinja file or the template itself") from None
    if "{{" not in template and "{%" not in template:
        raise ValueError(f"--chat-template {given!r} is neither a file nor a Jinja template (no {{{{ or {{%); give one of those")
    return template


def check_api_key_value(key: str, source: str) -> None:
    # An empty key must not mean "no authentication": that is what leaving it unset says.
    if not key:
        raise ValueError(f"{source} is empty; give a non-empty key, or none at all to serve without authentication")
    if key != key.strip():
        raise ValueError(f"{source} starts or ends with whitespace, which an HTTP header cannot carry; remove it")


def api_key_from(flag: str | None, key_file: Path | None, env: str | None) -> str | None:
    """The key `graphrt serve` requires: --api-key, else --api-key-file, else GRAPHRT_API_KEY, else None."""
    if flag is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if flag is not None:
        check_api_key_value(flag, "--api-key")
        return flag
    if key_file is not None:
        try:
            key = key_file.read_text().rstrip("\r\n")  # the newline an editor or `echo` leaves
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the API key file {key_file} ({getattr(exc, 'strerror', None) or exc}); pass a readable file") from None
        check_api_key_value(key, f"the API key file {key_file}")
        return key
    if env is not None:  # set but empty counts: GRAPHRT_API_KEY= must not turn authentication off
        check_api_key_value(env, "GRAPHRT_API_KEY")
        return env
    return None


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server is reachable beyond this machine and anyone may use it."""
    if api_key is not None:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"[graphrt] warning: listening on {host} without an API key: anyone who can reach this port can use "
            "the model; pass --api-key-file PATH (or set GRAPHRT_API_KEY)")


class GracefulServer(uvicorn.Server):
    """uvicorn, except that stopping first cancels the requests in flight (each ends with a 503,
    so no connection holds the shutdown up), and a stop asked for by a signal exits with code 0."""

    def __init__(
        self, config: uvicorn.Config, async_engine: AsyncEngine | EngineClient, on_started: Callable[[], None] = lambda: None,
    ):
        super().__init__(config)
        self.async_engine = async_engine
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()

    async def on_tick(self, counter: int) -> bool:
        # A dead stage process (--procs) or engine process ends the server (what was in flight has
        # been failed already).
        if self.async_engine.failure is not None:
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.async_engine.stop()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own version re-raises the signal after the graceful stop, which ends the
        # process by that signal; here a stop signal (STOP_SIGNALS) is the normal way to stop, so it exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the model loads so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise GraphrtError(f"cannot listen on {host}:{port} ({exc.strerror}); pass another --port or --host") from None
    sock.listen(2048)  # clients that connect during start-up wait in the backlog
    return sock


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def in_thread(engine) -> AsyncEngine:
    """The handle on an LLM's engine stepped on a thread of this process, text through its tokenizer."""
    from graphrt.llm import LLM

    return AsyncEngine(engine.engine, engine.tokenizer) if isinstance(engine, LLM) else AsyncEngine(engine, None)


def make_server(
    async_engine: AsyncEngine | EngineClient, settings: ServerSettings, limits: ConnectionLimits,
    on_started: Callable[[], None] = lambda: None,
) -> GracefulServer:
    app = build_app(async_engine, settings)
    config = uvicorn.Config(
        RequestFraming(app, settings.max_body_bytes, app.state.metrics),
        http=functools.partial(BoundedH11Protocol, limits=limits),
        timeout_keep_alive=limits.keep_alive_s,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return GracefulServer(config, app.state.async_engine, on_started)


def stop_engine(server: GracefulServer) -> None:
    """Stop and join the engine thread, then the stage threads, before the interpreter exits: a
    daemon thread still inside a torch op at exit is killed mid-op, and that aborts the whole
    process (SIGABRT, "terminate called without an active exception"), which a stop by signal
    with micro-batches in flight otherwise did every time. (uvicorn's lifespan joins the engine
    thread too, but skips that on a second Ctrl+C, and nothing else closed the stages.) An engine
    process is told to stop, waited for, and its sockets closed."""
    server.async_engine.stop()
    server.async_engine.join(ENGINE_STOP_S)
    server.async_engine.close()


def curl_example(url: str, model_id: str, with_key: bool, has_tokenizer: bool = True) -> str:
    """A first request to paste: a chat question, or for a model without a tokenizer (no chat
    template, no text) a completion of token ids."""
    auth = ' -H "Authorization: Bearer $GRAPHRT_API_KEY"' if with_key else ""
    if has_tokenizer:
        route, ask = "chat/completions", '"messages": [{"role": "user", "content": "What is the capital of France?"}]'
    else:
        route, ask = "completions", '"prompt": [1, 2, 3, 4]'
    body = f'{{"model": "{model_id}", {ask}, "max_tokens": 32, "temperature": 0}}'
    return f"curl {url}/v1/{route} -H 'Content-Type: application/json'{auth} -d '{body}'"


def start_engine(
    options: ServeOptions, placement: CpuPlacement, echo: Callable[[str], None],
) -> AsyncEngine | EngineClient | None:
    """Load and warm up the engine, printing each phase; None if a stop signal came first."""
    # Until uvicorn takes the signals over, SIGINT and SIGTERM stop the start-up (graphrt.signals).
    try:
        with stop_start_up_on_signals():
            if options.engine_process:
                return EngineClient(options.llm_kwargs, echo, placement)
            model = options.llm_kwargs.get("model")
            model_dir = model_dir_for(model)
            tokenizer = TokenizerLoading(model_dir)
            engine = load_and_warm_up({**options.llm_kwargs, "model": model_dir}, echo, eos_token_id=tokenizer.eos_token_id)
            return AsyncEngine(engine, tokenizer.result())
    except (StartUpStopped, KeyboardInterrupt):
        echo("[graphrt] stopped during start-up")
        return None


def serve(options: ServeOptions, echo: Callable[[str], None] = print) -> None:
    """Serve until a stop signal (STOP_SIGNALS); then stop admitting, cancel what is in flight and return."""
    placement = plan_cpu_placement(options.cpu_placement, usable_cores(), options.engine_process)
    sock = bind_socket(options.host, options.port)
    warning = exposure_warning(options.host, options.api_key)  # once the address is known to be one
    if warning is not None:
        echo(warning)
    try:
        async_engine = start_engine(options, placement, echo)
        if async_engine is None:
            return
        echo(f"[graphrt] {placement.describe()}")
        if options.chat_template is not None and async_engine.tokenizer is None:
            echo("[graphrt] --chat-template is not used: the model has no tokenizer, so chat is refused and prompts are token ids")
        elif options.chat_template is not None:
            async_engine.tokenizer.use_chat_template(options.chat_template)
            echo("[graphrt] chat template: the one --chat-template gave, not the model's")
        model_dir = async_engine.model_dir if options.engine_process else async_engine.engine.model_dir
        model_id, *other_model_ids = options.served_model_names or (model_dir.name,)
        defaults = generation_config.resolve(options.generation_config, model_dir)
        if defaults:
            echo(f"[graphrt] {generation_config.describe(defaults, options.generation_config)}")
        settings = ServerSettings(
            model_id=model_id, other_model_ids=tuple(other_model_ids), api_key=options.api_key,
            max_body_bytes=options.max_body_bytes, tool_call_parser=options.tool_call_parser, sampling_defaults=defaults,
            log_refused=options.log_refused,
        )
        url = address_of(sock)

        def banner() -> None:
            if settings.other_model_ids:
                echo(f"[graphrt] model names: {', '.join(settings.model_ids)} (responses carry {settings.model_id})")
            echo(f"[graphrt] serving {settings.model_id} on {url} (OpenAI API under /v1; /health, /metrics); Ctrl+C stops")
            echo("try: " + curl_example(url, settings.model_id, options.api_key is not None, async_engine.tokenizer is not None))

        server = make_server(async_engine, settings, options.limits, banner)
        try:
            server.run(sockets=[sock])
        finally:
            stop_engine(server)
        if async_engine.failure is not None:
            raise async_engine.failure  # the CLI prints it and exits 1
        echo("[graphrt] stopped")
    finally:
        sock.close()


class ServerThread:
    """The same server on a background thread of this process; `stop` shuts it down cleanly.
    `engine`: an LLM (or a bare Engine, which takes token ids only), stepped on a thread here, or
    an EngineClient, whose engine process `stop` ends too."""

    def __init__(
        self, engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 0, limits: ConnectionLimits | None = None
    ):
        self.sock = bind_socket(host, port)
        self.url = address_of(self.sock)
        self.async_engine = engine if isinstance(engine, EngineClient) else in_thread(engine)
        self.server = make_server(self.async_engine, settings, limits or ConnectionLimits())
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="graphrt-server", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
        if isinstance(self.async_engine, EngineClient):
            stop_engine(self.server)
        if self._thread.is_alive():
            raise RuntimeError(f"the server at {self.url} did not stop within {timeout} s")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

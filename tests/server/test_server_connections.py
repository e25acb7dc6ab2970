"""What a client can do to the server's connections, and what it gets: slow or silent clients are
dropped after the header or body timeout, a declared oversized body is refused at once, ambiguous
framing is refused and the connection closed, connections past the limit get a 503, responses on
a kept-alive connection leave at once (TCP_NODELAY), and the API key is checked as RFC 9110 says.
The timeouts are shortened here; every wait has a generous safety timeout and no test times a response."""

from __future__ import annotations

import http.client
import json
import logging
import re
import select
import socket
import time

import pytest

for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from graphrt.cli import main  # noqa: E402
from graphrt.llm import LLM  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402
from graphrt.server.connections import ConnectionLimits  # noqa: E402
from graphrt.server.runner import exposure_warning  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "connections-test-key"
SAFETY_S = 30  # only a failing test waits this long
STRICT = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5)
PATIENT = ConnectionLimits(header_timeout_s=120, body_timeout_s=120, keep_alive_s=120)


def serving(tiny_model_factory, limits: ConnectionLimits, api_key: str | None = None) -> ServerThread:
    llm = LLM(tiny_model_factory(), max_num_seqs=4, max_batch=2)
    return ServerThread(llm, ServerSettings(model_id="tiny", api_key=api_key), limits=limits)


@pytest.fixture(scope="module")
def strict_server(tiny_model_factory):
    with serving(tiny_model_factory, STRICT) as running:
        yield running


@pytest.fixture(scope="module")
def patient_server(tiny_model_factory):
    with serving(tiny_model_factory, PATIENT, api_key=API_KEY) as running:
        yield running


def connect(server: ServerThread) -> socket.socket:
    return socket.create_connection(server.sock.getsockname()[:2], timeout=SAFETY_S)


def request(sock: socket.socket, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> http.client.HTTPResponse:
    """Send one request on `sock` and read its whole response."""
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *(f"{name}: {value}" for name, value in (headers or {}).items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response


def wait_closed(sock: socket.socket) -> None:
    """Return once the server has closed `sock`; fail if it is still open after SAFETY_S."""
    sock.settimeout(SAFETY_S)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {SAFETY_S} s") from None


def server_sockets(server: ServerThread) -> list:
    return [connection.transport.get_extra_info("socket") for connection in server.server.server_state.connections]


# -- timeouts ---------------------------------------------------------------------------------------


def test_silent_connection_is_closed_after_the_header_timeout(strict_server):
    with connect(strict_server) as sock:
        wait_closed(sock)


def test_trickled_headers_are_cut_off_at_the_header_timeout(strict_server):
    # slowloris: a byte at a time keeps uvicorn's own timer from ever firing
    with connect(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Trickle: ")
        deadline = time.monotonic() + SAFETY_S
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                try:
                    received = sock.recv(65536)
                except ConnectionResetError:  # closed with our trickled bytes unread: a reset, not a FIN
                    return
                assert received == b"", "the server answered a request whose head never ended"
                return
        raise AssertionError(f"a client trickling its headers kept the connection for {SAFETY_S} s")


def test_a_body_that_never_ends_is_cut_off_at_the_body_timeout(strict_server):
    with connect(strict_server) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        sock.sendall(head.encode() + b'{"prompt": [1, 2')
        wait_closed(sock)
    assert httpx.get(f"{strict_server.url}/health", timeout=SAFETY_S).status_code == 200  # and the server carries on


@pytest.mark.parametrize("how", ["closed", "too slow"])
def test_a_client_gone_mid_body_is_an_abort_not_a_traceback(strict_server, caplog, how):
    """uvicorn logged each such client as 70 lines ending in starlette's ClientDisconnect. Not a
    request the engine ran: no outcome is counted (vLLM's request_success would read it as one)."""
    outcomes_before = outcomes(strict_server)
    with caplog.at_level(logging.INFO, logger="graphrt"), connect(strict_server) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        sock.sendall(head.encode() + b'{"prompt": [1, 2')
        if how == "closed":
            sock.shutdown(socket.SHUT_RDWR)
        else:
            wait_closed(sock)  # the body timeout
        deadline = time.monotonic() + SAFETY_S
        while "went away while sending its request body" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "went away while sending its request body" in caplog.text and "Traceback" not in caplog.text
    assert "Exception in ASGI application" not in caplog.text
    assert outcomes(strict_server) == outcomes_before


def outcomes(server: ServerThread) -> list[str]:
    return re.findall(r'^graphrt_requests_total\{outcome="\w+"\} \S+$', httpx.get(f"{server.url}/metrics", timeout=SAFETY_S).text, re.M)


def test_a_request_sent_in_time_is_served(strict_server):
    with connect(strict_server) as sock:
        for _ in range(2):  # twice on one connection: the next head gets a fresh header timeout
            assert request(sock, "GET", "/health").status == 200


# -- framing and size -------------------------------------------------------------------------------


def test_declared_oversized_body_gets_413_at_once(strict_server):
    # Only the head is sent: a server that waited for the 200 MiB would never answer.
    with connect(strict_server) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {200 << 20}\r\n\r\n"
        sock.sendall(head.encode())
        response = http.client.HTTPResponse(sock)
        response.begin()
        error = json.loads(response.read())["error"]
    assert response.status == 413
    assert error["code"] == "request_too_large" and str(1 << 20) in error["message"]


def test_content_length_with_transfer_encoding_gets_400_and_the_connection_closes(strict_server):
    with connect(strict_server) as sock:
        body = b'{"prompt": [1]}'
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), "Transfer-Encoding": "chunked"}
        response = request(sock, "POST", "/v1/completions", headers, body)
        assert response.status == 400 and response.getheader("connection") == "close"
        wait_closed(sock)


# -- how many, and how fast ---------------------------------------------------------------------------


def test_connections_past_the_limit_get_503_until_one_closes(tiny_model_factory):
    limits = ConnectionLimits(header_timeout_s=120, body_timeout_s=120, keep_alive_s=120, max_connections=3)
    with serving(tiny_model_factory, limits) as server:
        held = [connect(server) for _ in range(3)]
        for sock in held:
            assert request(sock, "GET", "/health").status == 200  # served, so counted; kept alive
        with connect(server) as extra:
            refused = request(extra, "GET", "/health")
            assert refused.status == 503 and refused.getheader("connection") == "close"
            wait_closed(extra)
        held.pop().close()
        deadline = time.monotonic() + SAFETY_S  # the server learns of the close asynchronously
        while True:
            with connect(server) as sock:
                if request(sock, "GET", "/health").status == 200:
                    break
            assert time.monotonic() < deadline, "a freed connection slot was never reused"
        for sock in held:
            sock.close()


def test_accepted_connections_send_without_delay(patient_server):
    # Nagle's algorithm would hold each response after the first on a kept-alive connection ~40 ms.
    with connect(patient_server) as sock:
        assert request(sock, "GET", "/health").status == 200
        sockets = server_sockets(patient_server)
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


# -- the API key ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_bearer_scheme_is_case_insensitive(patient_server, scheme):
    response = httpx.get(f"{patient_server.url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=SAFETY_S)
    assert response.status_code == 200


@pytest.mark.parametrize("authorization", [f"Bearer {API_KEY}x", f"Basic {API_KEY}", API_KEY, "Bearer", ""])
def test_wrong_key_or_scheme_gets_401(patient_server, authorization):
    response = httpx.get(f"{patient_server.url}/v1/models", headers={"Authorization": authorization}, timeout=SAFETY_S)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


@pytest.fixture
def serve_options(monkeypatch):
    """`graphrt serve` with the server replaced by one that records its options instead of serving."""
    seen = []
    monkeypatch.setattr("graphrt.server.serve", lambda options, echo: seen.append(options))
    monkeypatch.delenv("GRAPHRT_API_KEY", raising=False)
    return seen


def run_serve(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, ["serve", *args], env=env)


@pytest.mark.parametrize(("args", "env"), [(["--api-key", ""], None), ([], {"GRAPHRT_API_KEY": ""})], ids=["flag", "env"])
def test_empty_api_key_is_refused_at_start_up(serve_options, args, env):
    result = run_serve(*args, env=env)
    assert result.exit_code == 1 and not serve_options
    assert "is empty" in result.output and "none at all to serve without authentication" in result.output


def test_api_key_from_env(serve_options):
    assert run_serve(env={"GRAPHRT_API_KEY": "from-env"}).exit_code == 0
    assert serve_options[0].api_key == "from-env"


def test_api_key_file_is_read_without_its_trailing_newline(serve_options, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    result = run_serve("--api-key-file", str(key_file))
    assert result.exit_code == 0, result.output
    assert serve_options[0].api_key == "s3cret-key"


@pytest.mark.parametrize(("content", "message"), [("\n", "is empty"), (None, "cannot read the API key file")], ids=["empty", "missing"])
def test_unusable_api_key_file_is_refused(serve_options, tmp_path, content, message):
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    result = run_serve("--api-key-file", str(key_file))
    assert result.exit_code == 1 and not serve_options
    assert message in result.output and str(key_file) in result.output


def test_api_key_and_api_key_file_together_are_refused(serve_options, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("a")
    result = run_serve("--api-key", "b", "--api-key-file", str(key_file))
    assert result.exit_code == 1 and "not both" in result.output and not serve_options


def test_connection_limits_reach_the_server(serve_options):
    result = run_serve("--max-connections", "7", "--timeout-header", "2", "--timeout-body", "3", "--timeout-keep-alive", "4", "--max-body-bytes", "4096")
    assert result.exit_code == 0, result.output
    options = serve_options[0]
    assert options.limits == ConnectionLimits(header_timeout_s=2, body_timeout_s=3, keep_alive_s=4, max_connections=7)
    assert options.max_body_bytes == 4096


def test_prefill_chunk_size_reaches_the_engine_and_a_server_defaults_to_smaller_chunks(serve_options):
    from graphrt.config import EngineConfig

    assert run_serve().exit_code == 0
    assert serve_options[0].llm_kwargs["prefill_chunk_size"] == 256 < EngineConfig.prefill_chunk_size
    assert run_serve("--prefill-chunk-size", "1024").exit_code == 0
    assert serve_options[1].llm_kwargs["prefill_chunk_size"] == 1024
    result = run_serve("--prefill-chunk-size", "0")
    assert result.exit_code == 2 and "0 is not in the range x>=1" in result.output


def test_exposure_without_a_key_is_warned_about():
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert "without an API key" in exposure_warning(host, None)
    for host in ("127.0.0.1", "::1", "[::1]", "localhost"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", API_KEY) is None

"""An idle server gives the heap's free memory back: the engine thread trims the C heap once each
time a busy engine runs out of work, never while it has work, and not again while it stays idle.

The memory figures themselves (RSS over a 10-minute soak) are measured by benchmarks/soak.py.
"""

from __future__ import annotations

import threading

import pytest

for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402

from graphrt.frontend import async_engine  # noqa: E402
from graphrt.llm import LLM  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402

SAFETY_S = 30  # only a failing test waits this long


def test_the_heap_is_trimmed_once_each_time_the_engine_goes_idle(tiny_model_factory, monkeypatch):
    llm = LLM(tiny_model_factory(), max_num_seqs=4, max_batch=2)
    engine = llm.engine
    trims: list[bool] = []  # whether the engine had work at each trim
    trimmed = threading.Condition()

    def counting_trimmer():
        def trim() -> None:
            with trimmed:
                trims.append(engine.has_work())
                trimmed.notify_all()

        return trim

    monkeypatch.setattr(async_engine, "heap_trimmer", counting_trimmer)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    with ServerThread(llm, ServerSettings(model_id="tiny")) as server, httpx.Client(base_url=server.url, timeout=SAFETY_S) as http:
        assert http.get("/health").status_code == 200
        assert trims == []  # nothing ran yet, so nothing to give back
        for done in (1, 2):
            assert http.post("/v1/completions", json=body).status_code == 200
            with trimmed:  # the trim follows the response, as the thread goes back to sleep
                assert trimmed.wait_for(lambda: len(trims) >= done, SAFETY_S), trims
        for _ in range(3):  # health checks reach the event loop only: the engine stays idle
            assert http.get("/health").status_code == 200
    assert trims == [False, False]  # the server has stopped: its engine thread has nothing left to do

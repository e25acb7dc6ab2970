"""One generation request over HTTP: admission, then SSE chunks or one JSON body, then clean-up.

Whatever way a request ends (finished, client gone, server stopping, handler cancelled), `close`
aborts it in the engine if it is still running there and records its metrics exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from graphrt.errors import RequestError
from graphrt.frontend.async_engine import Admitted, AsyncEngine, ChoiceUpdate, Disconnected, Failed, GenerationJob, Rejected
from graphrt.server.errors import APIError
from graphrt.server.metrics import ServerMetrics
from graphrt.server.responses import ChoiceState, ResponseFormat, usage

logger = logging.getLogger("graphrt.server")


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class Generation:
    def __init__(
        self,
        async_engine: AsyncEngine,
        metrics: ServerMetrics,
        job: GenerationJob,
        response_format: ResponseFormat,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ):
        self.async_engine = async_engine
        self.metrics = metrics
        self.job = job
        self.format = response_format
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # every chunk's usage so far, not only the last chunk's (vLLM's)
        self.choices = [ChoiceState() for _ in job.params]
        self.prompt_tokens = 0
        self.state = "new"  # -> submitted -> admitted, or refused by the engine
        self.outcome: str | None = "abort"  # None: counted by the API error handler instead
        self._watcher: asyncio.Task | None = None
        self._closed = False
        self._first_token_seen = False  # the request's time to first token is observed once

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def apply(self, update: ChoiceUpdate) -> ChoiceState:
        """A choice's new tokens from the engine, counted in the metrics as they come."""
        choice = self.choices[update.index]
        before = choice.num_tokens
        choice.apply(update)
        first = None
        if not self._first_token_seen and choice.first_at is not None:
            self._first_token_seen, first = True, choice.first_at - self.job.arrived_at
        self.metrics.count_tokens(choice.num_tokens - before, first)
        return choice

    async def admit(self, request: Request) -> bool:
        """Tokenize and check the prompt, hand the job to the engine and wait until it is queued there.

        Raises APIError if the prompt or the engine refuses it; returns False if the client went away first.
        """
        try:
            await self.async_engine.prepare(self.job)
        except RequestError as exc:
            self.outcome = None
            raise APIError(400, str(exc), code=exc.code) from None
        except Exception:
            logger.exception("preparing a request failed")
            self.outcome = None
            raise APIError(500, "internal error while preparing the request; see the server log") from None
        if not self.async_engine.submit(self.job):
            self.outcome = None
            raise APIError(503, "the server is shutting down; retry on another server")
        self.state = "submitted"
        self._watcher = asyncio.create_task(self._watch_disconnect(request))
        update = await self.job.updates.get()
        if isinstance(update, Disconnected):
            self.close()
            return False
        if isinstance(update, Admitted):
            self.state = "admitted"
            self.prompt_tokens = update.prompt_tokens
            self.format.start(self.job, self.choices)
            self.metrics.prompt_tokens.inc(update.prompt_tokens)
            return True
        self.state, self.outcome = "refused", None
        self.close()
        raise APIError(400, update.message, code=update.code) if isinstance(update, Rejected) else APIError(update.status, update.message)

    async def _watch_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.job.updates.put_nowait(Disconnected())

    def stop_watching(self) -> None:
        """A streaming response listens for the disconnect itself (and cancels the stream)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def collect(self) -> dict | None:
        """The whole response body, or None when the client went away first."""
        try:
            while not self.finished:
                update = await self.job.updates.get()
                if isinstance(update, Disconnected):
                    return None
                if isinstance(update, Failed):
                    self.outcome = None
                    raise APIError(update.status, update.message)
                self.apply(update)
            self._set_finished_outcome()
            return self.format.response(self.prompt_tokens, self.choices)
        finally:
            self.close()

    async def events(self) -> AsyncIterator[str]:
        """SSE events: per-choice deltas, an optional usage chunk, then `data: [DONE]`."""
        fmt, include_usage = self.format, self.include_usage
        opened: set[int] = set()
        try:
            while not self.finished:
                update = await self.job.updates.get()
                if isinstance(update, Disconnected):
                    return
                if isinstance(update, Failed):
                    self.outcome = "error"
                    yield sse(APIError(update.status, update.message).body())
                    break
                # A choice's opening chunk (chat's role) comes with its first tokens, as vLLM sends
                # it: clients time the first token from the first chunk, and one sent at admission
                # made a chat's TTFT read near zero, its prefill counted as the first ITL.
                choice = self.apply(update)  # before any yield: a stream cancelled there still counts it
                if update.index not in opened:
                    opened.add(update.index)
                    opening = fmt.opening_choice(update.index)
                    if opening is not None:
                        yield sse(fmt.chunk([opening], include_usage))
                for piece in fmt.delta_choices(update.index, choice, choice.take_delta()):
                    yield sse(fmt.chunk([piece], include_usage, usage(self.prompt_tokens, self.choices) if self.continuous_usage else None))
            else:
                self._set_finished_outcome()
                if include_usage:
                    yield sse(fmt.chunk([], True, usage(self.prompt_tokens, self.choices)))
            yield sse("[DONE]")
        finally:
            self.close()

    def _set_finished_outcome(self) -> None:
        self.outcome = "length" if any(c.finish_reason == "length" for c in self.choices) else "stop"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_watching()
        if self.state == "submitted" or (self.state == "admitted" and not self.finished):
            self.async_engine.abort(self.job)  # the engine frees its KV blocks before its next step
        if self.state == "admitted":
            self.metrics.observe(self.job.arrived_at, self.choices, finished=self.outcome in ("stop", "length"))
        if self.outcome is not None:
            self.metrics.count(self.outcome)


class GenerationStream(StreamingResponse):
    """An SSE response that closes its generation however the response ends: finished, client
    gone (the stream is cancelled, possibly between two events) or server stopping."""

    def __init__(self, generation: Generation):
        super().__init__(generation.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()

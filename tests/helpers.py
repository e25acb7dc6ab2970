"""Helpers the tests share."""

from __future__ import annotations

import contextlib

import torch

from graphrt.engine.engine import Engine
from graphrt.sampling_params import SamplingParams


def prompt_logits(engine: Engine, prompt_ids: list[int]) -> torch.Tensor:
    """Last-position logits of a prompt, computed through the engine's scheduler and stages."""
    seq = engine.add_request(prompt_ids, SamplingParams(max_tokens=1, temperature=0))
    while True:
        step = engine.scheduler.schedule()
        logits = engine.run(step)
        if not seq.in_prefill:
            row = step.seqs.index(seq)
            engine.abort(seq)
            return logits[row].float().cpu()


def run_counting_feed_reads(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, int]:
    """Add every request and step the engine until it is done. Returns the sequences and how often
    a micro-batch in flight read its input tokens from the device feed (async scheduling)."""
    seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    feed_reads = 0
    while engine.has_work():
        engine.step()
        feed_reads += sum(mb.reads_feed for mb in engine.ring.in_flight)
    return seqs, feed_reads


SERVER_MODES = ["thread", "process"]


def engine_for_server(mode: str, **llm_kwargs):
    """What a test server runs: an LLM whose engine is stepped on a thread of the test process
    ("thread"), or an EngineClient whose engine runs in a process of its own ("process", `graphrt
    serve`'s default)."""
    if mode == "process":
        from graphrt.frontend.engine_client import EngineClient

        return EngineClient(llm_kwargs, echo=lambda line: None)
    from graphrt.llm import LLM

    return LLM(**llm_kwargs)


@contextlib.contextmanager
def running_server(mode: str, settings: dict | None = None, **llm_kwargs):
    """A server on a free port of this host, its engine as `engine_for_server(mode)` makes it;
    `settings`: ServerSettings fields besides the model id (the model folder's name)."""
    from graphrt.server import ServerSettings, ServerThread

    engine = engine_for_server(mode, **llm_kwargs)
    with ServerThread(engine, ServerSettings(model_id=engine.model_dir.name, **(settings or {}))) as running:
        yield running

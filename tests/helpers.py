"""Helpers the tests share."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from graphrt.engine.engine import Engine
from graphrt.engine.sequence import FinishReason
from graphrt.sampling_params import SamplingParams

if TYPE_CHECKING:
    from graphrt.llm import LLM


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


def hf_model(model_dir, dtype: torch.dtype):
    """transformers' model of `model_dir` in `dtype`, the reference graphrt is compared with. A mixture
    of experts runs transformers' eager experts loop: its default (grouped_mm) computes no float64."""
    import transformers

    from graphrt.model.config import ModelConfig

    options = {"experts_implementation": "eager"} if ModelConfig.from_dir(model_dir).moe is not None else {}
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **options).eval()


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


# The default model served in float32 (choices must equal single requests' numbers) to the modules
# that only ask it questions, one server per engine mode for all of them (conftest.py's
# default_model_server: a server start is most of such a module's time).
SERVED_API_KEY = "test-key-123"


def serve_default_model(mode: str, model_dir):
    return running_server(mode, dict(api_key=SERVED_API_KEY), model=model_dir, dtype="float32", max_num_seqs=16)


# `graphrt serve` as a user runs it, in a subprocess (tests/server/test_server_shutdown.py,
# tests/engine/test_engine_process.py).
API_KEY = "shutdown-test-key"


def start_server(max_batch: int = 4, extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, list[str]]:
    env = {**os.environ, "GRAPHRT_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "graphrt", "serve", "--port", "0", "--max-model-len", "512", "--max-batch", str(max_batch), *extra_args]
    # SIGHUP as a terminal leaves it, even where the tests run under nohup: the server stops on it
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        found = re.search(r"serving \S+ on (http://\S+)", line)
        if found:
            lines.append(proc.stdout.readline().rstrip("\n"))  # the curl line
            return proc, found.group(1), lines
    proc.kill()
    raise AssertionError("the server did not start:\n" + "\n".join(lines))


def children_of(pid: int) -> list[int]:
    """The process ids of `pid`'s children (Linux /proc)."""
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(child) for child in listing.read().split()]


# What a sampler's draws should follow (tests/runtime/test_sampling.py, and speculative decoding's
# sampled acceptance).
def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What the sampler documents (vLLM's order), written out independently: soften or sharpen
    with the temperature first, keep the top_k most likely tokens and renormalise, then keep the
    smallest prefix of those whose mass reaches top_p (always the first token), and renormalise."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (vocab,)
    order = probs.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]
    top_k_mass = sum(probs[token].item() for token in order)
    kept = torch.zeros_like(probs)
    mass_before = 0.0
    for rank, token in enumerate(order):
        if rank > 0 and mass_before >= top_p:
            break
        kept[token] = probs[token]
        mass_before += probs[token].item() / top_k_mass
    return kept / kept.sum()


def reference_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], eos_ids: set[int] | frozenset[int]
) -> torch.Tensor:
    """What vLLM does to one request's logits (vocab,) before the temperature, written out token by
    token in Python floats (tests/runtime/test_logits_processors.py, tests/engine/test_penalized_generation.py):
    allowed tokens, bad words (their prefix over the output only), EOS and stop tokens before
    min_tokens, logit_bias, then the repetition, frequency and presence penalties."""
    x = logits.tolist()
    if params.allowed_token_ids is not None:
        x = [value if token in params.allowed_token_ids else -math.inf for token, value in enumerate(x)]
    for word in params.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            x[word[-1]] = -math.inf
    if len(output) < params.min_tokens:
        for token in set(eos_ids) | set(params.stop_token_ids):
            x[token] = -math.inf
    for token, bias in (params.logit_bias or {}).items():
        x[token] = x[token] + bias
    for token in range(len(x)):
        count = output.count(token)
        if params.repetition_penalty != 1 and (count or token in prompt):
            penalty = params.repetition_penalty
            x[token] = x[token] / penalty if x[token] > 0 else x[token] * penalty
        x[token] = x[token] - params.frequency_penalty * count
        x[token] = x[token] - params.presence_penalty * float(count > 0)
    return torch.tensor(x, dtype=logits.dtype)


def assert_draws_follow(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Empirical frequencies within a total-variation bound that random draws exceed with
    probability under 1e-9, and no token outside the expected support."""
    num_draws = tokens.numel()
    frequencies = torch.bincount(tokens, minlength=expected.numel()).double() / num_draws
    assert set(tokens.unique().tolist()) <= set(expected.nonzero().flatten().tolist())
    # E[TV] <= sum sqrt(p (1 - p) / N) / 2, and TV moves by at most 1/N per draw, so by McDiarmid
    # it exceeds its mean by t with probability at most exp(-2 N t^2).
    mean_bound = (expected * (1 - expected) / num_draws).sqrt().sum().item() / 2
    bound = mean_bound + math.sqrt(math.log(1e9) / (2 * num_draws))
    distance = (frequencies - expected).abs().sum().item() / 2
    assert distance < bound, f"total variation {distance:.4f} >= {bound:.4f}: {frequencies} vs {expected}"


MEASURED = "measured"  # generate_all: the step costs the engine timed at start-up


def run_aborting_one_mid_verify(engine: Engine, prompts, params, reference, after_each_step=None) -> None:
    """With every draft verified, add every request, abort the first caught with a verify step in
    flight (two tokens in) once some row has been preempted (an abort frees blocks, and an early one
    could spare every row its preemption, depending on the timing), and step the engine until it is
    done, calling `after_each_step()` after each step. Asserts the aborted one got a prefix of its
    `reference` tokens and every other exactly its own, and every KV block came back."""
    engine.scheduler.speculation.step_costs = None  # every draft, so that verify steps are in flight to abort
    seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    aborted = None
    while engine.has_work():
        engine.step()
        if after_each_step is not None:
            after_each_step()
        if aborted is None and engine.scheduler.num_preemptions > 0:
            verifying = [s for s in seqs if s.draft_ids and not s.finished and len(s.output_ids) > 2]
            if verifying:
                aborted = verifying[0]
                engine.abort(aborted)
    assert engine.scheduler.num_preemptions > 0
    assert aborted is not None, "no request was ever caught with a verify step in flight after a preemption"
    for seq, want in zip(seqs, reference):
        if seq is aborted:
            assert seq.finish_reason is FinishReason.ABORT and seq.output_ids == want[: len(seq.output_ids)]
        else:
            assert seq.output_ids == want
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1, "KV blocks leaked"


def generate_all(model, prompts, params, step_costs=MEASURED, **options) -> tuple[list[list[int]], LLM]:
    """Each prompt's tokens, all requests added at once (each with its own params). `step_costs`:
    what the drafts must pay for, in place of what the engine timed at start-up (None: every
    draft proposed is verified), so that where rows draft does not change from one start to the next."""
    from graphrt.llm import LLM

    llm = LLM(model=model, dtype="float64", **options)
    engine = llm.engine
    if step_costs is not MEASURED and engine.scheduler.speculation is not None:
        engine.scheduler.speculation.step_costs = step_costs
    try:
        seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        return [seq.output_ids for seq in seqs], llm
    finally:
        engine.close()


class RequestLog:
    """The JSON bodies an httpx client posts, to see what a client library (LangChain, pydantic-ai...)
    really sent: pass `log.client()` as its http client."""

    def __init__(self):
        self.bodies: list[dict] = []

    def __call__(self, request) -> None:
        self.bodies.append(json.loads(request.read()))

    def client(self):
        import httpx  # the server stack's: not on every GPU image

        return httpx.Client(event_hooks={"request": [self]}, timeout=120)


class RecordingDomain:
    """Stands in for an nvtx domain: attributes are the message itself; pushes and pops are logged."""

    def __init__(self):
        self.events: list[tuple[str, str | None, str]] = []  # (push | pop, message, thread name)
        self.attribute_calls = Counter()

    def get_event_attributes(self, message=None, color=None):
        self.attribute_calls[message] += 1
        return message

    def push_range(self, attributes):
        self.events.append(("push", attributes, threading.current_thread().name))

    def pop_range(self):
        self.events.append(("pop", None, threading.current_thread().name))


def fail_at_call(stage, call: int, message: str = "injected fault") -> None:
    """Make `stage`'s forward raise RuntimeError(message) on its `call`-th call (1-based), and run
    as usual on every other."""
    forward, calls = stage.forward, []

    def flaky(x, meta, cache):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError(message)
        return forward(x, meta, cache)

    stage.forward = flaky

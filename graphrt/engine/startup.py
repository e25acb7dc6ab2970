"""Building an engine: from a model folder and options (a graph cache supplying what they leave
unset), warmed up, with the start-up banner printed once. The LLM face, the in-thread server and
the engine process all start an engine here."""

from __future__ import annotations

import dataclasses
import difflib
import os
import time
from pathlib import Path
from typing import Callable

from graphrt.capture.manifest import read_manifest
from graphrt.config import EngineConfig
from graphrt.engine.engine import Engine
from graphrt.errors import ModelLoadError
from graphrt.model.default_model import default_model_path, model_dir_for
from graphrt.model.kv_cache import describe_token_bytes
from graphrt.sampling_params import SamplingParams

# Options a graph cache supplies when the caller leaves them unset; set differently, they make it stale.
CACHE_DEFAULTS = ("pp", "dtype", "kernels", "buckets", "block_size", "max_model_len")


def build_engine(
    model: str | Path | None = None,
    cache: str | Path | None = None,
    show_progress: bool = False,
    eos_token_id: Callable[[], int | None] | None = None,
    load_colleagues: tuple[int, ...] = (),
    **engine_options,
) -> Engine:
    """An engine for `model` (None: the default model), its options `EngineConfig` fields (None
    means the default), those `cache` (a `graphrt capture` folder) records taken from it;
    `eos_token_id` and `load_colleagues` as Engine takes them."""
    check_option_names(engine_options)
    options = {k: v for k, v in engine_options.items() if v is not None}
    if cache is not None:
        cache = Path(cache)
        # Compiled Triton kernels live in the cache too; triton reads this when it first compiles.
        os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
        manifest = read_manifest(cache)
        max_batch = options.get("max_batch")
        if max_batch is not None and "buckets" not in options and max_batch != max(manifest["buckets"]):
            raise ValueError(
                f"max_batch {max_batch} differs from the graph cache {cache}, whose largest bucket is {max(manifest['buckets'])}; "
                f"leave it out, or refresh the cache with `graphrt capture --out {cache} --max-batch {max_batch}`"
            )
        if options.get("ep", 1) > 1:
            # the cache's eager buckets would be rank 0's alone, and its other expert ranks must capture as it does
            raise ValueError("a graph cache (--cache, graphrt capture) with --ep is not supported yet; drop one of them")
        for field in CACHE_DEFAULTS:
            options.setdefault(field, manifest[field])
    model_dir = model_dir_for(model)
    return Engine(
        model_dir, EngineConfig(**options), cache_dir=cache, show_progress=show_progress, eos_token_id=eos_token_id,
        load_colleagues=load_colleagues,
    )


def model_for(model: str | Path | None, cache: str | Path | None) -> str | Path | None:
    """The model a run means: `model`, or where none is given, the folder `cache` was captured from
    (as pp and dtype come from the cache); None is the default model. A folder that is gone is named
    rather than replaced by the default model, which the cache would then refuse."""
    if model is not None or cache is None:
        return model
    captured_from = read_manifest(Path(cache)).get("model_dir")
    if not isinstance(captured_from, str) or Path(captured_from) == default_model_path():
        return None  # the default model, converted again if its folder was removed
    if not Path(captured_from).is_dir():
        raise ModelLoadError(
            f"the graph cache {cache} was captured from {captured_from}, which is not here; pass --model with that model's folder"
        )
    return captured_from


# vLLM's LLM arguments that are no EngineConfig field, with what to pass instead.
VLLM_OPTIONS = {
    "enforce_eager": "pass use_graphs=False",
    "tensor_parallel_size": "graphrt has no tensor parallelism; split the model with pp=N (and a mixture of experts' experts with ep=N)",
    "gpu_memory_utilization": "graphrt sizes the KV cache from the memory left free; cap it with kv_cache_tokens=N",
    "max_num_batched_tokens": "a step's prompt tokens are prefill_chunk_size",
    "trust_remote_code": "leave it out: graphrt runs no code from the model folder",
    "enable_prefix_caching": "leave it out: prefix caching is on unless prefix_caching=False",
    "tokenizer": "leave it out: the tokenizer is read from the model folder",
    "quantization": "graphrt serves unquantized weights (graphrt import-gguf de-quantizes a GGUF file)",
}


def check_option_names(engine_options: dict) -> None:
    """A name that is no EngineConfig field (a typo, or a vLLM option graphrt lacks) raises a
    TypeError naming it, and what to pass instead: vLLM's equivalent, or the field it was likely
    meant to be."""
    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    for name in engine_options:
        if name in VLLM_OPTIONS:
            raise TypeError(f"{name} is vLLM's: {VLLM_OPTIONS[name]}")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {close[0]}?" if close else "; the options are EngineConfig's fields (docs/usage.md, Python API)"
            raise TypeError(f"graphrt has no engine option {name!r}{hint}")


def warm_up(engine: Engine) -> None:
    """A greedy and a sampled request of two tokens each, so the first client pays no first-call costs."""
    for temperature in (0.0, 1.0):
        engine.add_request([0], SamplingParams(max_tokens=2, temperature=temperature, ignore_eos=True, seed=0))
    while engine.has_work():
        engine.step()


def load_and_warm_up(
    llm_kwargs: dict, echo: Callable[[str], None], where: str = "", eos_token_id: Callable[[], int | None] | None = None,
    load_colleagues: tuple[int, ...] = (),
) -> Engine:
    """Build (from `LLM`'s keyword arguments) and warm up an engine for serving, echoing the
    start-up banner line by line as each phase ends; `where` ends its first line (e.g. ", engine in
    its own process")."""
    start = time.perf_counter()
    engine = build_engine(**llm_kwargs, eos_token_id=eos_token_id, load_colleagues=load_colleagues)
    stages = f", {engine.stage_summary()}" if len(engine.layers) > 1 else ""  # one stage reads everything
    echo(
        f"[graphrt] load and capture {time.perf_counter() - start:.1f} s: {engine.model_dir.name}, {engine.describe()}, "
        f"buckets up to {engine.plan.max_batch}, {engine.config.max_num_seqs} sequences at once, "
        f"context {engine.max_model_len}, {engine.allocator.num_blocks - 1} KV blocks of "
        f"{describe_token_bytes(engine.model_config, engine.dtype)}{stages}{where}"
    )
    if engine.config.ep > 1:
        echo(f"[graphrt] {engine.expert_rank_summary()}")
    echo(f"[graphrt] {engine.pipeline.matmul_summary()}")
    echo(f"[graphrt] {engine.kernel_summary()}")
    start = time.perf_counter()
    try:
        warm_up(engine)
    except BaseException:
        engine.close()
        raise
    echo(f"[graphrt] warm-up {time.perf_counter() - start:.1f} s")
    return engine

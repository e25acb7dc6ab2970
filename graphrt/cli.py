"""The `graphrt` command: one click command per verb."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import click

from graphrt.cli_flags import Command, no_op_flags
from graphrt.errors import GraphrtError
from graphrt.kernels.cpu.placement import CPU_PLACEMENTS, MIN_CORES_TO_PIN
from graphrt.logs import configure_logging
from graphrt.model.default_model import DEFAULT_MODEL_HUB_ID
from graphrt.signals import StartUpStopped, stop_requests_noted

# A server's prefill chunks are half an offline run's (EngineConfig.prefill_chunk_size, 512, which
# the help below names without importing torch): a burst of new requests then gets its first
# tokens in several shorter steps, as vLLM's API server takes a smaller token budget than its LLM
# class (benchmarks/results.md, "Smaller prefill chunks for `graphrt serve`").
SERVE_PREFILL_CHUNK_SIZE = 256
KERNEL_CHOICES = ("auto", "torch", "triton")  # graphrt.kernels.KERNEL_CHOICES, which imports torch
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # graphrt.server.tool_parsers.TOOL_CALL_PARSERS, whose package loads the server


class FiniteFloat(click.FloatRange):
    """A float flag in its range, and finite: click's range lets nan through (every comparison is
    false) and inf reached `time.sleep` as an OverflowError."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Group(click.Group):
    """Prints graphrt's own errors as one line (what happened, what to do) and exits 1; Ctrl+C ends a
    command with "Aborted!" and 130, the shell's code for a run stopped by SIGINT (click's own is 1,
    which scripts cannot tell from a failure)."""

    command_class = Command

    def invoke(self, ctx):
        try:
            configure_logging()
            return super().invoke(ctx)
        except (GraphrtError, ValueError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\nAborted!", err=True)
            sys.exit(130)


@click.group(cls=Group)
@click.version_option(package_name="graphrt")
def main() -> None:
    """graphrt: pipeline-parallel LLM serving on CUDA graphs."""


def parse_devices(value: str | None) -> list[str] | None:
    return [d.strip() for d in value.split(",")] if value else None


def model_options(command):
    """Options shared by every command that builds an engine: the model, its stages, its graphs."""
    options = [
        click.option("--model", type=click.Path(path_type=Path), default=None, help="Hugging Face style model folder [default: SmolLM2-135M-Instruct]."),
        click.option("--pp", "-pp", "--pipeline-parallel-size", "pp", type=click.IntRange(min=1), default=None,
                     help="Pipeline stages [default: 1, or the graph cache's]."),
        click.option("--devices", default=None, help="Comma-separated device per stage, e.g. cuda:0,cuda:1; under --ep one per rank, stage-major (--pp 2 --ep 2: cuda:0,cuda:1,cuda:2,cuda:3, stage 0 on the first two) [default: from the machine]."),
        click.option("--dtype", default=None, help="float32, bfloat16, float16 or float64 [default: bfloat16 on CPUs with AMX or AVX512-BF16, else float32; the model's dtype on CUDA]."),
        click.option("--kernels", type=click.Choice(KERNEL_CHOICES), default=None, help="Decode kernels [default: triton on CUDA, torch elsewhere]."),
        click.option("--max-batch", type=click.IntRange(min=1), default=None, help="Largest decode bucket [default: 32 on CPU; on CUDA from KV cache memory, 8 to 256]."),
        click.option("--buckets", default=None, help="Decode bucket sizes, e.g. 1,2,4,8,16 [default: 1, 2, 4, 8, then every 8 up to --max-batch]."),
        click.option("--depth", type=click.IntRange(min=0), default=None, help="Micro-batches in flight beyond one per stage: the ring has pp + depth slots [default: 1 with CUDA stages on several GPUs, else 0]."),
        click.option("--async-scheduling/--no-async-scheduling", default=True, help="Launch a slot's next decode step before its tokens are read back, so the host's turnaround overlaps the stages' work [default: on]."),
        click.option("--no-prefix-caching", is_flag=True, help="Prefill every prompt whole instead of reusing the KV blocks of prefixes computed before."),
        click.option("--no-graphs", "--enforce-eager", "no_graphs", is_flag=True,
                     help="Replay decode eagerly over the same static buffers instead of CUDA graphs (--enforce-eager: vLLM's name)."),
        click.option("--allow-eager", is_flag=True, help="Run a (stage, bucket) whose capture fails eagerly instead of stopping."),
        click.option("--procs", is_flag=True, help="Run stages 1..pp-1 in worker processes over torch.distributed (see docs/distributed.md)."),
        click.option("--ep", type=click.IntRange(min=1), default=None, help="Expert parallelism: ranks per stage, each holding 1/N of every sparse layer's routed experts; implies --procs (see docs/distributed.md) [default: 1]."),
        click.option("--watchdog-s", type=FiniteFloat(min=0, min_open=True), default=None, help="With --procs: a stage silent this long is declared dead [default: 30]."),
        click.option("--speculative-config", default=None, help='Speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (see docs/speculative.md) [default: off].'),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def engine_kwargs(
    model, pp, devices, dtype, kernels, max_batch, buckets, depth, async_scheduling, no_prefix_caching, no_graphs, allow_eager,
    procs=False, ep=None, watchdog_s=None, speculative_config=None,
) -> dict:
    from graphrt.capture.buckets import parse_buckets

    return dict(
        model=model,
        pp=pp,
        devices=parse_devices(devices),
        dtype=dtype,
        kernels=kernels,
        max_batch=max_batch,
        buckets=parse_buckets(buckets) if buckets else None,
        depth=depth,
        async_scheduling=async_scheduling,
        prefix_caching=False if no_prefix_caching else None,
        use_graphs=False if no_graphs else None,
        allow_eager=allow_eager or None,
        procs=procs or None,
        ep=ep,
        watchdog_s=watchdog_s,
        speculative_config=speculative_config,
    )


@main.command()
@click.option("--prompt", default=None, help="The prompt text.")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None, help="One prompt per line, or JSONL with a \"prompt\" field (text or token ids); answers are printed as JSONL.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn with the model's chat template.")
@model_options
@click.option("--cache", type=click.Path(path_type=Path), default=None, help="Graph cache folder written by `graphrt capture`.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=FiniteFloat(min=0), default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=FiniteFloat(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables it.")
@click.option("--seed", type=int, default=None, help="Seed for this request's sampling.")
def generate(prompt, prompts_file, chat, cache, max_tokens, temperature, top_p, top_k, seed, **model_args) -> None:
    """Generate completions for a prompt (or a file of them) and report tokens/s and weight bandwidth."""
    from graphrt.llm import LLM
    from graphrt.sampling_params import SamplingParams

    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give exactly one of --prompt TEXT and --prompts-file FILE")
    prompts = [prompt] if prompt is not None else read_prompts(prompts_file)
    start = time.perf_counter()
    llm = LLM(cache=cache, **engine_kwargs(**model_args))
    load_seconds = time.perf_counter() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    requests = [llm.chat_prompt(p) if chat and isinstance(p, str) else p for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params)
    seconds = time.perf_counter() - start
    if prompts_file is None:
        click.echo(outputs[0].text)
    else:
        for source, output in zip(prompts, outputs):
            line = {
                "prompt": source, "text": output.text, "num_tokens": len(output.token_ids), "token_ids": output.token_ids,
                "finish_reason": output.finish_reason,
            }
            click.echo(json.dumps(line))
    engine, stats = llm.engine, llm.engine.stats
    num_tokens = sum(len(o.token_ids) for o in outputs)
    click.echo(
        f"[graphrt] {num_tokens} tokens in {seconds:.2f} s ({num_tokens / seconds:.1f} tok/s); "
        f"decode {stats.decode_tokens_per_s():.1f} tok/s, "
        f"{stats.weight_gb_per_s():.1f} GB/s of weights{engine.weight_reads.counting_note()}; "
        f"prompt {stats.prefill_tokens} tokens; start-up {load_seconds:.1f} s; "
        f"{engine.describe()}",
        err=True,
    )
    if engine.config.speculative_config is not None:
        click.echo(f"[graphrt] {stats.spec.describe()}", err=True)


def read_prompts(path: Path) -> list[str | list[int]]:
    """Plain lines are prompts; a line that is a JSON object takes its "prompt" (text or token ids)."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                value = json.loads(line)["prompt"]
            except json.JSONDecodeError as exc:
                raise GraphrtError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); a line starting with {{ must be a JSON object") from None
            except (KeyError, TypeError):
                raise GraphrtError(f"{path}:{number}: a JSON line needs a \"prompt\" field (text or token ids)") from None
            is_ids = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
            if not (isinstance(value, str) or is_ids):
                raise GraphrtError(f"{path}:{number}: \"prompt\" must be text or a non-empty list of token ids, got {json.dumps(value)}")
            prompts.append(value)
        else:
            prompts.append(line)
    if not prompts:
        raise GraphrtError(f"{path} holds no prompts")
    return prompts


@main.command()
@model_options
@click.option("--requests", "--num-prompts", "num_requests", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests submitted at once, so TTFT counts the wait behind the others' prefills (--num-prompts: vLLM's bench name).")
@click.option("--input-len", default="16,256", show_default=True, help="Prompt length, N or MIN,MAX (uniform).")
@click.option("--output-len", default="16,128", show_default=True, help="Output length, N or MIN,MAX (uniform).")
@click.option("--shared-prefix", type=click.IntRange(min=0), default=0, show_default=True, help="Tokens every prompt starts with (a shared system prompt), before its own --input-len tokens.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--compare-hf", is_flag=True, help="Also run transformers' generate on the same requests (static batches of --max-batch).")
@click.option("--cache", type=click.Path(path_type=Path), default=None, help="Graph cache folder written by `graphrt capture`.")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the results to this JSON file (vLLM's bench throughput keys, then graphrt's).")
def bench(num_requests, input_len, output_len, shared_prefix, seed, compare_hf, cache, output_json, **model_args) -> None:
    """Throughput, TTFT and TPOT of an offline workload; optionally against transformers."""
    from graphrt.llm import LLM
    from graphrt.tools.bench import make_workload, run_graphrt, run_transformers, summarize

    input_range, output_range = parse_range(input_len, "--input-len"), parse_range(output_len, "--output-len")
    if output_json is not None and not output_json.parent.is_dir():
        raise click.BadParameter(f"{output_json.parent} is no folder to write {output_json.name} into", param_hint="--output-json")
    llm = LLM(cache=cache, **engine_kwargs(**model_args))
    engine = llm.engine
    try:
        longest = shared_prefix + input_range[1] + output_range[1]
        if longest > engine.max_model_len:
            raise GraphrtError(
                f"the longest request, --shared-prefix {shared_prefix} + --input-len {input_range[1]} + --output-len "
                f"{output_range[1]} = {longest} tokens, does not fit the context of {engine.max_model_len}; shorten them"
            )
        workload = make_workload(num_requests, input_range, output_range, engine.model_config.vocab_size, seed, shared_prefix)
        click.echo(f"[graphrt] running {num_requests} request{'s' if num_requests != 1 else ''}: {engine.describe()}", err=True)
        ours = run_graphrt(llm, workload)
        model_dir, dtype, batch = engine.model_dir, engine.dtype, engine.plan.max_batch
    finally:
        engine.close()  # its stage threads stopped before this process exits, interrupted or not
    del llm, engine
    theirs = run_transformers(model_dir, workload, batch, dtype) if compare_hf else None
    click.echo(summarize(ours, theirs))
    if output_json is not None:
        results = {"model_id": str(model_dir), **ours.to_json(), "transformers": theirs.to_json() if theirs else None}  # model_id first, as vLLM's
        output_json.write_text(json.dumps(results, indent=2) + "\n")


def parse_range(text: str, flag: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise click.BadParameter(f"expected N or MIN,MAX with 1 <= MIN <= MAX, got {text!r}", param_hint=flag)
    return parts[0], parts[1]


@main.command()
@model_options
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Graph cache folder to write.")
@click.option("--inspect", "inspect_dir", type=click.Path(path_type=Path), default=None, help="Print the manifest of this graph cache and exit.")
def capture(out, inspect_dir, **model_args) -> None:
    """Record a decode graph for every stage and bucket, verify each, and write the graph cache."""
    from graphrt.capture.manifest import read_manifest, write_manifest
    from graphrt.capture.report import manifest_table

    if inspect_dir is not None:
        if out is not None:
            raise click.UsageError("give --out DIR to capture or --inspect DIR to read a cache, not both")
        click.echo(manifest_table(read_manifest(inspect_dir)))
        return
    if out is None:
        raise click.UsageError("give --out DIR for the graph cache (or --inspect DIR to read one)")
    if (model_args["ep"] or 1) > 1:
        raise click.UsageError("a graph cache with --ep is not supported yet: its expert ranks would capture none of their own; "
                               "run --ep without a cache")
    from graphrt.llm import LLM

    check_writable(out)
    os.environ.setdefault("TRITON_CACHE_DIR", str(out / "triton"))
    start = time.perf_counter()
    llm = LLM(show_progress=True, **engine_kwargs(**model_args))
    manifest = build_manifest(llm.engine)
    path = write_manifest(out, manifest)
    click.echo(manifest_table(manifest))
    click.echo(f"wrote {path} in {time.perf_counter() - start:.1f} s; use it with --cache {out}")


def check_writable(folder: Path) -> None:
    """Fail before minutes of capture, not after, if the cache can't be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise GraphrtError(f"cannot write the graph cache to {folder} ({exc.strerror}); choose a writable --out folder") from None


def build_manifest(engine) -> dict:
    from graphrt import __version__
    from graphrt.capture.manifest import new_manifest

    cpu_only = engine.backend != "cuda"
    null_reasons = {}
    if cpu_only:
        null_reasons = {
            "pool_bytes": "no CUDA graphs on this backend (CPU or --no-graphs)",
            "nodes": "no CUDA graphs on this backend (CPU or --no-graphs)",
            "cuda": "torch has no CUDA here" if engine.identity()["cuda"] is None else None,
            "driver": "no CUDA driver here" if engine.identity()["driver"] is None else None,
        }
        null_reasons = {k: v for k, v in null_reasons.items() if v}
    extra = {
        "graphrt": __version__,
        "model_dir": str(engine.model_dir.resolve()),  # `--cache` alone runs it
        "kv_cache_blocks": engine.allocator.num_blocks,
        "kv_cache_bytes": sum(c.nbytes for c in engine.pipeline.caches),
        "null_reasons": null_reasons,
        "matmuls": [plan.to_json() for plan in engine.pipeline.matmul_plans()],  # a start with --cache reuses them
    }
    if engine.cpu_kernels_record() is not None:
        extra["cpu_kernels"] = engine.cpu_kernels_record()  # and these
    return new_manifest(engine.identity(), extra, [r.to_json() for r in engine.graph_records])


@main.command("import-gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
def import_gguf_command(gguf_file: Path, out_dir: Path) -> None:
    """Convert a Llama-family GGUF file into a Hugging Face style folder (float32 safetensors)."""
    from graphrt.model.default_model import import_gguf

    start = time.perf_counter()
    import_gguf(gguf_file, out_dir)
    click.echo(f"wrote {out_dir} in {time.perf_counter() - start:.1f} s")


@main.command("dequantize-fp8")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
def dequantize_fp8_command(src: Path, out_dir: Path) -> None:
    """Write a block-FP8 model folder (DeepSeek-V3, Kimi K2) as a bfloat16 one graphrt reads."""
    from graphrt.model.fp8 import dequantize_fp8

    start = time.perf_counter()
    dequantize_fp8(src, out_dir, echo=lambda line: click.echo(line, err=True))
    click.echo(f"wrote {out_dir} in {time.perf_counter() - start:.1f} s; run it with --model {out_dir}")


@main.command()
@model_options
@click.option("--cache", type=click.Path(path_type=Path), default=None, help="Graph cache folder written by `graphrt capture`.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True, help="Requests decoded at once; more wait in the queue.")
@click.option("--max-model-len", type=click.IntRange(min=2), default=None, help="Context length [default: the model's].")
@click.option("--prefill-chunk-size", type=click.IntRange(min=1), default=SERVE_PREFILL_CHUNK_SIZE, show_default=True,
              help="Tokens per prefill micro-batch, the decode rows riding along included: smaller answers new "
                   "requests sooner, larger gives more throughput (graphrt.LLM's default is 512).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True, help="0 picks a free port.")
@click.option("--api-key", default=None, help="Require this bearer token [default: GRAPHRT_API_KEY, if set]. Other users can read it in the process list: prefer --api-key-file.")
@click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Require the bearer token this file holds (a trailing newline is ignored).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True, help="Larger request bodies get a 413 (at once when Content-Length says so).")
@click.option("--max-connections", type=click.IntRange(min=1), default=None, help="Open connections at most; a request on one more gets a 503 and is closed [default: 512].")
@click.option("--timeout-header", type=FiniteFloat(min=0, min_open=True), default=None, help="Seconds a client has to send a whole request head, from connecting or from the previous response [default: 10].")
@click.option("--timeout-body", type=FiniteFloat(min=0, min_open=True), default=None, help="Seconds a client has to send a request body, from the end of its head [default: 30].")
@click.option("--timeout-keep-alive", type=FiniteFloat(min=0, min_open=True), default=None, help="Seconds an idle keep-alive connection stays open [default: 5].")
@click.option("--no-engine-process", is_flag=True, help="Step the engine on a thread of the server's process instead of in a process of its own.")
@click.option("--cpu-placement", type=click.Choice(CPU_PLACEMENTS), default="auto", show_default=True,
              help="pin: the server's front on the first usable core, the engine process and its threads on the rest; "
                   f"float: both over every core; auto: pin with {MIN_CORES_TO_PIN} usable cores or more, else float.")
@click.option("--tool-call-parser", type=click.Choice(TOOL_CALL_PARSERS), default=None,
              help="How tool calls are read from the model's output with tool_choice auto: hermes (<tool_call>{...}</tool_call>), "
                   "llama3_json (<|python_tag|>{...}; {...}) or mistral ([TOOL_CALLS][{...}]) [default: the one the chat template "
                   "writes, else hermes].")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="The name clients pass as model (repeat the flag for more; responses carry the first) [default: the model folder's name].")
@click.option("--generation-config", default="auto", show_default=True,
              help="Sampling defaults for what a request leaves out: auto, the model folder's generation_config.json "
                   "(temperature, top_p, top_k, min_p, repetition_penalty), as vLLM; vllm, the API's; or a folder holding one.")
@click.option("--chat-template", default=None, help="A Jinja file, or the template itself, to render chat conversations with instead of the model's own.")
@click.option("--enable-auto-tool-choice", is_flag=True, help="Accepted as in vLLM's command lines; tool_choice auto is always on here.")
@click.option("--disable-log-requests", is_flag=True, help="Log no line for a refused request (graphrt logs only those; vLLM's flag).")
@no_op_flags
@click.argument("model_folder", required=False, type=click.Path(path_type=Path), metavar="[MODEL]")
def serve(
    cache, max_num_seqs, max_model_len, prefill_chunk_size, host, port, api_key, api_key_file, max_body_bytes,
    max_connections, timeout_header, timeout_body, timeout_keep_alive, no_engine_process, cpu_placement, tool_call_parser,
    served_model_names, generation_config, chat_template, enable_auto_tool_choice, disable_log_requests, no_ops, model_folder,
    **model_args,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) until Ctrl+C or SIGTERM.
    MODEL (as in `vllm serve MODEL`) is the same as --model.

    Chat completions take tools (tool_choice auto, required or a named function) and, like
    completions, response_format and structured_outputs (a JSON schema, a regex, a choice, a grammar)."""
    del enable_auto_tool_choice, no_ops  # vLLM's and SGLang's flags for what graphrt always does (tool_choice auto included)
    # Ctrl+C or SIGTERM while the server stack imports stops it as cleanly as later: one line, exit 0.
    try:
        with stop_requests_noted():  # acted on once the server stack has imported whole
            if model_folder is not None:
                if served_model_names and not model_folder.is_dir() and str(model_folder) != DEFAULT_MODEL_HUB_ID:  # vLLM's `--served-model-name a b`
                    raise click.UsageError(
                        f"{model_folder} is no model folder; for several served model names repeat the flag: "
                        f"--served-model-name {served_model_names[-1]} --served-model-name {model_folder}"
                    )
                if model_args["model"] is not None and model_args["model"] != model_folder:
                    raise click.UsageError(f"the model is named twice, {model_folder} and --model {model_args['model']}: give one")
                model_args["model"] = model_folder
            if cache is not None:
                from graphrt.engine.startup import model_for

                model_args["model"] = model_for(model_args["model"], cache)
            if str(model_args["model"]) == DEFAULT_MODEL_HUB_ID and not served_model_names:
                served_model_names = (DEFAULT_MODEL_HUB_ID, DEFAULT_MODEL_HUB_ID.split("/")[-1])  # clients pass what vLLM serves it as
            from graphrt.server import ServeOptions
            from graphrt.server import serve as run_server
            from graphrt.server.connections import ConnectionLimits
            from graphrt.server.runner import api_key_from

            limits = dict(max_connections=max_connections, header_timeout_s=timeout_header, body_timeout_s=timeout_body, keep_alive_s=timeout_keep_alive)
            llm_kwargs = dict(engine_kwargs(**model_args), cache=cache, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              prefill_chunk_size=prefill_chunk_size)
            options = ServeOptions(
                host=host,
                port=port,
                api_key=api_key_from(api_key, api_key_file, os.environ.get("GRAPHRT_API_KEY")),
                max_body_bytes=max_body_bytes,
                limits=ConnectionLimits(**{name: value for name, value in limits.items() if value is not None}),
                llm_kwargs=llm_kwargs,
                engine_process=not no_engine_process,
                cpu_placement=cpu_placement,
                tool_call_parser=tool_call_parser,
                served_model_names=served_model_names,
                generation_config=generation_config,
                chat_template=chat_template,
                log_refused=not disable_log_requests,
            )
    except StartUpStopped:
        click.echo("[graphrt] stopped during start-up")
        return
    run_server(options, echo=click.echo)  # it takes the signals over for the engine's start-up and the serving


@main.command()
@model_options
@click.option("--synthetic", "synthetic_ms", type=FiniteFloat(min=0), default=None, help="Profile the ring itself: a tiny random Llama, one layer per stage, each stage taking MS ms.")
@click.option("--sweep-depth", default=None, help="Comma-separated ring depths to compare, e.g. 0,1,2 (instead of --depth).")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--input-len", default="8,32", show_default=True, help="Prompt length, N or MIN,MAX (uniform).")
@click.option("--output-len", default="32", show_default=True, help="Output length, N or MIN,MAX (uniform).")
@click.option("--host-ms", type=FiniteFloat(min=0), default=0.0, show_default=True, help="Extra host time per micro-batch read back (stands in for a slow host).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for trace.json, report.md and the PNGs.")
def profile(synthetic_ms, sweep_depth, num_requests, input_len, output_len, host_ms, out, **model_args) -> None:
    """Run a workload with the timeline on; write a Perfetto trace, a utilization report and PNG timelines."""
    from graphrt.tools.profile import ProfileOptions, run_profile

    if synthetic_ms is not None and model_args["model"] is not None:
        raise click.UsageError("give --model DIR or --synthetic MS, not both")
    if sweep_depth is not None and model_args["depth"] is not None:
        raise click.UsageError("give --depth D or --sweep-depth D0,D1,..., not both")
    if sweep_depth is not None:
        depths = parse_depths(sweep_depth)
    elif model_args["depth"] is not None:
        depths = [model_args["depth"]]
    else:
        from graphrt.config import EngineConfig

        config = EngineConfig(pp=model_args["pp"] or 1, ep=model_args["ep"] or 1, devices=parse_devices(model_args["devices"]))
        depths = [config.default_depth()]
    kwargs = engine_kwargs(**model_args)
    kwargs.pop("depth")
    options = ProfileOptions(
        engine_kwargs=kwargs, depths=depths, sweep=sweep_depth is not None, out=out, num_requests=num_requests,
        input_range=parse_range(input_len, "--input-len"), output_range=parse_range(output_len, "--output-len"),
        synthetic_ms=synthetic_ms, host_ms=host_ms, command="graphrt " + " ".join(sys.argv[1:]),
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GraphrtError(f"cannot write the profile to {out} ({exc.strerror}); choose a writable --out folder") from None
    run_profile(options, echo=click.echo)


def parse_depths(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 0:
        raise click.BadParameter(f"expected comma-separated depths >= 0 such as 0,1,2, got {text!r}", param_hint="--sweep-depth")
    return sorted(set(depths))


@main.command()
@click.option("--no-cpu", is_flag=True, help="Skip timing the CPU matmul paths and kernels (seconds, and a build of the CPU kernels on first use).")
def doctor(no_cpu) -> None:
    """Versions, GPUs and their memory, peer-to-peer access and links between GPUs, whether nsys is installed, then the CPU."""
    from graphrt.tools.doctor import run_doctor

    sys.exit(run_doctor(echo=click.echo, measure_cpu=not no_cpu))

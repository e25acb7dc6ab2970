"""The `graphrt` command: one click command per verb."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from graphrt.errors import GraphrtError


class Group(click.Group):
    """Prints graphrt's own errors as one line (what happened, what to do) and exits 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (GraphrtError, ValueError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=Group)
@click.version_option(package_name="graphrt")
def main() -> None:
    """graphrt: pipeline-parallel LLM serving on CUDA graphs."""


def parse_devices(value: str | None) -> list[str] | None:
    return [d.strip() for d in value.split(",")] if value else None


@main.command()
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn with the model's chat template.")
@click.option("--model", type=click.Path(path_type=Path), default=None, help="Hugging Face style model folder [default: SmolLM2-135M-Instruct].")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages.")
@click.option("--devices", default=None, help="Comma-separated device per stage, e.g. cuda:0,cuda:1 [default: from the machine].")
@click.option("--dtype", default="auto", show_default=True, help="float32, bfloat16, float16 or float64; auto: float32 on CPU, the model's dtype on CUDA.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables it.")
@click.option("--seed", type=int, default=None, help="Seed for this request's sampling.")
def generate(prompt, chat, model, pp, devices, dtype, max_tokens, temperature, top_p, top_k, seed) -> None:
    """Generate a completion for one prompt and report tokens/s and weight bandwidth."""
    from graphrt.llm import LLM
    from graphrt.sampling import SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model, pp=pp, devices=parse_devices(devices), dtype=dtype)
    load_seconds = time.perf_counter() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    request = llm.chat_prompt(prompt) if chat else prompt
    start = time.perf_counter()
    output = llm.generate(request, params)[0]
    seconds = time.perf_counter() - start
    click.echo(output.text)
    engine = llm.engine
    stats = engine.stats
    click.echo(
        f"[graphrt] {len(output.token_ids)} tokens in {seconds:.2f} s ({len(output.token_ids) / seconds:.1f} tok/s); "
        f"decode {stats.decode_tokens_per_s():.1f} tok/s, {stats.weight_gb_per_s(engine.weight_bytes):.1f} GB/s of weights; "
        f"prompt {stats.prefill_tokens} tokens; load {load_seconds:.1f} s; "
        f"pp={pp} on {','.join(map(str, engine.devices))}, {str(engine.dtype).removeprefix('torch.')}",
        err=True,
    )


@main.command("import-gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
def import_gguf_command(gguf_file: Path, out_dir: Path) -> None:
    """Convert a Llama-family GGUF file into a Hugging Face style folder (float32 safetensors)."""
    from graphrt.default_model import import_gguf

    start = time.perf_counter()
    import_gguf(gguf_file, out_dir)
    click.echo(f"wrote {out_dir} in {time.perf_counter() - start:.1f} s")

"""vLLM's and SGLang's command lines, read by graphrt's commands: their names for graphrt's flags,
the flags for what graphrt always does (accepted, changing nothing), and the flags graphrt has no
equivalent of, refused saying what to do instead rather than with click's nearest spelling (which
sent --enforce-eager to --allow-eager, -tp to -t, --disable-radix-cache to --enable-prefix-caching).
"""

from __future__ import annotations

import click

NO_TENSOR_PARALLELISM = "graphrt has no tensor parallelism; split the model over GPUs with --pp N (and a mixture of experts' experts with --ep N)"
ONE_REPLICA = "a server is one replica: start one per replica, each on its own GPUs, behind a load balancer"
EXPERT_PARALLEL = "split a mixture of experts' experts over ranks with --ep N (each pipeline stage as N processes, docs/distributed.md)"
SPECULATIVE_CONFIG = """pass --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' or '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}' (docs/speculative.md)"""
# (flags, whose, what to do instead)
_REFUSED = [
    (("--tensor-parallel-size", "-tp"), "vLLM's", NO_TENSOR_PARALLELISM),
    (("--tp-size", "--tp"), "SGLang's", NO_TENSOR_PARALLELISM),
    (("--gpu-memory-utilization",), "vLLM's", "graphrt sizes the KV cache itself: 85% of the GPU memory left free once graphs and activations are measured"),
    (("--mem-fraction-static",), "SGLang's", "graphrt sizes the KV cache itself: 85% of the GPU memory left free once graphs and activations are measured"),
    (("--kv-cache-dtype",), "vLLM's and SGLang's", "the KV cache is kept in the model's --dtype"),
    (("--block-size",), "vLLM's", "KV blocks are 16 tokens here (the Python API's block_size sets it)"),
    (("--page-size",), "SGLang's", "KV blocks are 16 tokens here (the Python API's block_size sets it)"),
    (("--max-num-batched-tokens",), "vLLM's", "a step's prompt tokens are set with --prefill-chunk-size"),
    (("--quantization",), "vLLM's and SGLang's", "graphrt serves unquantized weights (graphrt import-gguf de-quantizes a GGUF file)"),
    (("--tokenizer",), "vLLM's", "the tokenizer is read from the model folder"),
    (("--tokenizer-path",), "SGLang's", "the tokenizer is read from the model folder"),
    (("--revision",), "vLLM's and SGLang's", "graphrt reads local folders: download that revision first and pass its folder"),
    (("--swap-space",), "vLLM's", "a preempted request is recomputed, not swapped"),
    (("--dp-size", "--dp"), "SGLang's", ONE_REPLICA),
    (("--data-parallel-size", "-dp"), "vLLM's", ONE_REPLICA),
    (("--enable-expert-parallel",), "vLLM's", EXPERT_PARALLEL),
    (("--enable-ep-moe",), "SGLang's", EXPERT_PARALLEL),
    (("--enable-eplb",), "vLLM's", "graphrt places experts by index and does not move them; /metrics shows each expert's load "
                                    "(graphrt_moe_expert_tokens_total, graphrt_moe_expert_load_imbalance)"),
    (("--moe-a2a-backend",), "SGLang's", "the ranks of a stage combine their experts' shares with one all-reduce per sparse layer (docs/distributed.md)"),
    (("--log-level",), "SGLang's", "set GRAPHRT_LOGGING_LEVEL=debug, info, warning or error"),
    (("--speculative-algorithm", "--speculative-num-draft-tokens", "--speculative-draft-model-path", "--speculative-num-steps"),
     "SGLang's", SPECULATIVE_CONFIG),
    (("--enable-torch-compile",), "SGLang's", "decode replays CUDA graphs of graphrt's own kernels, with no torch.compile"),
    (("--attention-backend",), "SGLang's", "the decode kernels are chosen with --kernels auto|torch|triton"),
    (("--random-seed",), "SGLang's", "a request's `seed` field seeds its sampling"),
    (("--nnodes",), "SGLang's", "graphrt's stages span hosts under torchrun (docs/distributed.md)"),
]
REFUSED_FLAGS = {flag: (whose, instead) for flags, whose, instead in _REFUSED for flag in flags}
# Flags that ask for no tensor parallelism, where a value of 1 changes nothing: accepted with it.
TENSOR_PARALLEL_FLAGS = frozenset(flag for flag, (_, instead) in REFUSED_FLAGS.items() if instead == NO_TENSOR_PARALLELISM)
# SGLang's names for graphrt's flags, read as them by every command that has the flag.
SGLANG_NAMES = {
    "--model-path": "--model",
    "--pp-size": "--pp",
    "--ep-size": "--ep",
    "--context-length": "--max-model-len",
    "--max-running-requests": "--max-num-seqs",
    "--chunked-prefill-size": "--prefill-chunk-size",
    "--cuda-graph-max-bs": "--max-batch",
    "--disable-cuda-graph": "--no-graphs",
    "--disable-radix-cache": "--no-prefix-caching",
    "--disable-overlap-schedule": "--no-async-scheduling",
}
# vLLM's and SGLang's flags for what graphrt always does: `serve` accepts them, and they change nothing.
NO_OP_FLAGS = {
    "--trust-remote-code": "graphrt runs no code from the model folder",
    "--enable-prefix-caching": "prefix caching is on unless --no-prefix-caching",
    "--enable-chunked-prefill": "prompts are always prefilled in chunks of --prefill-chunk-size",
    "--enable-metrics": "/metrics is always served",
}


class Command(click.Command):
    """Reads vLLM's and SGLang's command lines: their names for graphrt's flags (SGLANG_NAMES), no
    tensor parallelism asked as a size of 1, and a flag graphrt lacks refused saying what to do
    instead (REFUSED_FLAGS)."""

    def parse_args(self, ctx, args):
        own = {name for param in self.params for name in (*param.opts, *param.secondary_opts)}
        # graphrt's options that take a value: the token after one is that value, never a flag.
        takes_value = {name for param in self.params if isinstance(param, click.Option) and not param.is_flag for name in param.opts}
        read = []
        index = 0
        while index < len(args):
            arg = args[index]
            if arg == "--":  # the rest are arguments, as given
                read += args[index:]
                break
            if arg in takes_value:
                read += args[index : index + 2]
                index += 2
                continue
            flag, equals, value = arg.partition("=")
            if flag in TENSOR_PARALLEL_FLAGS:
                value = value if equals else (args[index + 1] if index + 1 < len(args) else "")
                if value.strip() == "1":
                    index += 1 if equals else 2
                    continue
            if flag in REFUSED_FLAGS:
                whose, instead = REFUSED_FLAGS[flag]
                raise click.UsageError(f"{flag} is {whose}: {instead}", ctx)
            if SGLANG_NAMES.get(flag) in own:
                arg = SGLANG_NAMES[flag] + equals + value
            read.append(arg)
            index += 1
        return super().parse_args(ctx, read)


def no_op_flags(command):
    """NO_OP_FLAGS as hidden flags, gathered in one argument (`no_ops`) the command ignores."""
    for flag, why in NO_OP_FLAGS.items():
        command = click.option(flag, "no_ops", flag_value=flag, multiple=True, hidden=True, help=f"Accepted as in vLLM and SGLang: {why}.")(command)
    return command

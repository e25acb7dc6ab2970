"""The generate and bench commands on a tiny model: prompts files, JSONL out, bench numbers."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from graphrt import LLM, SamplingParams, cli, cli_flags
from graphrt.cli import main
from graphrt.kernels import KERNEL_CHOICES


def test_prompts_file_plain_and_jsonl(tiny_model_factory, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7]}\n\n{"prompt": [9, 9]}\n')
    result = CliRunner().invoke(
        main, ["generate", "--prompts-file", str(prompts), "--model", str(tiny_model_factory()), "--max-tokens", "5", "--pp", "2", "--dtype", "float32"]
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [line["prompt"] for line in lines] == [[5, 6, 7], [9, 9]]
    assert all(line["num_tokens"] <= 5 for line in lines)
    llm = LLM(model=tiny_model_factory(), pp=2, dtype="float32", load_tokenizer=False)  # no tokenizer: the ids are the answer
    greedy = SamplingParams(max_tokens=5, temperature=0)
    assert [line["token_ids"] for line in lines] == [out.token_ids for out in llm.generate([[5, 6, 7], [9, 9]], greedy)]


def test_prompts_file_with_a_line_that_is_not_json(tiny_model_factory, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('hello\n{"prompt": [1,2,\n')
    result = CliRunner().invoke(main, ["generate", "--prompts-file", str(prompts), "--model", str(tiny_model_factory())])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {prompts}:2: not valid JSON (Expecting value at column ")
    assert result.output.endswith("); a line starting with { must be a JSON object\n")


def test_prompts_file_with_a_bad_line(tiny_model_factory, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "no prompt field"}\n')
    result = CliRunner().invoke(main, ["generate", "--prompts-file", str(prompts), "--model", str(tiny_model_factory())])
    assert result.exit_code == 1 and 'prompts.jsonl:1: a JSON line needs a "prompt" field' in result.output


def test_prompt_and_prompts_file_are_exclusive(tiny_model_factory):
    result = CliRunner().invoke(main, ["generate", "--model", str(tiny_model_factory())])
    assert result.exit_code == 2 and "exactly one of --prompt TEXT and --prompts-file FILE" in result.output


def test_bench_reports_throughput_and_latency(tiny_model_factory, tmp_path):
    result = CliRunner().invoke(
        main,
        ["bench", "--model", str(tiny_model_factory()), "--requests", "12", "--input-len", "4,20", "--output-len", "3,9", "--pp", "2", "--depth", "1",
         "--dtype", "float32", "--output-json", str(tmp_path / "bench.json")],
    )
    assert result.exit_code == 0, result.output
    assert "graphrt pp=2 depth=1 float32:" in result.output
    # Every request produces exactly its output length (EOS ignored): the seeded workload's total.
    from graphrt.tools.bench import make_workload

    workload = make_workload(12, (4, 20), (3, 9), 97, 0)
    expected, prompt = sum(r.output_len for r in workload), sum(len(r.prompt) for r in workload)
    assert f"{expected} output tokens from 12 requests ({prompt} prompt tokens)" in result.output
    assert "TTFT mean" in result.output and "TPOT mean" in result.output
    assert re.search(r"  Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s", result.output)  # vLLM's line
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert next(iter(saved)) == "model_id" and saved["model_id"] == str(tiny_model_factory())
    assert (saved["num_requests"], saved["total_num_tokens"], saved["output_tokens"]) == (12, prompt + expected, expected)
    assert saved["tokens_per_second"] == pytest.approx((prompt + expected) / saved["elapsed_time"])
    assert set(saved["tpot_ms"]) == {"mean", "p50", "p90", "p99"} and saved["transformers"] is None


def test_bench_percentiles_interpolate_as_numpys_do():
    """vLLM's and SGLang's benchmarks use numpy's percentile: the nearest rank read p90 = p99 = the
    largest at a dozen requests, so tables side by side disagreed."""
    from graphrt.tools.bench import percentiles

    assert percentiles([4.0, 1.0, 3.0, 2.0]) == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert percentiles([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0} and percentiles([]) is None


def test_bench_with_one_output_token_has_no_tpot(tiny_model_factory):
    result = CliRunner().invoke(main, ["bench", "--model", str(tiny_model_factory()), "--requests", "1", "--input-len", "4", "--output-len", "1"])
    assert result.exit_code == 0 and "1 output token from 1 request (4 prompt tokens)" in result.output
    assert "TPOT - (every request made one token)" in result.output, result.output


def test_bench_rejects_a_bad_range(tiny_model_factory):
    result = CliRunner().invoke(main, ["bench", "--model", str(tiny_model_factory()), "--output-len", "9,3"])
    assert result.exit_code == 2 and "expected N or MIN,MAX" in result.output
    # The tiny model's context is 256 tokens: the flags that overflow it are named.
    result = CliRunner().invoke(main, ["bench", "--model", str(tiny_model_factory()), "--input-len", "100,200", "--shared-prefix", "40", "--output-len", "20"])
    assert result.exit_code == 1 and result.output == (
        "error: the longest request, --shared-prefix 40 + --input-len 200 + --output-len 20 = 260 tokens, "
        "does not fit the context of 256; shorten them\n"
    )


def test_the_cli_loads_without_torch_and_offers_the_kernels_there_are():
    # `graphrt --help` answers without importing torch (seconds); the commands import what they use.
    code = "import sys, graphrt, graphrt.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    assert cli.KERNEL_CHOICES == KERNEL_CHOICES


def test_serve_offers_the_tool_call_parsers_there_are():
    pytest.importorskip("fastapi")  # graphrt.server imports the server stack: not on every GPU image
    from graphrt.server.tool_parsers import TOOL_CALL_PARSERS

    assert cli.TOOL_CALL_PARSERS == TOOL_CALL_PARSERS
    result = CliRunner().invoke(main, ["serve", "--tool-call-parser", "pythonic"])
    assert result.exit_code == 2 and "'pythonic' is not one of 'hermes', 'llama3_json', 'mistral'" in result.output


@pytest.mark.parametrize("args, message", [
    (["serve", "-tp", "2"], "-tp is vLLM's: graphrt has no tensor parallelism; split the model over GPUs with --pp N"),
    (["serve", "--tensor-parallel-size=2"], "--tensor-parallel-size is vLLM's: graphrt has no tensor parallelism"),
    (["generate", "--prompt", "x", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype is vLLM's and SGLang's: the KV cache is kept in the model's --dtype"),
    (["bench", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization is vLLM's: graphrt sizes the KV cache itself"),
    (["serve", "--tp-size", "2"], "--tp-size is SGLang's: graphrt has no tensor parallelism"),
    (["serve", "--tp=4"], "--tp is SGLang's: graphrt has no tensor parallelism"),
    (["serve", "--mem-fraction-static", "0.8"], "--mem-fraction-static is SGLang's: graphrt sizes the KV cache itself"),
    (["serve", "--log-level", "info"], "--log-level is SGLang's: set GRAPHRT_LOGGING_LEVEL=debug, info, warning or error"),
    (["serve", "--speculative-algorithm", "NGRAM"], "--speculative-algorithm is SGLang's: pass --speculative-config '{\"method\": \"ngram\""),
    # a MoE user's first flags (a new-user trial): click had offered --enable-chunked-prefill for the first
    (["serve", "--enable-expert-parallel"], "--enable-expert-parallel is vLLM's: split a mixture of experts' experts over ranks with --ep N"),
    (["serve", "--enable-ep-moe"], "--enable-ep-moe is SGLang's: split a mixture of experts' experts over ranks with --ep N"),
    (["serve", "--enable-eplb"], "--enable-eplb is vLLM's: graphrt places experts by index and does not move them"),
    (["serve", "--moe-a2a-backend", "deepep"], "--moe-a2a-backend is SGLang's: the ranks of a stage combine their experts' shares"),
    (["serve", "-dp", "2"], "-dp is vLLM's: a server is one replica"),
])
def test_a_vllm_or_sglang_flag_graphrt_lacks_says_what_to_do_instead(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("sglang, ours", sorted(cli_flags.SGLANG_NAMES.items()))
def test_sglang_names_for_graphrt_flags_are_read_as_them(sglang, ours):
    """Each parses to what graphrt's own name parses to, which is not the default."""
    serve = main.commands["serve"]
    param = next(p for p in serve.params if ours in (*p.opts, *p.secondary_opts))
    value = [] if param.is_flag else (["/some/model"] if param.name == "model" else ["3"])
    default = serve.make_context("serve", []).params[param.name]
    parsed = serve.make_context("serve", [sglang, *value]).params[param.name]
    assert parsed == serve.make_context("serve", [ours, *value]).params[param.name] != default


def test_no_tensor_parallelism_asked_as_a_size_of_one_is_accepted():
    args = ["-tp", "1", "--tensor-parallel-size=1", "--tp-size", "1", "--tp=1", "--port", "8001"]
    assert main.commands["serve"].make_context("serve", args).params["port"] == 8001


def test_vllm_flags_for_what_graphrt_does_anyway_are_accepted_and_its_names_are_aliases(tiny_model_factory):
    """--trust-remote-code and company change nothing (serve parses them, then refuses the bad port
    after them); --enforce-eager is --no-graphs and bench's --num-prompts is --requests."""
    result = CliRunner().invoke(main, ["serve", "--trust-remote-code", "--disable-log-requests", "--enable-prefix-caching",
                                       "--enable-chunked-prefill", "--port", "99999"])
    assert result.exit_code == 2 and "Invalid value for '--port'" in result.output, result.output
    model = str(tiny_model_factory())
    eager = CliRunner().invoke(main, ["generate", "--prompts-file", "/dev/null", "--model", model, "--enforce-eager"])
    assert "no such option" not in eager.output.lower() and "holds no prompts" in eager.output
    bench = CliRunner().invoke(main, ["bench", "--model", model, "--num-prompts", "3", "--input-len", "4", "--output-len", "2"])
    assert bench.exit_code == 0 and "6 output tokens from 3 requests" in bench.output, bench.output


def test_import_gguf_names_what_is_wrong_with_its_arguments(tmp_path):
    """One line each, no traceback, and nothing left in the output's folder."""
    from graphrt.model.default_model import default_gguf_path

    stub = tmp_path / "stub.gguf"
    stub.write_bytes(b"GGUF")  # the magic and nothing after it
    cut = tmp_path / "cut.gguf"
    with open(default_gguf_path(), "rb") as whole:
        cut.write_bytes(whole.read(2 << 20))  # the real model, cut short
    (tmp_path / "a-file").write_text("")
    cases = [
        ([str(tmp_path), str(tmp_path / "out")], f"error: {tmp_path} is a folder; give the path of the .gguf file in it"),
        ([str(stub), str(tmp_path / "a-file")], f"error: {tmp_path / 'a-file'} is a file; give a folder to write the model into"),
        ([str(stub), str(tmp_path / "out")], "the file may be cut short or corrupt (download it again)"),
        ([str(cut), str(tmp_path / "out")], "the file may be cut short or corrupt (download it again)"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main, ["import-gguf", *args])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "cut.gguf", "stub.gguf"]


def test_serve_on_an_address_that_is_none_says_so_and_nothing_else():
    """The open-access warning waits for the address to be bound: here it never is."""
    pytest.importorskip("fastapi")
    result = CliRunner().invoke(main, ["serve", "--host", "no.such.host.invalid", "--port", "0"])
    assert result.exit_code == 1
    assert result.output.startswith("error: cannot listen on no.such.host.invalid:0 (") and result.output.count("\n") == 1, result.output


def test_ctrl_c_during_bench_stops_it_cleanly(default_model):
    """It used to end in a C++ abort (terminate called without an active exception, SIGABRT): the
    interpreter exited with stage work still running. The signal comes once the run has begun."""
    import signal
    import time

    args = [sys.executable, "-m", "graphrt", "bench", "--model", str(default_model), "--dtype", "float32",
            "--requests", "8", "--input-len", "16", "--output-len", "400"]  # about 30 s of decoding here
    bench = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in bench.stderr:  # start-up's lines, then the run's
        seen.append(line)
        if line.startswith("[graphrt] running 8 requests"):
            break
    time.sleep(2)  # into the run
    bench.send_signal(signal.SIGINT)
    stdout, stderr = bench.communicate(timeout=120)
    output = "".join(seen) + stdout + stderr
    assert bench.returncode == 130 and output.strip().endswith("Aborted!") and "terminate called" not in output, output
    assert "output tokens from" not in output  # it was stopped before it finished


@pytest.mark.parametrize("args, flag", [
    (["profile", "--host-ms", "inf", "--out", "x"], "--host-ms"),  # was an OverflowError traceback from time.sleep
    (["profile", "--synthetic", "nan", "--out", "x"], "--synthetic"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["serve", "--timeout-body", "inf"], "--timeout-body"),
])
def test_a_number_flag_that_is_not_finite_is_refused_naming_it(args, flag):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output and "is not a finite number" in result.output, result.output


def test_a_prompts_file_line_whose_prompt_is_no_prompt_says_so(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 5}\n')
    result = CliRunner().invoke(main, ["generate", "--prompts-file", str(prompts)])
    assert result.exit_code == 1
    assert f'{prompts}:2: "prompt" must be text or a non-empty list of token ids, got 5' in result.output


def test_capture_takes_out_or_inspect_not_both(tmp_path):
    result = CliRunner().invoke(main, ["capture", "--out", str(tmp_path / "a"), "--inspect", str(tmp_path / "b")])
    assert result.exit_code == 2 and "give --out DIR to capture or --inspect DIR to read a cache, not both" in result.output


def test_an_option_value_that_looks_like_a_flag_is_left_alone():
    """`--prompt -tp` asks about "-tp"; only flags are read as vLLM's or SGLang's."""
    generate = main.commands["generate"]
    assert generate.make_context("generate", ["--prompt", "-tp"]).params["prompt"] == "-tp"
    assert generate.make_context("generate", ["--prompt", "--model-path"]).params["prompt"] == "--model-path"
    serve = main.commands["serve"]
    assert serve.make_context("serve", ["--api-key", "--dp"]).params["api_key"] == "--dp"

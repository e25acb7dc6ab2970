"""A CPU stage's decode attention: the compiled kernel or the torch reference, chosen by timing both
(kernels/attention_choice.py), forced by GRAPHRT_ATTENTION, or the reference where the kernel can't
run; and an engine on the chosen one generates what the reference does."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.pipeline import Pipeline
from graphrt.kernels import attention_choice, paged_attention, paged_attention_cpu
from graphrt.kernels.attention_choice import AttentionChoice, choose_decode_attention, mode_from_env, time_paths

CPU = torch.device("cpu")
SHAPES = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32, device=CPU, rows=8)


class Clock:
    """A timer the test moves: each path's call takes the seconds it is given, in turn."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def path_taking(self, seconds: list[float], calls: list[str], name: str):
        durations = iter(seconds)

        def run(*_):
            calls.append(name)
            self.now += next(durations)

        return run


def test_paths_alternate_and_keep_their_median_call():
    clock, calls = Clock(), []
    # The warm-up call, then seven timed ones; two of the kernel's stalled by another process.
    paths = {
        "compiled": clock.path_taking([5.0, 1.0, 9.0, 1.0, 1.0, 9.0, 1.0, 1.0], calls, "compiled"),
        "torch": clock.path_taking([5.0] + [3.0] * 7, calls, "torch"),
    }
    assert time_paths(paths, (), clock) == {"compiled": 1.0, "torch": 3.0}
    assert calls == ["compiled", "torch"] * 8


@pytest.mark.parametrize("seconds, expected", [
    ({"compiled": 1.0, "torch": 3.0}, "compiled"),
    ({"compiled": 0.97, "torch": 1.0}, "torch"),  # within the margin: a tie keeps the reference
    ({"compiled": 2.0, "torch": 1.0}, "torch"),
])
def test_the_kernel_must_be_faster_by_the_margin(monkeypatch, seconds, expected):
    monkeypatch.setattr(paged_attention_cpu, "unavailable_reason", lambda *_: None)
    monkeypatch.setattr(attention_choice, "time_paths", lambda *_: seconds)
    choice = choose_decode_attention(**SHAPES)
    assert (choice.path, choice.source, choice.seconds, choice.rows) == (expected, "measured", seconds, 8)
    assert choice.summary().startswith(f"decode attention: {attention_choice.PATH_NAMES[expected]} (")


def test_where_the_kernel_cannot_run_the_reference_runs_and_the_banner_says_why(monkeypatch):
    monkeypatch.setattr(paged_attention_cpu, "unavailable_reason", lambda *_: "no C++ compiler: 'c++' is not on PATH")
    choice = choose_decode_attention(**SHAPES)
    assert (choice.path, choice.source) == ("torch", "only")
    assert choice.function is paged_attention.paged_decode_attention
    assert "no C++ compiler" in choice.summary()
    with pytest.raises(ValueError, match="GRAPHRT_ATTENTION=compiled.*no C\\+\\+ compiler"):
        choose_decode_attention(**SHAPES, mode="compiled")


def test_a_forced_mode_measures_nothing(monkeypatch):
    monkeypatch.setattr(attention_choice, "time_paths", lambda *_: pytest.fail("timed a forced choice"))
    assert choose_decode_attention(**SHAPES, mode="torch") == AttentionChoice("torch", "forced")
    with pytest.raises(ValueError, match="only a CPU stage"):
        choose_decode_attention(**{**SHAPES, "device": torch.device("cuda")})
    with pytest.raises(ValueError, match="GRAPHRT_ATTENTION must be one of auto, torch, compiled"):
        mode_from_env({"GRAPHRT_ATTENTION": "fast"})
    with pytest.raises(ValueError, match="must be one of auto, torch, compiled, got 'fast'"):
        choose_decode_attention(**SHAPES, mode="fast")


def test_an_engine_on_the_compiled_kernel_generates_what_the_reference_does(tiny_model_factory, monkeypatch):
    reason = paged_attention_cpu.unavailable_reason(torch.float64)
    if reason is not None:
        pytest.skip(f"CPU kernel unavailable: {reason}")
    prompts = [[5, 9, 14, 2, 7] * k for k in (1, 3, 9)]  # contexts of one to several blocks
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for mode in ("torch", "compiled"):
        monkeypatch.setenv("GRAPHRT_ATTENTION", mode)
        llm = LLM(model=tiny_model_factory(), pp=2, dtype="float64", kv_cache_tokens=1024, block_size=16, prefill_chunk_size=16)
        stage = llm.engine.pipeline.stages[1]
        assert stage.attention_choice.path == mode
        assert stage.layers[0].ops.paged_decode_attention is stage.attention_choice.function
        outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["compiled"] == outputs["torch"]


def test_a_cuda_stage_keeps_its_kernel_sets_decode_attention():
    class CudaStage:  # what Pipeline reads of a stage; a real one needs a GPU
        device, attention_choice = torch.device("cuda"), None
        ops = type("Ops", (), {"name": "triton"})()

        def use_decode_attention(self, choice):
            pytest.fail(f"a CUDA stage was given {choice}")

    pipeline = Pipeline([CudaStage()], [])
    pipeline.choose_decode_attention(max_rows=8, block_size=16, mode="auto")
    assert pipeline.attention_summary() == "decode attention: the triton kernels on cuda"

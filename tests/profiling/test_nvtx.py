"""NVTX ranges: the right names in the right places, attributes built once, and no cost when off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from graphrt import LLM, SamplingParams
from graphrt.capture.buckets import BucketPlan
from graphrt.capture.capture import capture_stage
from graphrt.profiling.nvtx import Ranges
from helpers import RecordingDomain


def nested(events):
    """(message, enclosing message or None, thread) for every push, from each thread's own stack."""
    stacks: dict[str, list[str]] = {}
    out = []
    for kind, message, thread in events:
        stack = stacks.setdefault(thread, [])
        if kind == "push":
            out.append((message, stack[-1] if stack else None, thread))
            stack.append(message)
        else:
            stack.pop()
    assert all(not stack for stack in stacks.values()), "every push has its pop"
    return out


@pytest.fixture(scope="module")
def recorded(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), pp=2, depth=1, kv_cache_tokens=1024, buckets=[1, 2, 4])
    engine = llm.engine
    domain = RecordingDomain()
    engine.ranges = engine.ring.ranges = Ranges(domain=domain)
    outputs = llm.generate([[5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.close()
    return domain, nested(domain.events), outputs


def test_graph_launches_carry_stage_slot_and_bucket(recorded):
    _, ranges, _ = recorded
    launches = [(m, thread) for m, parent, thread in ranges if m.startswith("stage")]
    assert launches
    for message, thread in launches:
        stage, slot, bucket = map(int, re.fullmatch(r"stage(\d) mb(\d) bs(\d)", message).groups())
        assert thread == f"graphrt-stage{stage}"  # pushed on that stage's own stream worker
        assert slot < 3 and bucket in (1, 2, 4)
    assert {m[:6] for m, _ in launches} == {"stage0", "stage1"}


def test_prefill_sampling_transfer_and_ticks_nest_where_they_happen(recorded):
    _, ranges, _ = recorded
    by_message = [(m, parent) for m, parent, _ in ranges]
    assert ("prefill stage0 tokens8", None) in by_message and ("prefill stage1 tokens8", None) in by_message
    samples = [parent for m, parent in by_message if m == "sample"]
    assert samples and all(p.startswith(("stage1 ", "prefill stage1")) for p in samples)  # only on the last stage
    transfers = [parent for m, parent in by_message if m == "transfer stage0->stage1"]
    assert transfers and all(p.startswith(("stage0 ", "prefill stage0")) for p in transfers)
    assert not [m for m, _ in by_message if m.startswith("transfer stage1")]  # the last stage sends nothing
    ticks = [(parent, thread) for m, parent, thread in ranges if m == "scheduler tick"]
    assert len(ticks) >= 6 and all(parent is None and thread == "MainThread" for parent, thread in ticks)


def test_attributes_are_built_once_per_message(recorded):
    domain, ranges, _ = recorded
    assert len(ranges) > len(domain.attribute_calls)
    assert set(domain.attribute_calls.values()) == {1}
    assert set(domain.attribute_calls) == {m for m, _, _ in ranges}


def test_each_bucket_capture_is_one_range(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), pp=2, kv_cache_tokens=1024, buckets=[1, 2])
    stage, cache = llm.engine.pipeline.stages[1], llm.engine.pipeline.caches[1]
    domain = RecordingDomain()
    _, records = capture_stage(stage, cache, BucketPlan((1, 2)), 8, False, False, set(), False, Ranges(domain=domain))
    assert [r.bucket for r in records] == [1, 2]
    assert [(m, parent) for m, parent, _ in nested(domain.events)] == [("capture stage1 bs2", None), ("capture stage1 bs1", None)]
    llm.engine.close()


NVTX_DISABLED_RUN = """
import nvtx, sys
from graphrt import LLM, SamplingParams
from graphrt.profiling.nvtx import Ranges
ranges = Ranges()
assert not nvtx.enabled() and not ranges.enabled
assert ranges.stage(0, 1, 2) is ranges.tick()  # one shared null context
llm = LLM(model=sys.argv[1], pp=2, kv_cache_tokens=1024, buckets=[1, 2])
assert not llm.engine.ranges.enabled
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(len(out[0].token_ids))
"""


def test_nvtx_disable_makes_ranges_no_ops_and_the_engine_still_runs(tiny_model_factory):
    # nvtx reads NVTX_DISABLE when it is first imported, hence a fresh interpreter.
    env = {**os.environ, "NVTX_DISABLE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", NVTX_DISABLED_RUN, str(tiny_model_factory())], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "4"


def test_without_a_profiler_ranges_are_skipped_but_an_injected_domain_is_used():
    assert not Ranges().enabled  # no Nsight Systems attached to pytest
    domain = RecordingDomain()
    with Ranges(domain=domain).tick():
        pass
    assert domain.events == [("push", "scheduler tick", "MainThread"), ("pop", None, "MainThread")]


# A fresh interpreter in which some packages cannot be imported, as on a GPU image that lacks them.
WITHOUT_PACKAGES = """
import sys

BLOCKED = set(sys.argv[1].split(","))


class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)


sys.meta_path.insert(0, Missing())
sys.argv = sys.argv[2:]
exec(sys.argv[0])
"""


def run_without(packages: list[str], code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_PACKAGES, ",".join(packages), code, *args], capture_output=True, text=True, timeout=180
    )


WITHOUT_NVTX_RUN = """
import torch
from graphrt import LLM, SamplingParams
from graphrt.tools.doctor import run_doctor
from graphrt.profiling.nvtx import Ranges
ranges = Ranges()
# Without the nvtx package: torch's own NVTX on a CUDA build, else nothing; off without a profiler.
assert ranges.backend.name == ("torch.cuda.nvtx" if torch.version.cuda else "none"), ranges.backend
assert not ranges.enabled and ranges.stage(0, 1, 2) is ranges.tick()
llm = LLM(model=sys.argv[1], pp=2, kv_cache_tokens=1024, buckets=[1, 2])
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print("tokens", len(out[0].token_ids))
run_doctor()
"""


def test_without_the_nvtx_package_ranges_fall_back_and_doctor_says_so(tiny_model_factory):
    done = run_without(["nvtx"], WITHOUT_NVTX_RUN, str(tiny_model_factory()))
    assert done.returncode == 0, done.stderr
    assert "tokens 4" in done.stdout
    nvtx_line = next(line for line in done.stdout.splitlines() if "NVTX ranges:" in line)
    assert nvtx_line.split(": ", 1)[1].startswith(("torch.cuda.nvtx (no nvtx package)", "none: neither the nvtx package"))


GENERATE_RUN = """
from graphrt.cli import main
main(sys.argv[1:], standalone_mode=True)
"""


def test_generate_runs_without_nvtx_and_the_server_stack(tiny_model_factory, tmp_path):
    """The CLI and engine must not need what GPU images lack: nvtx, fastapi, uvicorn, openai."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7]}\n')
    args = ["generate", "--model", str(tiny_model_factory()), "--prompts-file", str(prompts), "--max-tokens", "5", "--pp", "2"]
    done = run_without(["nvtx", "fastapi", "uvicorn", "openai", "starlette"], GENERATE_RUN, *args)
    assert done.returncode == 0, done.stderr
    line = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert len(line.pop("token_ids")) == 5  # the only output of a model without a tokenizer
    assert line == {"prompt": [5, 6, 7], "text": "", "num_tokens": 5, "finish_reason": "length"}


def test_a_speculative_verify_step_has_a_range_of_its_own(tiny_model_factory):
    # Prompts that repeat a phrase, so the ngram drafter proposes from the first decode step on.
    llm = LLM(model=tiny_model_factory(), pp=2, kv_cache_tokens=1024, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    engine = llm.engine
    engine.scheduler.speculation.step_costs = None  # every draft: whether drafts pay depends on the timing here
    domain = RecordingDomain()
    engine.ranges = engine.ring.ranges = Ranges(domain=domain)
    # Several decode steps, not a verify step's one or two chances: in one run of the suite, 4 new
    # tokens had none (not reproduced on its own, nor beside busy loops).
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.close()
    verifies = [(m, thread) for m, parent, thread in nested(domain.events) if m.startswith("verify")]
    assert verifies
    for message, thread in verifies:
        stage, _, tokens = map(int, re.fullmatch(r"verify stage(\d) mb(\d) tokens(\d+)", message).groups())
        assert thread == f"graphrt-stage{stage}" and tokens >= 2  # the newest token and at least one draft
    assert {thread for _, thread in verifies} == {"graphrt-stage0", "graphrt-stage1"}


def test_a_draft_models_guesses_have_a_range_on_the_schedulers_thread(tiny_model_factory):
    model = tiny_model_factory()
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 2}
    llm = LLM(model=model, pp=2, kv_cache_tokens=1024, speculative_config=config)
    engine = llm.engine
    engine.scheduler.speculation.step_costs = None  # every draft, whatever the step costs here
    domain = RecordingDomain()
    engine.ranges = engine.ring.ranges = engine.scheduler.speculation.drafter.ranges = Ranges(domain=domain)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.close()
    drafts = [(m, parent) for m, parent, _ in nested(domain.events) if m.startswith("draft")]
    # Up to 2 rounds, and 3 while the row's newest token is still on the device (its guess comes first).
    assert drafts and all(re.fullmatch(r"draft rows1 rounds[123]", m) for m, _ in drafts), drafts
    assert {parent for _, parent in drafts} == {"scheduler tick"}  # built with the step it drafts for

"""A capture that fails: named by stage, bucket and cause, and harmless to every later capture.

Each case runs in a fresh interpreter: a failed capture that torch does not clean up leaves the
allocator believing a capture is under way, which would fail unrelated tests after it. Inside the
child, a failing build is followed by a clean one, which is the point: the process stays usable.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

CHILD = """
import sys
import torch
from graphrt import LLM, SamplingParams
from graphrt.capture.capture import CaptureError
from graphrt.model.llama import Stage

model, case, broken = sys.argv[1], sys.argv[2], int(sys.argv[3])
OPTIONS = dict(pp=2, devices=["cuda:0", "cuda:0"], dtype="float32", buckets=[1, 2, 4, 8], kv_cache_tokens=8192, kernels="torch", depth=0)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Both stages on one GPU, depth 0: a decode round's rows go in one micro-batch
# (EngineConfig.num_decode_micro_batches), so broken - 1 prompts decode as broken - 1 rows, in the
# broken bucket (with one padding row) at every step.
PROMPTS = [[3 + i] * (2 + 3 * i % 11) for i in range(broken - 1)]
forward = Stage.forward


def broken_forward(self, x, meta, kv):
    out = forward(self, x, meta, kv)
    if self.index == 1 and x.shape[0] == broken:
        if case == "sync" or torch.cuda.is_current_stream_capturing():
            out.sum().item()  # a host sync: fine eagerly, illegal while a graph records
    return out


Stage.forward = broken_forward
if case == "allow-eager":
    llm = LLM(model=model, allow_eager=True, **OPTIONS)
    modes = {(r.stage, r.bucket): r.mode for r in llm.engine.graph_records}
    assert modes.pop((1, broken)) == "eager", modes
    assert set(modes.values()) == {"graph"}, modes
    with_fallback = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.engine.num_eager_fallbacks > 0
    llm.engine.close()
else:
    try:
        LLM(model=model, **OPTIONS)
    except CaptureError as exc:
        print("CaptureError:", exc)
    else:
        raise SystemExit("the broken forward was captured")
Stage.forward = forward
torch.cuda.empty_cache()  # asserts if the allocator still believes a capture is under way
graphs = LLM(model=model, **OPTIONS)
assert {r.mode for r in graphs.engine.graph_records} == {"graph"}
tokens = [o.token_ids for o in graphs.generate(PROMPTS, GREEDY)]
eager = LLM(model=model, use_graphs=False, **OPTIONS)
assert tokens == [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
if case == "allow-eager":
    assert with_fallback == tokens
print("later capture ok")
"""


def run_child(model, case: str, broken_bucket: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(model), case, str(broken_bucket)], capture_output=True, text=True, timeout=300)


def test_a_host_sync_is_named_before_capture_starts(tiny_model_factory):
    """The rehearsal before recording catches `.item()` and names the pair, the op and its line."""
    done = run_child(tiny_model_factory(), "sync")
    assert done.returncode == 0, done.stdout + done.stderr
    failure = next(line for line in done.stdout.splitlines() if line.startswith("CaptureError:"))
    assert "stage 1, bucket 4" in failure and "--allow-eager" in failure
    # torch 2.11 on CUDA dispatches .item() as _local_scalar_dense alone: the message names the call either way
    assert ".item()" in failure and "reads a tensor's value on the host" in failure
    assert "later capture ok" in done.stdout


def test_a_capture_that_breaks_while_recording_leaves_the_process_usable(tiny_model_factory):
    """The sync happens only inside capture, so CUDA invalidates the capture itself."""
    done = run_child(tiny_model_factory(), "inside-capture")
    assert done.returncode == 0, done.stdout + done.stderr
    failure = next(line for line in done.stdout.splitlines() if line.startswith("CaptureError:"))
    assert "stage 1, bucket 4" in failure
    assert "later capture ok" in done.stdout


@pytest.mark.parametrize("broken_bucket", [4, 8], ids=["smaller-bucket", "largest-bucket"])
def test_allow_eager_runs_the_failed_pair_eagerly_with_the_same_tokens(tiny_model_factory, broken_bucket):
    """The largest bucket is captured first: when it fails, its graph held the stage pool's only
    reference, and the stage's other buckets must still be captured (in a new pool)."""
    done = run_child(tiny_model_factory(), "allow-eager", broken_bucket)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "later capture ok" in done.stdout

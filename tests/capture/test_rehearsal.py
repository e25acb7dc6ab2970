"""The capture rehearsal: every stage's decode forward is capturable, for every architecture, pp 1-3
and both kernel sets, and each kind of capture bug planted in a forward is refused by op and stage.

The Triton kernels run through Triton's interpreter here (`TRITON_INTERPRET=1`, set before anything
imports them, as in test_kernels.py). On a CPU stage the host is the device, so a "host copy" is
planted as a copy to the meta device: the same rule refuses `.cpu()` on a CUDA stage.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphrt.capture.graphs import StaticInputs  # noqa: E402
from graphrt.capture.rehearsal import RehearsalError, rehearse_stage  # noqa: E402
from graphrt.errors import GraphrtError  # noqa: E402
from graphrt.model import SCRATCH_BLOCK  # noqa: E402
from graphrt.model.config import ModelConfig  # noqa: E402
from graphrt.model.weights import WeightFiles  # noqa: E402
from graphrt.runtime.pipeline import Pipeline  # noqa: E402
from graphrt.tools.synthetic import TINY_VARIANTS  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 8
BUCKETS = (1, 3, 8)


def load_pipeline(model_dir, pp: int, kernels: str = "torch") -> Pipeline:
    cfg = ModelConfig.from_dir(model_dir)
    pipeline = Pipeline.load(cfg, WeightFiles(model_dir), [torch.device("cpu")] * pp, torch.float32, cfg.max_position, kernels)
    pipeline.allocate_kv(NUM_BLOCKS, BLOCK_SIZE)
    return pipeline


def static_inputs(stage, bucket: int) -> StaticInputs:
    return StaticInputs.allocate(stage, bucket, max_blocks=stage.cfg.max_position // BLOCK_SIZE)


def rehearse_every_stage(pipeline: Pipeline, buckets) -> None:
    for stage, cache in zip(pipeline.stages, pipeline.caches):
        real_blocks = (cache.k[:, SCRATCH_BLOCK + 1 :].clone(), cache.v[:, SCRATCH_BLOCK + 1 :].clone())
        for bucket in buckets:
            seconds = rehearse_stage(stage, cache, static_inputs(stage, bucket))
            assert len(seconds) == 2 and all(s > 0 for s in seconds), seconds  # each run's time, for capture's report
        # Like capture's warm-ups, the rehearsal writes only where fresh static inputs point: the scratch block.
        assert torch.equal(cache.k[:, SCRATCH_BLOCK + 1 :], real_blocks[0])
        assert torch.equal(cache.v[:, SCRATCH_BLOCK + 1 :], real_blocks[1])


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_every_stage_and_bucket_is_capturable_with_torch_kernels(tiny_model_factory, variant, pp):
    rehearse_every_stage(load_pipeline(tiny_model_factory(variant), pp), BUCKETS)


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_every_stage_is_capturable_with_triton_kernels(tiny_model_factory, variant):
    pytest.importorskip("triton")
    from graphrt.kernels import rmsnorm_triton

    if not torch.cuda.is_available() and type(rmsnorm_triton._rms_norm_kernel).__name__ != "InterpretedFunction":
        pytest.skip("graphrt's Triton kernels were imported before TRITON_INTERPRET=1 was set")
    rehearse_every_stage(load_pipeline(tiny_model_factory(variant), pp=2, kernels="triton"), buckets=(3,))


# Capture bugs, each planted after a stage's forward as a kernel would commit it: (the planted
# code, what the error must name). Each is refused before it returns, so shapes don't matter.
def zero_the_negatives(out, meta, cache):
    out = out.clone()
    out[out < 0] = 0.0
    return out


def replace_the_kv_cache(out, meta, cache):
    cache.k = cache.k.clone()  # a graph would keep writing the old tensor
    return out


SCRATCH = torch.zeros(64)  # made outside the forward, owned by nobody a graph knows of

PLANTED = {
    "item": (lambda out, meta, cache: out * meta.seq_lens.max().item(), r"aten\.(item|_local_scalar_dense)"),
    "branch on a tensor": (
        lambda out, meta, cache: out if bool((meta.seq_lens > 0).all()) else -out,
        r"aten\.(is_nonzero|_local_scalar_dense)",
    ),
    "nonzero": (lambda out, meta, cache: out + meta.seq_lens.nonzero().sum(), r"aten\.nonzero"),
    "masked_select": (lambda out, meta, cache: out.masked_select(out > 0), r"aten\.masked_select"),
    "bool-mask indexing": (lambda out, meta, cache: out[meta.seq_lens > 0], r"aten\.index\.Tensor .* boolean mask"),
    "bool-mask assignment": (zero_the_negatives, r"aten\.index_put_\.default .* boolean mask"),
    "unique": (lambda out, meta, cache: out + torch.unique(meta.block_tables).sum(), r"aten\._unique2"),
    "repeat_interleave": (lambda out, meta, cache: out.repeat_interleave(meta.seq_lens, dim=0), r"aten\.repeat_interleave"),
    # On a CPU stage the host is the device; the meta device stands in for it.
    "host copy": (lambda out, meta, cache: out.to("meta"), r"aten\.(to|_to_copy)\.\S+ .* copies a tensor from cpu to meta"),
    "tensor on another device": (
        lambda out, meta, cache: out + torch.zeros(out.shape, device="meta"),
        r"aten\.zeros\.default .* makes a tensor on meta",
    ),
    "write into a tensor nobody owns": (
        lambda out, meta, cache: SCRATCH.copy_(out.flatten()[:64]),
        r"aten\.copy_\.default .* writes into a tensor that the forward did not allocate",
    ),
    "replaced KV cache": (replace_the_kv_cache, r"replaced or moved the KV cache's k"),
}


def plant(stage, bug, inference_mode: bool) -> None:
    forward = stage.forward

    def planted(x, meta, cache):
        out = forward(x, meta, cache)
        with torch.inference_mode(inference_mode):  # the stage's forward runs in it; the mode sees coarser ops there
            return bug(out, meta, cache)

    stage.forward = planted


@pytest.mark.parametrize("inference_mode", [True, False], ids=["inference-mode", "grad-mode"])
@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_capture_bug_is_refused_naming_op_and_stage(tiny_model_factory, name, inference_mode):
    bug, names = PLANTED[name]
    pipeline = load_pipeline(tiny_model_factory(), pp=2)
    stage, cache = pipeline.stages[1], pipeline.caches[1]
    rehearse_stage(stage, cache, static_inputs(stage, 2))  # the healthy stage passes
    plant(stage, bug, inference_mode)
    with pytest.raises(RehearsalError, match=rf"^stage 1, bucket 2: .*{names}") as error:
        rehearse_stage(stage, cache, static_inputs(stage, 2))
    assert isinstance(error.value, GraphrtError)  # the CLI prints it as one line, without a traceback


def test_output_buffer_that_moves_between_replays_is_refused(tiny_model_factory):
    pipeline = load_pipeline(tiny_model_factory(), pp=2)
    stage, cache = pipeline.stages[1], pipeline.caches[1]
    logits = torch.zeros(2, stage.cfg.vocab_size)
    stage.register_buffer("ping", logits.clone())
    stage.register_buffer("pong", logits.clone())
    turns = iter(["ping", "pong"])

    def double_buffered(out, meta, cache):  # a graph would always write the buffer capture saw
        return getattr(stage, next(turns)).copy_(out)

    plant(stage, double_buffered, inference_mode=True)
    with pytest.raises(RehearsalError, match=r"^stage 1, bucket 2: the output buffer changed between two replays"):
        rehearse_stage(stage, cache, static_inputs(stage, 2))


def test_error_points_at_the_line_and_says_what_to_do(tiny_model_factory):
    pipeline = load_pipeline(tiny_model_factory(), pp=1)
    stage, cache = pipeline.stages[0], pipeline.caches[0]
    plant(stage, PLANTED["nonzero"][0], inference_mode=True)
    with pytest.raises(RehearsalError) as error:
        rehearse_stage(stage, cache, static_inputs(stage, 4))
    message = str(error.value)
    assert message.startswith("stage 0, bucket 4: aten.nonzero.default at capture/test_rehearsal.py:")
    assert "give the size explicitly" in message


# The static-shape twins of the refused ops pass: the rehearsal refuses what breaks capture, not more.
ALLOWED = {
    "torch.where": lambda out, meta, cache: torch.where(out > 0, out, 0.0),
    "masked_fill": lambda out, meta, cache: out.masked_fill(out < 0, 0.0),
    "nonzero_static": lambda out, meta, cache: out + torch.nonzero_static(meta.seq_lens, size=2).sum(),
    "repeat_interleave with output_size": lambda out, meta, cache: out.repeat_interleave(
        torch.ones_like(meta.seq_lens), dim=0, output_size=out.shape[0]
    ),
    "repeat_interleave by a number": lambda out, meta, cache: out.repeat_interleave(2, dim=0)[::2],
    "in-place on a fresh tensor": lambda out, meta, cache: out.clone().mul_(2.0),
    "index with integer rows": lambda out, meta, cache: out[meta.logits_indices],
}


@pytest.mark.parametrize("inference_mode", [True, False], ids=["inference-mode", "grad-mode"])
@pytest.mark.parametrize("name", list(ALLOWED))
def test_static_shape_twins_pass(tiny_model_factory, name, inference_mode):
    pipeline = load_pipeline(tiny_model_factory(), pp=2)
    stage, cache = pipeline.stages[1], pipeline.caches[1]
    plant(stage, ALLOWED[name], inference_mode)
    rehearse_stage(stage, cache, static_inputs(stage, 2))

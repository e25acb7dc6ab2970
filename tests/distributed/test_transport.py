"""The wire between stage processes: every field of a micro-batch survives encode and decode."""

from __future__ import annotations

import pytest
import torch

from graphrt.distributed.handshake import PLAN_SIZE, StagePlan
from graphrt.distributed.transport import (
    DECODE,
    HEARTBEAT,
    PREFILL,
    Message,
    Sampling,
    decode,
    encode,
    float_payload_size,
    int_payload_size,
)
from graphrt.model.batch import StepMetadata
from graphrt.runtime.logits_plan import LogitsPlan
from graphrt.sampling_params import SamplingParams


def micro_batch(kind: int, with_sampling: bool, released: list[int], with_logprobs: bool = False) -> Message:
    rows, width = 3, 4
    query_lens = [5, 1, 2] if kind == PREFILL else None
    num_tokens = sum(query_lens) if query_lens else rows
    meta = StepMetadata(
        positions=torch.arange(num_tokens) + 7,
        slot_mapping=torch.arange(num_tokens) * 3 + 1,
        block_tables=torch.arange(rows * width).view(rows, width) + 2,
        seq_lens=torch.tensor([12, 9, 30]),
        # With logprobs, a prefill's extra rows score prompt tokens (graphrt.runtime.logprobs)
        logits_indices=torch.tensor([num_tokens - 4, num_tokens - 3, num_tokens - 1] + ([0, 1, 2] if with_logprobs and query_lens else [])),
        seq_lens_host=[12, 9, 30],
        query_lens=query_lens,
    )
    sampling = None
    if with_sampling or released or with_logprobs:
        rows_sampled = [0, 2] if with_sampling else []
        params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(temperature=0.0)][: len(rows_sampled)]
        sampling = Sampling(rows_sampled, [41, 43][: len(rows_sampled)], params, [1234, None][: len(rows_sampled)], released)
        if with_logprobs:
            sampling.scored = [1] if with_sampling else []
            sampling.prompt_targets = [99, 98, 97] if query_lens else []
            sampling.num_top = 5
    return Message(kind, micro_batch=17, slot=2, meta=meta, bucket=4 if kind == DECODE else None, sampling=sampling, counters=[0, 5, 123456789])


@pytest.mark.parametrize("kind", [PREFILL, DECODE])
@pytest.mark.parametrize(
    "with_sampling, released, with_logprobs",
    [(True, [5, 8], False), (True, [], False), (False, [9], False), (False, [], False), (True, [], True), (False, [], True)],
)
def test_a_micro_batch_round_trips(kind, with_sampling, released, with_logprobs):
    sent = micro_batch(kind, with_sampling, released, with_logprobs)
    header, ints, floats = encode(sent)
    assert ints.shape[0] == int_payload_size(header)  # the receiver sizes its buffer from the header
    got = decode(header, ints, floats)
    assert got.sampling is None or got.sampling.logits_plan is None
    assert (got.kind, got.micro_batch, got.slot, got.bucket) == (kind, 17, 2, sent.bucket)
    for field in ("positions", "slot_mapping", "block_tables", "seq_lens", "logits_indices"):
        assert torch.equal(getattr(got.meta, field), getattr(sent.meta, field)), field
    assert got.meta.seq_lens_host == sent.meta.seq_lens_host and got.meta.query_lens == sent.meta.query_lens
    assert got.counters == sent.counters
    if sent.sampling is None:
        assert got.sampling is None
        return
    assert got.sampling.rows == sent.sampling.rows and got.sampling.request_ids == sent.sampling.request_ids
    assert got.sampling.seeds == sent.sampling.seeds and got.sampling.released == sent.sampling.released
    assert (got.sampling.scored, got.sampling.prompt_targets, got.sampling.num_top) == (
        sent.sampling.scored, sent.sampling.prompt_targets, sent.sampling.num_top
    )
    for ours, theirs in zip(got.sampling.params, sent.sampling.params):
        assert (ours.temperature, ours.top_k, ours.top_p) == (theirs.temperature, theirs.top_k, theirs.top_p)


@pytest.mark.parametrize("kind", [PREFILL, DECODE])
def test_a_logits_plan_round_trips_beside_the_sampling_floats(kind):
    sent = micro_batch(kind, with_sampling=True, released=[3], with_logprobs=True)
    sent.sampling.logits_plan = LogitsPlan(
        window=2, history_entries=[0, 1], history_requests=[41, 43], history_priors=[0, 0], init_requests=[41],
        init_output_owners=[0, 0], init_output_tokens=[5, 6], init_recent=[5, 6], presence=[0.5, 0.0],
        frequency=[0.25, 0.0], repetition=[1.0, 1.5], banned_entries=[1], banned_tokens=[2], bias_entries=[0],
        bias_tokens=[9], bias_values=[-3.5], min_p=[0.0, 0.125],
    )
    header, ints, floats = encode(sent)
    assert ints.shape[0] == int_payload_size(header) and floats.shape[0] == float_payload_size(header)
    got = decode(header, ints, floats)
    assert got.sampling.logits_plan == sent.sampling.logits_plan
    assert [p.temperature for p in got.sampling.params] == [0.7, 0.0] and got.sampling.released == [3]
    assert got.sampling.scored == sent.sampling.scored and got.sampling.prompt_targets == sent.sampling.prompt_targets


def test_a_heartbeat_has_no_payload():
    header, ints, floats = encode(Message(HEARTBEAT, micro_batch=-1, slot=0))
    assert ints.numel() == 0 and floats is None
    got = decode(header, ints, floats)
    assert (got.kind, got.meta, got.sampling) == (HEARTBEAT, None, None)


@pytest.mark.parametrize("ep, timeline", [(1, False), (2, True)])
def test_the_stage_plan_round_trips(ep, timeline):
    """Every field rank 0 decides reaches each worker as it was, in one fixed-size tensor."""
    plan = StagePlan(
        fingerprint="ab" * 32, dtype="float64", pp=3, layers=[range(0, 2), range(2, 5), range(5, 6)], partition_rows=8,
        buckets=[1, 2, 4, 8], num_blocks=96, block_size=16, max_model_len=512, num_slots=4, max_tokens=64, seed=5,
        use_cuda_graphs=False, kernels="torch", allow_eager=True, ep=ep, timeline=timeline,
    )
    encoded = plan.encode()
    assert encoded.shape == (PLAN_SIZE,) and encoded.dtype == torch.int64
    assert StagePlan.decode(encoded) == plan

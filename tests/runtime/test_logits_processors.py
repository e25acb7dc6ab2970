"""Penalties, bias, masks and min_p on the sampler's device (graphrt.runtime.logits_plan and
logits_processors) against a plain per-request reference (helpers.reference_logits), step by step: random
logits, requests mixing every parameter, verify rows whose drafts are kept or not, a history
started again after a preemption, and requests with the defaults left exactly as they were."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphrt.engine.sequence import Sequence
from graphrt.engine.speculation import accept_drafts
from graphrt.runtime.logits_plan import LogitsPlan, plan_logits
from graphrt.runtime.logits_processors import TokenHistory, process_logits
from graphrt.runtime.sampler import Sampler
from graphrt.runtime.step import ScheduledStep
from graphrt.sampling_params import SamplingParams
from helpers import assert_draws_follow, reference_logits

VOCAB = 16
EOS = frozenset({2})
CPU = torch.device("cpu")


PARAMS = [
    SamplingParams(temperature=0),  # the defaults: its logits go through untouched
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5),
    SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4),
    SamplingParams(repetition_penalty=0.6, logit_bias={3: 5.0, 4: -100.0}),
    SamplingParams(bad_words_token_ids=[[5], [6, 7], [8, 9, 10], [6, 11]], presence_penalty=0.3),
    SamplingParams(allowed_token_ids=[1, 2, 6, 7, 12], min_tokens=3, stop_token_ids=[12]),
    SamplingParams(min_tokens=2, stop_token_ids=[13], logit_bias={13: 3.0}, bad_words_token_ids=[[1, 2, 3]]),
]


def new_sequences(rng: random.Random) -> list[Sequence]:
    return [
        Sequence(100 + i, prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))], params=p, max_tokens=64)
        for i, p in enumerate(PARAMS)
    ]


def prefill(seqs: list[Sequence]) -> ScheduledStep:
    """Each sequence prefills every token it has (a new request, or one recomputed after a preemption)."""
    for seq in seqs:
        seq.prefill_len, seq.num_computed = seq.num_tokens, 0
    return ScheduledStep(seqs, [seq.num_tokens for seq in seqs], is_prefill=True)


def decode(seqs: list[Sequence], rng: random.Random, with_drafts: bool) -> ScheduledStep:
    """A decode step; with drafts, some rows verify up to 3 guesses (mostly repeats of their last
    token, so that some are kept)."""
    for seq in seqs:
        seq.num_computed = seq.num_tokens - 1
    drafts = [
        [seq.output_ids[-1]] * rng.randrange(1, 4) if with_drafts and rng.random() < 0.6 else []
        for seq in seqs
    ]
    if not any(drafts):
        return ScheduledStep(seqs, [1] * len(seqs), is_prefill=False)
    return ScheduledStep(seqs, [1 + len(d) for d in drafts], is_prefill=False, draft_ids=drafts)


def pick_tokens(processed: torch.Tensor, step: ScheduledStep, rng: random.Random) -> torch.Tensor:
    """A finite-logit token per entry: at a verify row's entries mostly its draft, so that runs of
    drafts are kept, and then missed; often a token that begins one of the row's bad words."""
    picks, entry = [], 0
    for row, (seq, count) in enumerate(zip(step.sampled_seqs, step.sample_counts)):
        drafts = step.draft_ids[row] if step.draft_ids else []
        prefixes = [t for word in seq.params.bad_words_token_ids or [] for t in word[:-1]]
        for j in range(count):
            allowed = [t for t in range(VOCAB) if processed[entry].isfinite()[t]]
            starts = [t for t in prefixes if t in allowed]
            if j < len(drafts) and drafts[j] in allowed and rng.random() < 0.7:
                picks.append(drafts[j])
            else:
                picks.append(rng.choice(starts) if starts and rng.random() < 0.5 else rng.choice(allowed))
            entry += 1
    return torch.tensor(picks)


def word_matches(params: SamplingParams, output: list[int]) -> int:
    """How many of the request's bad words of several tokens have their prefix just output."""
    words = [w for w in params.bad_words_token_ids or [] if len(w) > 1]
    return sum(len(w) - 1 <= len(output) and output[len(output) - len(w) + 1 :] == w[:-1] for w in words)


def check_step(step: ScheduledStep, history: TokenHistory, rng: random.Random, seen: dict) -> torch.Tensor:
    """Process random logits for `step` and compare every entry with the reference; return the picks.
    `seen` counts the bad words that matched."""
    num_entries = sum(step.sample_counts)
    logits = torch.randn(num_entries, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
    plan = plan_logits(step, EOS)
    processed = process_logits(logits, plan, history)
    entry = 0
    for row, (seq, count) in enumerate(zip(step.sampled_seqs, step.sample_counts)):
        drafts = step.draft_ids[row] if step.draft_ids else []
        for j in range(count):
            expected = reference_logits(logits[entry], seq.params, seq.prompt_ids, seq.output_ids + drafts[:j], EOS)
            seen["words"] += word_matches(seq.params, seq.output_ids + drafts[:j])
            assert torch.equal(processed.logits[entry], expected), (seq.params, j, processed.logits[entry], expected)
            entry += 1
    picks = pick_tokens(processed.logits, step, rng)
    processed.commit(picks)
    return picks


def append(step: ScheduledStep, picks: list[int], seen: dict) -> None:
    """The host's side: each row keeps its token, a verify row what accept_drafts keeps (`seen`
    counts the drafts kept and missed)."""
    entry = 0
    for row, (seq, count) in enumerate(zip(step.sampled_seqs, step.sample_counts)):
        sampled = picks[entry : entry + count]
        entry += count
        kept = accept_drafts(step.draft_ids[row], sampled) if count > 1 else sampled
        seen["kept"] += len(kept) - 1
        seen["missed"] += len(kept) < count
        seq.output_ids += kept


@pytest.mark.parametrize("with_drafts", [False, True], ids=["decode", "verify"])
def test_every_entry_equals_the_reference_step_after_step(with_drafts):
    rng = random.Random(int(with_drafts))
    seqs = new_sequences(rng)
    history = TokenHistory(CPU)
    seen = {"words": 0, "kept": 0, "missed": 0}
    step = prefill(seqs)
    append(step, check_step(step, history, rng, seen).tolist(), seen)
    for index in range(24):
        if index == 12:  # preempted and recomputed: the histories start again from what the host has
            step = prefill(seqs[1:4])
        else:
            step = decode(seqs, rng, with_drafts)
        append(step, check_step(step, history, rng, seen).tolist(), seen)
    assert len(history.rows) == 5  # rows only for the requests with penalties or bad words of several tokens
    assert all(len(seq.output_ids) > 20 for seq in seqs)
    assert seen["words"] > 10, seen  # bad words did match, and were masked as the reference masks them
    if with_drafts:
        assert seen["kept"] > 10 and seen["missed"] > 10, seen


def test_a_request_with_the_defaults_makes_no_plan_and_is_untouched_beside_others():
    seqs = new_sequences(random.Random(3))
    assert plan_logits(prefill(seqs[:1]), EOS) is None
    step = prefill(seqs)
    logits = torch.randn(len(seqs), VOCAB, dtype=torch.float64)
    processed = process_logits(logits, plan_logits(step, EOS), TokenHistory(CPU))
    assert torch.equal(processed.logits[0], logits[0])
    # Nothing to do is no plan: min_tokens all out, min_p on a greedy row.
    waits = Sequence(1, [3, 4], SamplingParams(min_tokens=2, stop_token_ids=[7]), max_tokens=8, output_ids=[5])
    assert plan_logits(decode([waits], random.Random(0), with_drafts=False), EOS) == LogitsPlan(
        banned_entries=[0, 0], banned_tokens=[2, 7],
    )
    waits.output_ids.append(6)
    assert plan_logits(decode([waits], random.Random(0), with_drafts=False), EOS) is None
    greedy = Sequence(2, [3], SamplingParams(temperature=0, min_p=0.5), max_tokens=8)
    assert plan_logits(prefill([greedy]), EOS) is None


def test_released_requests_give_their_rows_back():
    history = TokenHistory(CPU)
    rows = history.take_rows([7, 8, 9], VOCAB)
    history.release([8, 99])  # an id with no row is ignored
    assert history.take_rows([10], VOCAB) == [rows[1]]
    assert sorted(history.rows) == [7, 9, 10]
    history.take_rows(list(range(20, 40)), VOCAB)  # grows, keeping the rows it had
    assert history.rows[7] == rows[0] and history.counts.shape[0] >= 23


def test_the_plan_survives_its_wire_form():
    rng = random.Random(5)
    seqs = new_sequences(rng)
    for seq in seqs:
        seq.output_ids = [rng.randrange(VOCAB) for _ in range(4)]
    plan = plan_logits(decode(seqs, rng, with_drafts=True), EOS)
    assert plan.prior_tokens and plan.word_history and plan.allowed_entries and plan.bias_values and plan.presence
    assert LogitsPlan.from_wire(*plan.to_wire()) == plan


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.2), (0.5, 0.3), (2.0, 0.4)])
def test_min_p_drops_what_is_less_likely_than_min_p_times_the_top_after_the_temperature(temperature, min_p):
    logits = torch.tensor([[2.0, 1.6, 1.2, 0.8, 0.4, 0.0, -0.4, -0.8]])
    probs = torch.softmax(logits[0].double() / temperature, -1)
    kept = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    expected = kept / kept.sum()
    num_draws = 20_000
    params = SamplingParams(temperature=temperature, min_p=min_p)
    plan = plan_logits(prefill([Sequence(0, [1], params, max_tokens=4)]), EOS)
    assert plan == LogitsPlan(min_p=[min_p])
    sampler = Sampler(CPU, seed=9)
    every_draw = LogitsPlan(min_p=plan.min_p * num_draws)
    tokens = sampler(logits.expand(num_draws, -1), [params] * num_draws, [None] * num_draws, every_draw)
    assert_draws_follow(tokens, expected)
    assert 0 < (expected == 0).sum() < len(expected) - 1  # the cases do drop some tokens and keep several


class ScalarsWrittenThroughIndices(TorchDispatchMode):
    """Raises on `tensor[index] = scalar`: index_put of a Python number made a tensor (lift_fresh),
    which on CUDA is copied from the host first, a wait for the device that torch's sync debug mode
    flags (seen on an H200). A device tensor of one element is fine: it arrives 0-dim too."""

    def __init__(self):
        super().__init__()
        self.scalars = []  # the 0-dim tensors lifted from Python numbers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.index_put_, torch.ops.aten.index_put):
            if any(args[2] is scalar for scalar in self.scalars):
                raise AssertionError(f"{func} writes a Python number through tensor indices: on CUDA that syncs the host")
        out = func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten.lift_fresh and out.dim() == 0:
            self.scalars.append(out)
        return out


def test_plans_write_no_scalar_through_indices_which_would_sync_a_gpu():
    """The CPU's guard for the GPU test below: every kind of plan, prefill and decode steps with drafts."""
    rng = random.Random(11)
    seqs = new_sequences(rng)
    sampler = Sampler(CPU, seed=0)
    for index in range(12):
        step = prefill(seqs) if index in (0, 6) else decode(seqs, rng, with_drafts=True)
        num_entries = sum(step.sample_counts)
        logits = torch.randn(num_entries, VOCAB, dtype=torch.float64)
        params = [seq.params for seq, count in zip(step.sampled_seqs, step.sample_counts) for _ in range(count)]
        plan = plan_logits(step, EOS)
        with ScalarsWrittenThroughIndices():
            tokens = sampler(logits, params, [None] * num_entries, plan)
        append(step, tokens.tolist(), {"words": 0, "kept": 0, "missed": 0})


@pytest.mark.cuda
def test_on_a_gpu_plans_run_without_syncing_the_host_and_give_the_cpu_tokens():
    """The ring launches ahead only if sampling never makes the host wait: every step here runs with
    torch's sync debug mode raising on a synchronizing call, and picks the CPU sampler's tokens."""
    from dataclasses import replace

    rng = random.Random(11)
    seqs = new_sequences(rng)
    for seq in seqs:
        seq.params = replace(seq.params, temperature=0.0)
    cuda, generator = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    on_gpu, on_cpu, seen = Sampler(cuda, seed=0), Sampler(CPU, seed=0), {"words": 0, "kept": 0, "missed": 0}
    for index in range(12):
        step = prefill(seqs) if index in (0, 6) else decode(seqs, rng, with_drafts=True)
        num_entries = sum(step.sample_counts)
        logits = torch.randn(num_entries, VOCAB, dtype=torch.float64, device=cuda, generator=generator)
        params = [seq.params for seq, count in zip(step.sampled_seqs, step.sample_counts) for _ in range(count)]
        plan = plan_logits(step, EOS)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = on_gpu(logits, params, [None] * num_entries, plan)
            random_rows = [replace(p, temperature=1.0) for p in params]
            sampled = on_gpu(logits, random_rows, [None] * num_entries, LogitsPlan(min_p=[0.1] * num_entries))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        expected = on_cpu(logits.cpu(), params, [None] * num_entries, plan)
        assert torch.equal(tokens.cpu(), expected) and sampled.shape == tokens.shape
        append(step, expected.tolist(), seen)
    assert seen["kept"] and seen["missed"]

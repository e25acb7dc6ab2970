"""Prefill attention over a chunk that mixes decode rows riding along with prompt pieces, against
attention written out longhand for each sequence alone."""

from __future__ import annotations

import pytest
import torch

from graphrt.kernels.paged_attention import paged_prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 16, 4


def longhand(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """q: (query_len, heads, dim) at positions first_pos...; keys/values: (ctx, kv_heads, dim)."""
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    positions = torch.arange(first_pos, first_pos + q.shape[0])
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([1, 1, 1, 7, 5], [9, 1, 17, 7, 12]),  # three riders (one a 1-token prompt), a whole prompt, a later chunk
    ([1, 1], [3, 20]),  # riders only
    ([4, 1, 1], [4, 6, 8]),  # a one-token row after a prompt piece takes the per-row path
    ([6], [13]),
])
def test_a_mixed_chunk_matches_each_sequence_alone(query_lens, seq_lens):
    generator = torch.Generator().manual_seed(sum(seq_lens))
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    num_blocks = 1 + max_blocks * len(seq_lens)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    # Each sequence's blocks scattered over the cache; unused table entries point at scratch block 0.
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = []
    for row, seq_len in enumerate(seq_lens):
        own = order[row * max_blocks : row * max_blocks + -(-seq_len // BLOCK_SIZE)]
        tables.append(own + [0] * (max_blocks - len(own)))
    block_tables = torch.tensor(tables)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    scale = HEAD_DIM**-0.5

    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, query_lens, seq_lens, scale)

    start = 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        slots = [tables[row][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(seq_len)]
        keys = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        values = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        expected = longhand(q[start : start + query_len], keys, values, seq_len - query_len, scale)
        torch.testing.assert_close(out[start : start + query_len], expected, rtol=1e-9, atol=1e-9)
        start += query_len


def random_chunk(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """A cache holding each sequence's context in scattered blocks (NaN elsewhere, so a read of a
    wrong block shows), its block table, and the chunk's queries."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = 1 + max_blocks * len(seq_lens)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.float64)
    v_cache = k_cache.clone()
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = []
    for row, seq_len in enumerate(seq_lens):
        own = order[row * max_blocks : row * max_blocks + -(-seq_len // block_size)]
        for b, block in enumerate(own):
            filled = min(block_size, seq_len - b * block_size)
            k_cache[block, :filled] = torch.randn(filled, kv_heads, head_dim, generator=generator, dtype=torch.float64)
            v_cache[block, :filled] = torch.randn(filled, kv_heads, head_dim, generator=generator, dtype=torch.float64)
        tables.append(own + [0] * (max_blocks - len(own)))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=generator, dtype=torch.float64)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), torch.tensor(tables)


def exact_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, scale):
    """Each sequence alone, written out in float64 from the (rounded) inputs."""
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    block_size, group = k_cache.shape[1], heads // kv_heads
    tables = tables.tolist()
    out, start = [], 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        slots = [tables[row][pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
        keys = k_cache.double().view(-1, kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)
        values = v_cache.double().view(-1, kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + query_len].double(), keys) * scale
        positions = torch.arange(seq_len - query_len, seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += query_len
    return torch.cat(out)


COMPILED_CASES = [
    # (query_lens, seq_lens, heads, kv_heads, head_dim, block_size)
    ([40, 16, 17], [40, 16, 17], 9, 3, 64, 16),  # whole prompts: two and a half query blocks, exactly one, one and a bit
    ([15, 1, 33], [100, 1, 70], 6, 2, 16, 4),  # later chunks after a cached prefix; a one-token prompt
    ([23], [23], 4, 4, 20, 8),  # multi-head (groups of one); head_dim not a whole number of vectors
    ([9, 31], [12, 64], 8, 2, 128, 16),  # groups of four, long heads
]


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", COMPILED_CASES)
def test_the_compiled_prompt_attention_matches_exact_attention(dtype, case):
    from graphrt.kernels.cpu.paged_attention import prompt_attention

    query_lens, seq_lens, heads, kv_heads, head_dim, block_size = case
    q, k_cache, v_cache, tables = random_chunk(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = prompt_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = exact_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, scale)
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.usefixtures("built_cpu_kernels")
def test_the_compiled_prompt_attention_gives_the_same_bits_on_one_thread_and_two():
    from graphrt.kernels.cpu.paged_attention import prompt_attention

    args = (*random_chunk([40, 16], [50, 16], 9, 3, 64, 16, torch.bfloat16), [40, 16], [50, 16], 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prompt_attention(*args)
        torch.set_num_threads(2)
        two = prompt_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.usefixtures("built_cpu_kernels")
def test_a_chunk_with_riders_on_the_compiled_kernels_matches_the_reference():
    from graphrt.kernels.cpu import paged_attention as paged_attention_cpu

    query_lens, seq_lens = [1, 1, 7, 20], [9, 30, 7, 45]
    q, k_cache, v_cache, tables = random_chunk(query_lens, seq_lens, 6, 2, 16, 4, torch.float64)
    out = paged_attention_cpu.paged_prefill_attention(
        q, k_cache, v_cache, tables, query_lens, seq_lens, 0.25, decode_attention=paged_attention_cpu.paged_decode_attention
    )
    expected = exact_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("built_cpu_kernels")
def test_the_compiled_prompt_attention_names_bad_rows():
    op = torch.ops.graphrt.paged_prefill_attention
    q, k_cache, v_cache, tables = random_chunk([4], [6], 2, 1, 16, 4, torch.float32)
    lens = lambda *values: torch.tensor(values)  # noqa: E731
    with pytest.raises(RuntimeError, match="row 0 has query_len 7 and seq_len 6"):
        op(torch.zeros(7, 2, 16), k_cache, v_cache, tables, lens(7), lens(6), 0.25)
    with pytest.raises(RuntimeError, match="query_lens add up to 3 but q has 4 tokens"):
        op(q, k_cache, v_cache, tables, lens(3), lens(6), 0.25)
    bad_table = tables.clone()
    bad_table[0, 1] = 99
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 1\] is 99, not a block of the 3-block cache"):
        op(q, k_cache, v_cache, bad_table, lens(4), lens(6), 0.25)


@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1, 1, 7, 5], [9, 1, 17, 7, 12]), ([1, 1], [3, 20])])
def test_riders_read_the_lengths_the_caller_put_on_the_device(query_lens, seq_lens):
    """Given the micro-batch's seq_lens tensor, a chunk gives the very same result as without it."""
    q, k_cache, v_cache, tables = random_chunk(query_lens, seq_lens, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32)
    args = (q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, query_lens, seq_lens, HEAD_DIM**-0.5)
    given = paged_prefill_attention(*args, device_seq_lens=torch.tensor(seq_lens))
    torch.testing.assert_close(given, paged_prefill_attention(*args), rtol=0, atol=0)


def test_a_chunk_with_riders_makes_no_length_tensor_per_layer(tiny_model_factory, monkeypatch):
    """The decode rows of a prompt chunk read StepMetadata.seq_lens, copied to each stage's device
    once per micro-batch: `torch.tensor(seq_lens, device=cuda)` in every layer was a host sync each.
    Counts the tensors attention makes from host lists while a chunk with a rider runs (before: one
    per layer), and checks the rider's logits are those it gets decoding alone."""
    import sys

    from graphrt import LLM, SamplingParams
    from graphrt.kernels import paged_attention
    from graphrt.runtime.ring import build_inputs
    from graphrt.runtime.step import ScheduledStep

    llm = LLM(model=tiny_model_factory(num_layers=4), pp=2, kernels="torch", dtype="float64", kv_cache_tokens=1024, buckets=[1, 2])
    engine, greedy = llm.engine, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def forward(step: ScheduledStep) -> torch.Tensor:  # (seqs, vocab): each sequence's last-token logits
        token_ids, meta = build_inputs(step, engine.config.block_size)
        return engine.pipeline.forward(token_ids, meta, engine.graphs)

    rider = engine.add_request([5, 6, 7], greedy)
    prompt = engine.scheduler.schedule()
    engine.scheduler.update_from_output(prompt, [int(forward(prompt)[0].argmax())], 0.0)
    engine.add_request([9] * 20, greedy)
    chunk = engine.scheduler.schedule()
    assert chunk.is_prefill and chunk.seqs[0] is rider and chunk.query_lens[0] == 1

    made, real = [], torch.tensor

    def counting(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename == paged_attention.__file__:
            made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    in_chunk = forward(chunk)[0]
    monkeypatch.undo()
    assert made == [], f"attention made {len(made)} tensors from host lists for one chunk"
    alone = forward(ScheduledStep([rider], [1], is_prefill=False, starts=chunk.starts[:1]))[0]
    torch.testing.assert_close(in_chunk, alone, rtol=1e-9, atol=1e-9)
    engine.close()

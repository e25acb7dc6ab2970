"""The compiled CPU paged decode attention and KV writes against their torch references
(`paged_attention`).

The kernel is built on first use (kernels/cpu/extension.py, tested in test_cpu_extension.py);
where it can't be built, the tests that run it skip with the reason. Caches start as NaN and only
live context is written, so a kernel that reads past a sequence's length, a padded block-table
column or the scratch block returns NaN; the reference gets the NaNs zeroed (its mask hides
those positions, but NaN scores would still poison its softmax).
"""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.kernels import mla, paged_attention
from graphrt.kernels.cpu import paged_attention as paged_attention_cpu
from helpers import hf_model

needs_kernel = pytest.mark.usefixtures("built_cpu_kernels")  # tests/conftest.py

# heads, kv_heads, head_dim, block_size, seq_lens
CASES = {
    "smollm2-gqa3-one-token": (9, 3, 64, 16, [1]),
    "smollm2-gqa3-exact-blocks": (9, 3, 64, 16, [48]),
    "smollm2-gqa3-batch3": (9, 3, 64, 16, [1, 16, 37]),
    "smollm2-gqa3-batch32": (9, 3, 64, 16, [1 + (7 * row) % 130 for row in range(31)] + [128]),
    "mha4-block8": (4, 4, 64, 8, [8, 3, 41]),
    "gqa8-one-kv-head": (8, 1, 64, 16, [75, 2]),  # two tiles of 4 query heads
    "gqa5-head80-block5": (10, 2, 80, 5, [23, 5, 1]),  # a tile of 4 and one of 1; 5 vectors
    "gqa2-head20": (6, 3, 20, 16, [33, 17]),  # head_dim not a whole number of vectors (AVX2 or 512)
    "gqa2-head128": (4, 2, 128, 16, [130, 64]),  # more vectors than one register tile
    # 8 or more rows per thread (the `threads` fixture runs 1 and 2): a task is a sequence with all its KV heads.
    "smollm2-gqa3-batch12": (9, 3, 64, 16, [1 + (11 * row) % 90 for row in range(12)]),
    "gqa5-head80-block5-batch40": (10, 2, 80, 5, [1 + (7 * row) % 33 for row in range(40)]),
    "gqa2-head20-batch40": (6, 3, 20, 16, [1 + (5 * row) % 50 for row in range(40)]),
}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def decode_inputs(case: str, dtype: torch.dtype, seed: int = 0, cases: dict = CASES):
    """q, NaN-poisoned caches with context only up to seq_lens, shuffled block ids, and padded
    table columns pointing at block 0 (scratch, NaN too)."""
    heads, kv_heads, head_dim, block_size, seq_lens = cases[case]
    generator = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-seq_len // block_size) for seq_len in seq_lens]
    max_blocks = max(blocks_per_row) + 1  # one more column than any row needs
    num_blocks = 1 + sum(blocks_per_row) + 3  # scratch block 0, and a few never used
    free_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    for row, num_row_blocks in enumerate(blocks_per_row):
        block_tables[row, :num_row_blocks] = torch.tensor([free_ids.pop() for _ in range(num_row_blocks)])
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(2))
    for row, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        slots = block_tables[row, positions // block_size] * block_size + positions % block_size
        for cache in (k_cache, v_cache):
            context = torch.randn(seq_len, kv_heads, head_dim, generator=generator)
            cache.view(-1, kv_heads, head_dim)[slots] = context.to(dtype)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), head_dim**-0.5


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale, dtype=None):
    dtype = dtype or q.dtype
    q, k_cache, v_cache = (t.nan_to_num(0.0).to(dtype) for t in (q, k_cache, v_cache))
    return paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's thread count for the test: the kernel splits a batch of 8 or more rows per thread
    into one task per sequence, a shorter one into one per (sequence, KV head)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_reference(case, dtype, threads):
    inputs = decode_inputs(case, dtype)
    got = paged_attention_cpu.paged_decode_attention(*inputs)
    assert got.dtype == dtype and got.shape == inputs[0].shape
    torch.testing.assert_close(got, reference(*inputs), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernel
@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_is_float32_math_rounded_once(case, threads):
    """bfloat16 K/V/q widened on load, float32 math, one rounding at the end: within half a
    bfloat16 step of the float32 reference on the same (bfloat16) inputs, and close to the
    bfloat16 reference, which rounds along the way."""
    inputs = decode_inputs(case, torch.bfloat16)
    got = paged_attention_cpu.paged_decode_attention(*inputs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(*inputs, dtype=torch.float32), atol=1e-6, rtol=2**-8)
    torch.testing.assert_close(got, reference(*inputs), atol=1.6e-2, rtol=1.6e-2)


# Latent attention (MLA) as the decode kernel runs it: one KV head whose row is the latent and the
# rotary key; heads, latent_dim, rope_dim, block_size, seq_lens.
LATENT_CASES = {
    "deepseek-v3-row": (16, 512, 64, 16, [1, 17, 40]),  # DeepSeek-V3's 576-wide row
    "tiny-batch12": (8, 128, 32, 16, [1 + (7 * row) % 60 for row in range(12)]),  # the tiny test models' row
    "odd-block5": (3, 40, 8, 5, [23, 5, 1]),
}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", sorted(LATENT_CASES))
def test_latent_attention_on_the_decode_kernel_matches_the_reference(case, dtype, threads):
    heads, latent_dim, rope_dim, block_size, seq_lens = LATENT_CASES[case]
    shape = {case: (heads, 1, latent_dim + rope_dim, block_size, seq_lens)}
    q, cache, _, block_tables, lens, _ = decode_inputs(case, dtype, cases=shape)
    scale = 0.07
    got = paged_attention_cpu.paged_latent_decode_attention(q, cache, block_tables, lens, scale, latent_dim)
    assert got.shape == (len(seq_lens), heads, latent_dim) and got.dtype == dtype
    expected = mla.paged_latent_decode_attention(q, cache.nan_to_num(0.0), block_tables, lens, scale, latent_dim)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernel
@pytest.mark.parametrize("mode", ["compiled", "torch"])
def test_a_latent_attention_model_decodes_alike_on_either_decode_attention(tiny_model_factory, monkeypatch, mode):
    """A CPU stage's latent attention runs on the decode attention its timing chose: the compiled
    kernel, or the torch reference. Both give transformers' greedy tokens (float64, several blocks)."""
    model_dir = tiny_model_factory("deepseek-v3")
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", f"paged_decode_attention={mode}")
    llm = LLM(model=model_dir, pp=2, dtype="float64", kv_cache_tokens=512)
    stages = llm.engine.pipeline.stages
    expected_op = paged_attention_cpu.paged_latent_decode_attention if mode == "compiled" else mla.paged_latent_decode_attention
    assert all(stage.ops.paged_latent_decode_attention is expected_op for stage in stages)
    prompts = [[5, 9, 13], list(range(20, 45))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    llm.engine.close()
    hf = hf_model(model_dir, torch.float64)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert output.token_ids == ref[0, len(prompt):].tolist()


@needs_kernel
def test_max_seq_len_is_a_hint_the_kernel_does_not_need():
    q, k_cache, v_cache, block_tables, seq_lens, scale = decode_inputs("smollm2-gqa3-batch3", torch.float32)
    without = paged_attention_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    with_hint = paged_attention_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, int(seq_lens.max())
    )
    torch.testing.assert_close(with_hint, without, atol=0, rtol=0)
    expected = paged_attention.paged_decode_attention(
        q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), block_tables, seq_lens, scale, int(seq_lens.max())
    )
    torch.testing.assert_close(with_hint, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_int32_tables_and_a_strided_q_as_the_model_hands_them():
    q, k_cache, v_cache, block_tables, seq_lens, scale = decode_inputs("smollm2-gqa3-batch32", torch.float32)
    batch, heads, head_dim = q.shape
    qkv = torch.randn(batch, (heads + 6) * head_dim)  # q is a slice of the fused projection's rows
    qkv[:, : heads * head_dim] = q.view(batch, -1)
    strided_q = qkv[:, : heads * head_dim].view(batch, heads, head_dim)
    assert not strided_q.is_contiguous()
    got = paged_attention_cpu.paged_decode_attention(
        strided_q, k_cache, v_cache, block_tables.int(), seq_lens.int(), scale
    )
    expected = paged_attention_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@needs_kernel
@pytest.mark.parametrize("case", ["smollm2-gqa3-batch32", "smollm2-gqa3-batch12"])
def test_two_threads_give_the_same_bits_as_one(case):
    """A query head's whole context is one thread's work, so threads can't change results; nor can
    how the heads are split into tasks (12 rows: one task per sequence on one thread, one per
    sequence and KV head on two)."""
    inputs = decode_inputs(case, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_cpu.paged_decode_attention(*inputs)
        torch.set_num_threads(2)
        two = paged_attention_cpu.paged_decode_attention(*inputs)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(two, one, atol=0, rtol=0)


@needs_kernel
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda inputs: inputs.update(seq_lens=torch.tensor([0, 16, 37])), "seq_lens\\[0\\] is 0"),
        (lambda inputs: inputs.update(seq_lens=torch.tensor([1, 16, 65])), "seq_lens\\[2\\] is 65"),
        (lambda inputs: inputs["block_tables"].__setitem__((1, 0), 10_000), "block_tables\\[1, 0\\] is 10000"),
    ],
    ids=["empty-context", "longer-than-the-table", "block-out-of-range"],
)
def test_rows_that_would_read_outside_the_cache_are_refused(change, message):
    q, k_cache, v_cache, block_tables, seq_lens, scale = decode_inputs("smollm2-gqa3-batch3", torch.float32)
    inputs = {"block_tables": block_tables, "seq_lens": seq_lens}
    change(inputs)
    with pytest.raises(RuntimeError, match=message):
        paged_attention_cpu.paged_decode_attention(
            q, k_cache, v_cache, inputs["block_tables"], inputs["seq_lens"], scale
        )


def test_inputs_it_cannot_take_are_refused_before_the_kernel_runs():
    q, k_cache, v_cache, block_tables, seq_lens, scale = decode_inputs("smollm2-gqa3-batch3", torch.float32)
    with pytest.raises(ValueError, match="float16"):
        paged_attention_cpu.paged_decode_attention(
            q.half(), k_cache.half(), v_cache.half(), block_tables, seq_lens, scale
        )
    with pytest.raises(ValueError, match="share one of"):
        paged_attention_cpu.paged_decode_attention(q, k_cache.double(), v_cache, block_tables, seq_lens, scale)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_attention_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables.float(), seq_lens, scale)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_cpu.paged_decode_attention(q[0], k_cache, v_cache, block_tables, seq_lens, scale)


def kv_write_inputs(dtype: torch.dtype):
    """k, v as a layer hands them (head rows of a wider qkv row), NaN caches of 5 blocks of 4, and
    7 slots out of order, in every block, the scratch block 0 among them."""
    generator = torch.Generator().manual_seed(0)
    tokens, kv_heads, head_dim = 7, 3, 20
    qkv = torch.randn(tokens, 9 * head_dim, generator=generator).to(dtype)
    k = qkv[:, 3 * head_dim : 6 * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 6 * head_dim :].view(tokens, kv_heads, head_dim)
    caches = [torch.full((5, 4, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(2)]
    slots = torch.tensor([13, 2, 19, 5, 8, 0, 11])
    return k, v, *caches, slots


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kv_writes_fill_exactly_the_slots_the_reference_fills(dtype):
    k, v, k_cache, v_cache, slots = kv_write_inputs(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    paged_attention.write_kv(k, v, expected_k, expected_v, slots)
    paged_attention_cpu.write_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)
    assert (~k_cache.isnan()).sum() == 7 * 3 * 20  # exactly the seven slots' rows


@needs_kernel
def test_kv_writes_take_int32_slots_and_refuse_float_ones():
    k, v, k_cache, v_cache, slots = kv_write_inputs(torch.float32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    paged_attention.write_kv(k, v, expected_k, expected_v, slots)
    paged_attention_cpu.write_kv(k, v, k_cache, v_cache, slots.int())
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="slot_mapping must be \\(tokens,\\) int64 or int32"):
        paged_attention_cpu.write_kv(k, v, k_cache, v_cache, slots.float())


@needs_kernel
def test_a_kv_write_to_a_slot_outside_the_cache_raises_and_writes_nothing():
    k, v, k_cache, v_cache, slots = kv_write_inputs(torch.float32)
    slots[-1] = 20  # 5 blocks of 4: slots 0..19
    with pytest.raises(IndexError, match=r"slot_mapping\[6\] is 20, not a slot of the 20-slot cache"):
        paged_attention_cpu.write_kv(k, v, k_cache, v_cache, slots)
    assert k_cache.isnan().all() and v_cache.isnan().all()
    with pytest.raises(RuntimeError, match="one dtype"):
        paged_attention_cpu.write_kv(k.double(), v, k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="holds 3 heads of 20"):
        paged_attention_cpu.write_kv(k[:, :2], v[:, :2], k_cache, v_cache, slots)

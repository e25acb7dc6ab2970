"""MLA's Triton decode attention (kernels/mla_triton.py) against its torch reference (kernels/mla.py),
and the reference against the contract written out as a float64 loop.

Without a GPU the kernel runs through Triton's interpreter (`TRITON_INTERPRET=1`, set before the
kernel module is imported); the interpreter computes bfloat16 wrongly, so bfloat16 is checked only
on CUDA. Latent and rope widths (16, 40; 8, 12) are not powers of two, heads (1, 3, 16, 20, 36) not
all multiples of the kernel's head tile (16, or 32 past 16 heads in 16 bits), and contexts end
mid-block, on a block's edge or at one token. Cache slots past each context hold NaN, so a read
beyond seq_lens fails; outputs start as NaN, so an element nobody writes fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from graphrt.kernels import mla, mla_triton, torch_ops, triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(mla_triton._latent_decode_split_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError("graphrt.kernels.mla_triton was imported before TRITON_INTERPRET=1 was set; these tests need it")
DTYPES = [
    pytest.param(dtype, id=str(dtype).removeprefix("torch."))
    for dtype in [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol, outputs of size < 1

CASES = {  # heads, latent_dim, rope_dim, block_size, seq_lens
    "h1-latent16-rope8-block4": (1, 16, 8, 4, [1, 4, 13]),  # one token, exactly a block, odd
    "h3-latent40-rope12-block16": (3, 40, 12, 16, [16, 37]),
    "h16-latent16-rope12-block16": (16, 16, 12, 16, [5, 48]),  # one whole head tile
    "h20-latent40-rope8-block4": (20, 40, 8, 4, [1, 70]),  # 18 blocks
    "h36-latent16-rope8-block16": (36, 16, 8, 16, [3, 29]),  # a last head tile of 4 heads (of 16 or 32)
}


def latent_inputs(heads, latent_dim, rope_dim, block_size, seq_lens, dtype, table_blocks=None, seed=0):
    """q, a NaN-poisoned cache holding rows only up to seq_lens, shuffled block tables (int32, one spare
    column, or `table_blocks` wide as a graph's max_model_len table), seq_lens, scale, latent_dim."""
    row_dim = latent_dim + rope_dim
    max_blocks = table_blocks or -(-max(seq_lens) // block_size) + 1
    num_blocks = 1 + len(seq_lens) * max_blocks
    generator = torch.Generator().manual_seed(seed)
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(len(seq_lens), max_blocks)
    cache = torch.full((num_blocks, block_size, 1, row_dim), float("nan"), dtype=dtype)
    for row, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        slots = tables[row, positions // block_size] * block_size + positions % block_size
        cache.view(-1, 1, row_dim)[slots] = torch.randn(seq_len, 1, row_dim, generator=generator).to(dtype)
    q = torch.randn(len(seq_lens), heads, row_dim, generator=generator).to(dtype)
    seq_lens = torch.tensor(seq_lens)
    return q.to(DEVICE), cache.to(DEVICE), tables.int().to(DEVICE), seq_lens.to(DEVICE), row_dim**-0.5, latent_dim


def reference(q, cache, tables, seq_lens, scale, latent_dim, max_seq_len=None) -> torch.Tensor:
    """kernels/mla.py on the cache with its NaN padding zeroed (the reference gathers whole blocks)."""
    return mla.paged_latent_decode_attention(q, cache.nan_to_num(0.0), tables, seq_lens, scale, latent_dim, max_seq_len)


def latent_attention_loop(q, cache, tables, seq_lens, scale, latent_dim) -> torch.Tensor:
    """The contract in float64, one sequence at a time: softmax(q . row * scale) @ row[:latent_dim]."""
    block_size = cache.shape[1]
    outputs = []
    for seq, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len)
        slots = tables[seq].cpu().long()[positions // block_size] * block_size + positions % block_size
        rows = cache.cpu().double().view(-1, cache.shape[-1])[slots]  # (seq_len, latent + rope)
        probs = torch.softmax(q[seq].cpu().double() @ rows.T * scale, dim=-1)  # (heads, seq_len)
        outputs.append(probs @ rows[:, :latent_dim])
    return torch.stack(outputs)  # (batch, heads, latent)


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty hands out NaN-filled memory, so an output element nobody writes fails."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))


def test_the_reference_is_the_contract():
    """kernels/mla.py (through the dense paged attention over a view of the cache) against the loop."""
    for case in ("h3-latent40-rope12-block16", "h20-latent40-rope8-block4"):
        inputs = latent_inputs(*CASES[case], torch.float32, seed=1)
        expected = latent_attention_loop(*inputs)
        torch.testing.assert_close(reference(*inputs).cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_the_kernel_is_the_contract_in_float64(poisoned_empty):
    """float64 stays float64 throughout: the kernel agrees with the loop to rounding (int64 block tables here)."""
    q, cache, tables, *rest = latent_inputs(*CASES["h20-latent40-rope8-block4"], torch.float64, seed=2)
    inputs = (q, cache, tables.long(), *rest)
    got = mla_triton.paged_latent_decode_attention(*inputs, num_splits=3)
    torch.testing.assert_close(got.cpu(), latent_attention_loop(*inputs), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_latent_decode_attention_matches_reference(poisoned_empty, dtype, case):
    inputs = latent_inputs(*CASES[case], dtype)
    assert_matches(mla_triton.paged_latent_decode_attention(*inputs), reference(*inputs))


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_splits_of_a_graph_wide_table_merge_to_the_reference(poisoned_empty, dtype, num_splits):
    """A table 64 blocks (256 tokens) wide, as a graph captured for a long max_model_len holds, over
    contexts of 1, 70 tokens: some splits of the short one read nothing and must weigh nothing."""
    inputs = latent_inputs(*CASES["h20-latent40-rope8-block4"], dtype, table_blocks=64, seed=3)
    got = mla_triton.paged_latent_decode_attention(*inputs, num_splits=num_splits)
    assert_matches(got, reference(*inputs))


def test_a_one_token_context_returns_that_rows_latent_columns():
    """All the weight on one row: the output is its first latent_dim columns, not its rope columns."""
    q, cache, tables, _, scale, latent_dim = latent_inputs(*CASES["h3-latent40-rope12-block16"], torch.float32, seed=4)
    one_token = torch.ones(2, dtype=torch.int64, device=DEVICE)
    got = mla_triton.paged_latent_decode_attention(q, cache, tables, one_token, scale, latent_dim)
    first_rows = cache[tables[:, 0].long(), 0, 0, :latent_dim]  # (batch, latent): each sequence's token 0
    torch.testing.assert_close(got, first_rows[:, None, :].expand_as(got), atol=0, rtol=0)


def test_the_rope_columns_score():
    """With the query's latent part zero, only the rope columns score: two rows whose rope keys are
    +-10 x head 0's rope query give head 0 the first row's latent columns, not their average."""
    q, cache, tables, _, scale, latent_dim = latent_inputs(*CASES["h3-latent40-rope12-block16"], torch.float32, seed=5)
    q[:, :, :latent_dim] = 0.0
    first, second = (cache[tables[:, 0].long(), token, 0] for token in (0, 1))  # (batch, latent + rope) copies
    first[:, latent_dim:], second[:, latent_dim:] = 10 * q[:, 0, latent_dim:], -10 * q[:, 0, latent_dim:]
    cache[tables[:, 0].long(), 0, 0], cache[tables[:, 0].long(), 1, 0] = first, second
    got = mla_triton.paged_latent_decode_attention(q, cache, tables, torch.full((2,), 2, device=DEVICE), scale, latent_dim)
    torch.testing.assert_close(got[:, 0], first[:, :latent_dim], atol=1e-5, rtol=1e-5)


def test_host_max_seq_len_is_ignored(poisoned_empty):
    """A captured graph replays with other lengths than it was recorded with; the host hint must not matter."""
    inputs = latent_inputs(*CASES["h3-latent40-rope12-block16"], torch.float32)
    with_hint = mla_triton.paged_latent_decode_attention(*inputs, max_seq_len=1)
    torch.testing.assert_close(with_hint, mla_triton.paged_latent_decode_attention(*inputs), atol=0, rtol=0)


def test_the_triton_set_runs_it_beside_the_torch_sets_reference():
    assert triton_ops.TRITON.paged_latent_decode_attention is mla_triton.paged_latent_decode_attention
    inputs = latent_inputs(*CASES["h16-latent16-rope12-block16"], torch.float32, seed=5)
    inputs = (inputs[0], inputs[1].nan_to_num(0.0), *inputs[2:])
    assert_matches(triton_ops.TRITON.paged_latent_decode_attention(*inputs),
                   torch_ops.TORCH.paged_latent_decode_attention(*inputs))


def test_a_cache_of_another_shape_is_refused_with_the_expected_one():
    q, cache, tables, seq_lens, scale, latent_dim = latent_inputs(*CASES["h3-latent40-rope12-block16"], torch.float32)
    with pytest.raises(ValueError, match=r"expected a cache of \(num_blocks, block_size, 1, 52\)"):
        mla_triton.paged_latent_decode_attention(q, cache[..., :latent_dim], tables, seq_lens, scale, latent_dim)
    with pytest.raises(ValueError, match="latent_dim <= 52"):
        mla_triton.paged_latent_decode_attention(q, cache, tables, seq_lens, scale, 60)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_splits", [None, 1])
def test_a_captured_launch_replays_new_lengths(num_splits):
    """DeepSeek-V3's widths (512 + 64) and 128 heads in bfloat16, with a graph's int64 block tables
    163840 tokens wide (scratch block 0 past the live blocks): one capture at length 1 serves longer
    contexts. The default at batch 4 is 17 splits, one of the variants scripts/triton_aot.py compiles."""
    q, cache, tables, seq_lens, scale, latent_dim = latent_inputs(128, 512, 64, 16, [1, 300, 1000, 17], torch.bfloat16,
                                                                  seed=6)
    tables = torch.nn.functional.pad(tables.long(), (0, 163840 // 16 - tables.shape[1]))
    static_lens = torch.ones_like(seq_lens)

    def decode():
        return mla_triton.paged_latent_decode_attention(q, cache, tables, static_lens, scale, latent_dim, num_splits=num_splits)

    decode()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    static_lens.copy_(seq_lens)
    graph.replay()
    assert_matches(out, reference(q, cache, tables, seq_lens, scale, latent_dim, max_seq_len=1000))  # 63 blocks, not 10240

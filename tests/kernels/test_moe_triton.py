"""The Triton fused-MoE kernel (kernels/moe_triton.py) against the semantics written out as a loop.

Without a GPU the kernels run through Triton's interpreter (`TRITON_INTERPRET=1`, set before the
kernel module is imported). Its tl.dot computes bfloat16 wrongly (a bare 16x16 bfloat16 dot is off
by 1e10 under triton 3.9's interpreter), so bfloat16 is checked only on CUDA. The reference is a
per-token, per-choice loop in float64; hidden 48 and inter 40 leave partial tiles, and the expert
counts (1, 3, 8, 60) rarely fill a block, so most blocks end in padding.
"""

from __future__ import annotations

import os

import numpy
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from graphrt.kernels import moe, moe_triton  # noqa: E402
from graphrt.kernels.moe_triton import MoeTiles, fused_moe, max_num_blocks, moe_align, moe_align_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = type(moe_triton._gate_up_kernel).__name__ == "InterpretedFunction"
if DEVICE == "cpu" and not INTERPRETED:
    raise RuntimeError("graphrt.kernels.moe_triton was imported before TRITON_INTERPRET=1 was set; these tests need it")
HIDDEN_SIZE, INTER_SIZE = 48, 40
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# Against a float64 loop: float32 differs by summation order; 16-bit by the rounding of hidden, the
# weights' products and silu(gate) * up, which the kernel stores in the input dtype between the GEMMs.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # atol = rtol, outputs of size ~1


def expert_mlp_loop(hidden, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * W_down[e] @ (silu(W_gate[e] @ x_t) * (W_up[e] @ x_t)), e = ids[t, k], in float64."""
    inter_size = w_down.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        x = hidden[token].cpu().double()  # (hidden,)
        for choice in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, choice])
            w_gate = w_gate_up[expert, :inter_size].cpu().double()  # (inter, hidden)
            w_up = w_gate_up[expert, inter_size:].cpu().double()
            act = torch.nn.functional.silu(w_gate @ x) * (w_up @ x)  # (inter,)
            out[token] += float(topk_weights[token, choice]) * (w_down[expert].cpu().double() @ act)
    return out


def moe_inputs(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    """hidden, weights scaled so outputs are of size ~1, and routing with repeats allowed (randint)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN_SIZE, generator=generator)
    w_gate_up = torch.randn(num_experts, 2 * INTER_SIZE, HIDDEN_SIZE, generator=generator) / HIDDEN_SIZE**0.5
    w_down = torch.randn(num_experts, HIDDEN_SIZE, INTER_SIZE, generator=generator) / INTER_SIZE**0.5
    topk_weights = torch.rand(num_tokens, top_k, generator=generator)
    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator)
    activations = (t.to(device=DEVICE, dtype=dtype) for t in (hidden, w_gate_up, w_down))
    return (*activations, topk_weights.to(DEVICE), topk_ids.to(DEVICE))  # routing stays float32 / int64


def assert_matches_loop(got: torch.Tensor, inputs) -> None:
    tol = TOLERANCE[got.dtype]
    assert got.dtype == inputs[0].dtype and got.shape == inputs[0].shape
    torch.testing.assert_close(got.cpu().double(), expert_mlp_loop(*inputs), atol=tol, rtol=tol)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled memory, so an output element nobody writes fails."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


CASES = [  # tokens, experts, top_k
    pytest.param(1, 1, 1, id="T1-E1-top1"),
    pytest.param(2, 8, 2, id="T2-E8-top2"),
    pytest.param(7, 3, 8, id="T7-E3-top8-repeats-forced"),
    pytest.param(33, 1, 2, id="T33-E1-top2-one-expert-twice"),
    pytest.param(33, 60, 8, id="T33-E60-top8"),
    pytest.param(64, 8, 2, id="T64-E8-top2"),
    pytest.param(64, 60, 1, id="T64-E60-top1"),
]


@pytest.mark.parametrize("num_tokens, num_experts, top_k", CASES)
def test_fused_moe_matches_the_loop_in_float32(poisoned_empty, num_tokens, num_experts, top_k):
    inputs = moe_inputs(num_tokens, num_experts, top_k, torch.float32, seed=num_tokens * 100 + num_experts)
    assert_matches_loop(fused_moe(*inputs), inputs)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(7, 3, 8), (33, 60, 2)])
def test_fused_moe_matches_the_loop_in_16_bits(poisoned_empty, dtype, num_tokens, num_experts, top_k):
    inputs = moe_inputs(num_tokens, num_experts, top_k, dtype, seed=num_tokens)
    assert_matches_loop(fused_moe(*inputs), inputs)


@pytest.mark.parametrize(
    "tiles",
    [
        pytest.param(MoeTiles(block_m=16, block_n=16, block_k=16), id="several-n-tiles-and-k-steps"),
        pytest.param(MoeTiles(block_m=64, block_n=32, block_k=32), id="prefill-sized-blocks"),
    ],
)
def test_fused_moe_with_other_tiles(poisoned_empty, tiles):
    inputs = moe_inputs(33, 8, 2, torch.float32, seed=5)
    assert_matches_loop(fused_moe(*inputs, tiles=tiles), inputs)


@pytest.mark.parametrize("num_tokens", [3, 33])
def test_another_expert_ranks_pairs_add_nothing(poisoned_empty, num_tokens):
    """Under --ep a pair whose expert another rank holds comes as id num_experts (one past the last),
    at weight 0: moe_align drops it and its output row stays zero, as if the pair were not there."""
    hidden, w_gate_up, w_down, topk_weights, topk_ids = moe_inputs(num_tokens, 6, 4, torch.float32, seed=num_tokens)
    elsewhere = torch.rand(topk_ids.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) < 0.5
    elsewhere[0] = True  # a token all of whose experts are elsewhere: its output is exactly zero
    got = fused_moe(hidden, w_gate_up, w_down, torch.where(elsewhere, 0.0, topk_weights), torch.where(elsewhere, 6, topk_ids))
    assert_matches_loop(got, (hidden, w_gate_up, w_down, torch.where(elsewhere, 0.0, topk_weights), topk_ids))
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_a_row_choosing_one_expert_twice_gets_both_weights():
    hidden, w_gate_up, w_down, _, _ = moe_inputs(5, 4, 2, torch.float32, seed=9)
    topk_ids = torch.tensor([[2, 2], [0, 3], [3, 3], [1, 1], [2, 0]], device=DEVICE)
    topk_weights = torch.tensor([[0.25, 0.5], [1.0, 0.0], [0.5, 0.5], [0.1, 0.9], [0.3, 0.7]], device=DEVICE)
    inputs = (hidden, w_gate_up, w_down, topk_weights, topk_ids)
    got = fused_moe(*inputs)
    assert_matches_loop(got, inputs)
    # Row 2 picks expert 3 twice at 0.5 each: the same as once at weight 1.
    once = fused_moe(hidden[2:3], w_gate_up, w_down, torch.ones(1, 1, device=DEVICE), topk_ids[2:3, :1])
    torch.testing.assert_close(got[2:3], once, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k",
    [pytest.param(2, 8, 2, id="fewer-pairs-than-experts"), pytest.param(33, 8, 2, id="every-expert-form")],
)
def test_fused_moe_matches_the_torch_reference(num_tokens, num_experts, top_k):
    """The kernel set's twin (`moe.fused_moe`), in both of its static-shape forms."""
    inputs = moe_inputs(num_tokens, num_experts, top_k, torch.float32, seed=num_tokens + 40)
    torch.testing.assert_close(fused_moe(*inputs), moe.fused_moe(*inputs), atol=1e-5, rtol=1e-5)


# -- alignment --------------------------------------------------------------------------------------


ALIGN_CASES = [  # tokens, experts, top_k, block_m
    (1, 1, 1, 16),
    (2, 3, 2, 16),
    (7, 3, 8, 16),
    (33, 60, 8, 16),  # 264 pairs: five chunks of the alignment kernels, the last one partial
    (64, 8, 2, 64),
    (64, 60, 8, 16),
    (64, 256, 8, 16),  # DeepSeek-V3's expert count
]


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_experts, (num_tokens, top_k), generator=generator).to(DEVICE)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", ALIGN_CASES)
def test_moe_align_equals_its_reference(num_tokens, num_experts, top_k, block_m):
    topk_ids = routing(num_tokens, num_experts, top_k, seed=num_tokens + num_experts)
    got, expected = moe_align(topk_ids, num_experts, block_m), moe_align_reference(topk_ids, num_experts, block_m)
    for name in ("sorted_pair_ids", "block_experts", "num_valid_blocks"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", ALIGN_CASES)
def test_the_aligned_layout_holds_every_pair_once_in_its_experts_blocks(num_tokens, num_experts, top_k, block_m):
    """What the layout must be, checked on the reference with plain Python."""
    topk_ids = routing(num_tokens, num_experts, top_k, seed=num_tokens * 3 + num_experts)
    blocks = moe_align_reference(topk_ids, num_experts, block_m)
    pair_experts = topk_ids.reshape(-1).tolist()
    num_pairs = len(pair_experts)
    slots = blocks.sorted_pair_ids.tolist()
    block_experts = blocks.block_experts.tolist()
    num_valid = int(blocks.num_valid_blocks)
    counts = [pair_experts.count(e) for e in range(num_experts)]
    assert num_valid == sum(-(-c // block_m) for c in counts)
    assert len(block_experts) == max_num_blocks(num_pairs, num_experts, block_m)
    assert len(slots) == len(block_experts) * block_m
    assert block_experts[num_valid:] == [-1] * (len(block_experts) - num_valid)
    assert all(s == num_pairs for s in slots[num_valid * block_m:])
    assert block_experts[:num_valid] == sorted(block_experts[:num_valid])  # experts in order, each run whole
    for block, expert in enumerate(block_experts[:num_valid]):
        pairs = [p for p in slots[block * block_m:(block + 1) * block_m] if p != num_pairs]
        assert pairs, f"block {block} is in use but holds no pair: its expert's weights would be read for nothing"
        assert all(pair_experts[p] == expert for p in pairs)
    real = [p for p in slots if p != num_pairs]
    assert real == sorted(real, key=lambda p: pair_experts[p])  # each expert's pairs in pair order (stable)
    assert sorted(real) == list(range(num_pairs))


def test_the_alignment_buffers_do_not_depend_on_the_routing():
    """One captured launch must serve every routing: the shapes come from (T, K, E, block) alone, and
    the bound is reached when every pair has an expert of its own."""
    num_tokens, top_k, num_experts = 8, 2, 16
    spread = torch.arange(16, device=DEVICE).view(num_tokens, top_k)  # 16 experts, one pair each: 16 blocks
    together = torch.zeros(num_tokens, top_k, dtype=torch.int64, device=DEVICE)  # one expert: 1 block
    layouts = [moe_align(ids, num_experts, 16) for ids in (spread, together)]
    assert [tuple(b.sorted_pair_ids.shape) for b in layouts] == [(16 * 16,)] * 2
    assert [tuple(b.block_experts.shape) for b in layouts] == [(16,)] * 2
    assert [int(b.num_valid_blocks) for b in layouts] == [16, 1]


# -- what is read ---------------------------------------------------------------------------------


def unchosen_experts(topk_ids: torch.Tensor, num_experts: int) -> list[int]:
    return sorted(set(range(num_experts)) - set(topk_ids.reshape(-1).tolist()))


def test_unchosen_experts_may_hold_nan():
    hidden, w_gate_up, w_down, topk_weights, _ = moe_inputs(7, 12, 2, torch.float32, seed=11)
    topk_ids = torch.tensor([[0, 5], [5, 5], [9, 0], [0, 9], [5, 0], [9, 9], [0, 0]], device=DEVICE)
    clean = fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    unchosen = unchosen_experts(topk_ids, 12)  # 9 of the 12
    w_gate_up[unchosen], w_down[unchosen] = float("nan"), float("nan")
    poisoned = fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    assert poisoned.isfinite().all()
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)  # the same bits: nothing of theirs was used


def between_guards(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight as a view into a NaN-filled buffer one expert longer at each end, that buffer): a
    read of expert -1 or num_experts, as a padding block might make, lands in the buffer too."""
    guarded = torch.full((weight.shape[0] + 2, *weight.shape[1:]), float("nan"), dtype=weight.dtype, device=weight.device)
    guarded[1:-1] = weight
    return guarded[1:-1], guarded


@pytest.mark.skipif(not INTERPRETED, reason="records the addresses each tl.load reads, which only the interpreter shows")
def test_only_the_chosen_experts_weights_are_read_once_per_block(monkeypatch):
    """Every element load the kernels make, by address: none falls in an unchosen expert's weights
    or just outside the weights, and each chosen expert's weights are read exactly once per block it
    has, so the blocks past the ones in use (sized for the worst routing) read nothing."""
    from triton.runtime.interpreter import InterpreterBuilder

    loaded: list = []
    real_load = InterpreterBuilder.create_masked_load

    def recording_load(self, ptrs, mask, other, *args, **kwargs):
        loaded.append(ptrs.data[mask.data].copy())  # only the lanes the mask lets through touch memory
        return real_load(self, ptrs, mask, other, *args, **kwargs)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", recording_load)
    num_experts, block_m = 10, 16
    hidden, w_gate_up, w_down, topk_weights, _ = moe_inputs(20, num_experts, 2, torch.float32, seed=13)
    (w_gate_up, gate_up_buffer), (w_down, down_buffer) = between_guards(w_gate_up), between_guards(w_down)
    # Expert 2 gets 19 pairs (two blocks), 7 gets 20 (two), 4 gets one: 5 blocks of the 11 allocated.
    topk_ids = torch.tensor([[2, 7]] * 19 + [[7, 4]], device=DEVICE)
    assert max_num_blocks(topk_ids.numel(), num_experts, block_m) == 11
    out = fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids, tiles=MoeTiles(block_m, 32, 16))
    assert out.isfinite().all()
    addresses = torch.from_numpy(numpy.concatenate(loaded).astype(numpy.int64))
    blocks_per_expert = {2: 2, 7: 2, 4: 1}
    for buffer in (gate_up_buffer, down_buffer):
        expert_bytes = buffer[0].numel() * buffer.element_size()
        start = buffer.data_ptr()
        inside = addresses[(addresses >= start) & (addresses < start + buffer.numel() * buffer.element_size())]
        reads = torch.bincount((inside - start) // expert_bytes, minlength=num_experts + 2).tolist()  # guard, experts, guard
        assert reads == [0] + [blocks_per_expert.get(e, 0) * buffer[0].numel() for e in range(num_experts)] + [0]


def test_fused_moe_says_which_shape_is_wrong():
    hidden, w_gate_up, w_down, topk_weights, topk_ids = moe_inputs(3, 4, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"w_down is \(4, 40, 48\), expected \(4, 48, 40\)"):
        fused_moe(hidden, w_gate_up, w_down.transpose(1, 2), topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(hidden, w_gate_up, w_down, topk_weights[:, :1], topk_ids)
    with pytest.raises(ValueError, match="power of two"):
        MoeTiles(block_m=24, block_n=64, block_k=64)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_a_captured_fused_moe_replays_new_routings():
    """Static buffers, no host sync: one capture serves routings it never saw, bit for bit as eager."""
    hidden, w_gate_up, w_down, topk_weights, topk_ids = moe_inputs(33, 60, 8, torch.bfloat16, seed=21)
    fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    for seed in (22, 23):
        new_hidden, _, _, new_weights, new_ids = moe_inputs(33, 60, 8, torch.bfloat16, seed=seed)
        hidden.copy_(new_hidden), topk_weights.copy_(new_weights), topk_ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids), atol=0, rtol=0)

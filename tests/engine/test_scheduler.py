"""The scheduler's decisions, and the host-side tensors one scheduled step carries (build_inputs)."""

from __future__ import annotations

from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.sequence import Sequence
from graphrt.model import SCRATCH_BLOCK
from graphrt.runtime.ring import build_inputs
from graphrt.runtime.step import ScheduledStep
from graphrt.sampling_params import SamplingParams

BLOCK = 4


def sequence(prompt_len: int, outputs: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(request_id=0, prompt_ids=list(range(100, 100 + prompt_len)), params=SamplingParams(), max_tokens=64)
    seq.output_ids, seq.block_ids = list(outputs), list(blocks)
    return seq


def test_a_decode_step_carries_live_blocks_only_and_feed_placeholders():
    # 6 prompt tokens + 1 known output: its next input is that output, at position 6.
    known = sequence(6, [7], blocks=[3, 5, 9, 11, 12])
    known.num_computed = 6
    # 2 prompt tokens + 2 outputs, the second still on the device at feed index 21.
    awaiting = sequence(2, [8], blocks=[4, 6, 10])
    awaiting.request_id, awaiting.num_computed, awaiting.num_output_placeholders = 1, 3, 1
    token_ids, meta = build_inputs(ScheduledStep([known, awaiting], [1, 1], is_prefill=False), BLOCK, feed_indices={1: 21})

    assert token_ids.tolist() == [7, -1 - 21]
    assert meta.positions.tolist() == [6, 3]
    assert meta.slot_mapping.tolist() == [5 * BLOCK + 2, 4 * BLOCK + 3]
    assert meta.seq_lens.tolist() == [7, 4] and meta.seq_lens_host == [7, 4]
    assert meta.logits_indices.tolist() == [0, 1]
    # Contexts of 7 and 4 tokens reach 2 and 1 blocks, whatever their budgets hold.
    assert meta.block_tables.tolist() == [[3, 5], [4, SCRATCH_BLOCK]]
    assert not meta.is_prefill


def test_a_prefill_chunk_with_a_rider():
    rider = sequence(3, [42], blocks=[2, 8])
    rider.num_computed = 3
    prompt = sequence(9, [], blocks=[1, 7, 13])
    prompt.num_computed = 4
    token_ids, meta = build_inputs(ScheduledStep([rider, prompt], [1, 5], is_prefill=True), BLOCK)

    assert token_ids.tolist() == [42, 104, 105, 106, 107, 108]
    assert meta.positions.tolist() == [3, 4, 5, 6, 7, 8]
    assert meta.logits_indices.tolist() == [0, 5]
    assert meta.query_lens == [1, 5]
    assert meta.block_tables.tolist() == [[2, SCRATCH_BLOCK, SCRATCH_BLOCK], [1, 7, 13]]


def test_async_scheduling_takes_rows_whose_token_comes_no_later_than_the_slots_last_micro_batch():
    from graphrt.engine.scheduler import Scheduler

    earlier, follows, later = 3, 5, 8  # step ids, in launch order

    def decoding(pending, in_flight=1, outputs=1, max_tokens=64) -> Sequence:
        """`pending`: the id of the step sampling its newest token, None if that token is back."""
        seq = sequence(4, [1] * outputs, blocks=[1, 2])
        seq.num_computed = 4 + outputs - (0 if pending is not None else 1)
        seq.num_in_flight, seq.max_tokens = in_flight, max_tokens
        if pending is not None:
            seq.num_output_placeholders, seq.sampling_step = 1, pending
        return seq

    can_decode = Scheduler(BlockAllocator(num_blocks=4, block_size=4), 4, 16, 64, 4)._can_decode
    assert can_decode(decoding(None, in_flight=0), follows=None)
    assert can_decode(decoding(earlier), follows)
    assert can_decode(decoding(follows), follows)
    assert not can_decode(decoding(later), follows)  # would wait for a micro-batch that ends later
    assert not can_decode(decoding(follows), follows=None)  # an empty slot waits for nothing
    assert not can_decode(decoding(earlier, in_flight=2), follows)
    # The step in flight samples token 3 of 3: no step may be launched after it.
    assert not can_decode(decoding(follows, outputs=2, max_tokens=3), follows)
    assert can_decode(decoding(follows, outputs=2, max_tokens=4), follows)
    # A verify step in flight: how many of its drafts it keeps is known on the host only.
    verifying = decoding(follows)
    verifying.draft_ids = [7, 8]
    assert not can_decode(verifying, follows)


def test_a_full_cache_preempts_the_youngest_idle_sequence_even_mid_prompt():
    from graphrt.engine.block_allocator import BlockAllocator
    from graphrt.engine.scheduler import Scheduler

    allocator = BlockAllocator(num_blocks=4, block_size=BLOCK)  # 3 usable blocks of 4 tokens
    scheduler = Scheduler(allocator, max_num_seqs=8, prefill_chunk_size=16, max_model_len=64, max_decode_batch=8)
    old = sequence(3, [7, 8], blocks=allocator.allocate(1))
    old.num_computed = 4  # its next position, 4, starts a second block
    young = sequence(8, [], blocks=allocator.allocate(2))
    young.request_id, young.num_computed = 1, 4  # half-way through its prompt, nothing in flight
    scheduler.running += [old, young]
    assert allocator.num_free == 0

    step = scheduler.schedule()
    # The prompt chunk would have carried `old` along; instead `young` gave its blocks back, and
    # with no prompt left to prefill `old` decodes alone.
    assert step is not None and step.seqs == [old] and not step.is_prefill
    assert len(old.block_ids) == 2 and young.block_ids == [] and young.num_computed == 0
    assert list(scheduler.waiting) == [young] and young.prefill_len == 8 and scheduler.num_preemptions == 1


def test_an_older_sequence_waits_for_a_busy_younger_one_rather_than_give_its_blocks_up():
    from graphrt.engine.block_allocator import BlockAllocator
    from graphrt.engine.scheduler import Scheduler

    allocator = BlockAllocator(num_blocks=4, block_size=BLOCK)  # 3 usable blocks of 4 tokens
    scheduler = Scheduler(allocator, max_num_seqs=8, prefill_chunk_size=16, max_model_len=64, max_decode_batch=8)
    old = sequence(3, [7, 8], blocks=allocator.allocate(1))
    old.num_computed = 4  # needs a second block
    young = sequence(3, [9], blocks=allocator.allocate(2))
    young.request_id, young.num_computed, young.num_in_flight = 1, 4, 1  # in another slot's micro-batch
    scheduler.running += [old, young]

    assert scheduler.schedule(num_slots=2) is None  # old waits; young has nothing to run yet
    assert scheduler.num_preemptions == 0 and len(old.block_ids) == 1 and old in scheduler.running

    young.num_in_flight = 0  # read back: now it can give its blocks up, and it is the younger one
    step = scheduler.schedule(num_slots=2)
    assert step is not None and step.seqs == [old] and len(old.block_ids) == 2
    assert list(scheduler.waiting) == [young] and scheduler.num_preemptions == 1


def test_preempted_sequences_wait_in_arrival_order_and_an_open_max_tokens_fits_the_cache():
    from graphrt.engine.block_allocator import BlockAllocator
    from graphrt.engine.scheduler import Scheduler

    allocator = BlockAllocator(num_blocks=11, block_size=BLOCK)  # 40 tokens of cache
    scheduler = Scheduler(allocator, max_num_seqs=8, prefill_chunk_size=16, max_model_len=64, max_decode_batch=8)
    # No max_tokens: as many as the cache (not the 64-token context) holds.
    assert scheduler.check(prompt_len=10, max_tokens=None) == 30
    seqs = [sequence(2, [], blocks=allocator.allocate(1)) for _ in range(3)]
    for request_id, seq in enumerate(seqs):
        seq.request_id = request_id
        scheduler.running.append(seq)
    newcomer = sequence(2, [], blocks=[])
    newcomer.request_id = 9
    scheduler.add(newcomer)
    scheduler._preempt(seqs[1])
    scheduler._preempt(seqs[2])
    scheduler._preempt(seqs[0])
    assert [s.request_id for s in scheduler.waiting] == [0, 1, 2, 9]

"""Which sequences run in the next micro-batch, and the metadata it needs.

A micro-batch is either a prefill chunk (up to `prefill_chunk_size` tokens: prompt tokens from
one or more sequences plus one token for each decode row riding along; eager) or a decode batch
(one token per row, at most the largest bucket; replayed as a graph).

KV blocks are allocated as a sequence grows: on admission for its prompt and first new token,
then one block whenever its next position starts a new one. When none is free, the youngest
sequence with nothing in flight gives its blocks back and waits to be recomputed (its prompt and
every token it has so far are prefilled again, and it goes on where it was), as vLLM does; an
older sequence is never preempted for a younger one (it waits for the younger ones to stop at a
block boundary). A request must fit the cache alone (`check`), so the oldest always makes progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphrt.batch import StepMetadata
from graphrt.errors import RequestError
from graphrt.kv_cache import SCRATCH_BLOCK, BlockAllocator
from graphrt.sequence import Sequence

if TYPE_CHECKING:
    from graphrt.ring import MicroBatch


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    query_lens: list[int]  # tokens each sequence feeds in this step
    is_prefill: bool

    def build(self, block_size: int, pin: bool = False) -> tuple[torch.Tensor, StepMetadata]:
        """Token ids and metadata on the host; the pipeline moves them to each stage. A token not
        read back yet is given as -1 - its index in the ring's token feed.

        `pin` puts them in page-locked memory, so the copies to a GPU are truly asynchronous (from
        pageable memory the driver may wait for the stream, and the host would block).
        """
        token_ids, positions, slots, seq_lens, last_rows = [], [], [], [], []
        for seq, query_len in zip(self.seqs, self.query_lens):
            start = seq.num_computed
            for pos in range(start, start + query_len):
                token_ids.append(seq.token_at(pos))
                positions.append(pos)
                slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
            seq_lens.append(start + query_len)
            last_rows.append(len(token_ids) - 1)
        # Only the blocks the context reaches so far (a sequence may hold one more, or a preempted
        # one's recompute may be under way): attention reads no further.
        live = [-(-seq_len // block_size) for seq_len in seq_lens]
        width = max(live)
        tables = []
        for seq, blocks in zip(self.seqs, live):
            tables += seq.block_ids[:blocks]
            tables += [SCRATCH_BLOCK] * (width - blocks)
        # One tensor construction per micro-batch, then views: this runs on the host every tick.
        flat = torch.tensor(token_ids + positions + slots + seq_lens + last_rows + tables, dtype=torch.int64)
        if pin:
            flat = flat.pin_memory()
        num_tokens, num_rows = len(token_ids), len(seq_lens)
        rows_from = 3 * num_tokens  # after token ids, positions and slots: seq lens, last rows, tables
        meta = StepMetadata(
            positions=flat[num_tokens : 2 * num_tokens],
            slot_mapping=flat[2 * num_tokens : rows_from],
            block_tables=flat[rows_from + 2 * num_rows :].view(num_rows, width),
            seq_lens=flat[rows_from : rows_from + num_rows],
            logits_indices=flat[rows_from + num_rows : rows_from + 2 * num_rows],
            seq_lens_host=seq_lens,
            query_lens=list(self.query_lens) if self.is_prefill else None,
        )
        return flat[:num_tokens], meta


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        prefill_chunk_size: int,
        max_model_len: int,
        max_decode_batch: int,
    ):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.max_model_len = max_model_len
        self.max_decode_batch = max_decode_batch  # the largest captured bucket
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def check(self, prompt_len: int, max_tokens: int | None) -> int:
        """Validate a request's lengths; return its resolved max_tokens. Raises RequestError."""
        if prompt_len == 0:
            raise RequestError("the prompt is empty; give at least one token")
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"the prompt is {prompt_len} tokens but the context holds {self.max_model_len} "
                "(prompt plus at least one new token); shorten the prompt"
            )
        if max_tokens is None:  # as much as the context and the cache allow
            max_tokens = max(1, min(self.max_model_len, self.allocator.capacity_tokens) - prompt_len)
        if prompt_len + max_tokens > self.max_model_len:
            raise RequestError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                f"length {self.max_model_len}; lower max_tokens to {self.max_model_len - prompt_len} or less"
            )
        if prompt_len + max_tokens > self.allocator.capacity_tokens:
            raise RequestError(
                f"the request needs {prompt_len + max_tokens} tokens of KV cache but the whole cache holds "
                f"{self.allocator.capacity_tokens}; lower max_tokens or raise kv_cache_tokens"
            )
        return max_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            needed = self.allocator.blocks_for(seq.prefill_len + 1)
            # Leave a block for each running sequence's next one, or admitting would force a preemption.
            if needed + len(self.running) > self.allocator.num_free:
                break  # first come, first served: later requests wait behind it
            seq.block_ids = self.allocator.allocate(needed)
            self.running.append(self.waiting.popleft())

    def schedule(self, num_slots: int = 1, follows: MicroBatch | None = None) -> ScheduledStep | None:
        """The next micro-batch for one ring slot, or None if nothing can run now.

        A decode row runs again once its last token is back, or, with async scheduling, while
        that token is still being sampled by `follows` (the micro-batch this one runs after in its
        slot) or by an earlier micro-batch: micro-batches finish in launch order, so the new one
        waits for nothing it would not wait for anyway. Never past max_tokens.
        The prompt chunks of one sequence may fill several slots, since each stage runs them in
        order.
        Decode rows are spread over the ring (about 1/num_slots of them per slot, never more
        than the largest bucket) so every slot carries work.
        """
        self._admit()
        prefilling = [s for s in self.running if s.in_prefill]
        decode_phase = [s for s in self.running if not s.in_prefill]
        ready = [s for s in decode_phase if self._can_decode(s, follows)]
        # Rounded down, so every slot gets rows; the rows left over rotate in as slots come back.
        rows_per_slot = max(1, len(decode_phase) // num_slots)
        if prefilling:
            # Decode rows ride along with a prompt chunk: the chunk reads every weight anyway, so
            # they cost little there, and running decodes never wait behind long prompts.
            riders = self._with_blocks(ready[: min(rows_per_slot, self.max_decode_batch, self.prefill_chunk_size // 2)])
            prefilling = [s for s in prefilling if s.block_ids]  # not preempted to make room for a rider
            if prefilling:
                self._rotate(riders)
                return self._prefill_chunk(prefilling, riders)
            batch = riders
        else:
            batch = self._with_blocks(ready[: min(rows_per_slot, self.max_decode_batch)])
        if not batch:
            return None
        self._rotate(batch)
        return ScheduledStep(batch, [1] * len(batch), is_prefill=False)

    @staticmethod
    def _can_decode(seq: Sequence, follows: MicroBatch | None) -> bool:
        if seq.outputs_scheduled >= seq.max_tokens:
            return False
        if seq.num_in_flight == 0:
            return True
        token_on_device = seq.num_in_flight == 1 and seq.pending is not None
        return token_on_device and follows is not None and seq.pending.id <= follows.id

    def _with_blocks(self, rows: list[Sequence]) -> list[Sequence]:
        """The rows whose next position has a KV block, allocating one where it starts a new block."""
        kept: list[Sequence] = []
        for seq in rows:
            if seq.in_prefill:
                continue  # preempted for an earlier row of this batch
            while len(seq.block_ids) * self.allocator.block_size <= seq.num_computed:
                if self.allocator.num_free == 0 and not self._preempt_for(seq, protected=kept):
                    break
                seq.block_ids += self.allocator.allocate(1)
            else:
                kept.append(seq)
        return kept

    def _preempt_for(self, seq: Sequence, protected: list[Sequence]) -> bool:
        """Free blocks for `seq` by preempting the youngest sequence younger than it with nothing in
        flight. If the younger ones are all busy, `seq` waits: they stop at their next block
        boundary too and become preemptable. If none is younger, `seq` itself is the one to give
        its blocks back, to the older ones (once nothing of it is in flight)."""
        younger = [s for s in self.running if s.request_id > seq.request_id and s.block_ids]
        idle = [s for s in younger if s.num_in_flight == 0 and s not in protected]
        if idle:
            self._preempt(max(idle, key=lambda s: s.request_id))
            return True
        if not younger and seq.num_in_flight == 0 and seq.block_ids:
            self._preempt(seq)
        return False

    def _preempt(self, seq: Sequence) -> None:
        """Give back every block of `seq` and queue it to be recomputed, in arrival order."""
        self.allocator.free(seq.block_ids)
        seq.block_ids, seq.num_computed, seq.prefill_len = [], 0, seq.num_tokens
        self.running.remove(seq)
        later = next((i for i, waiting in enumerate(self.waiting) if waiting.request_id > seq.request_id), len(self.waiting))
        self.waiting.insert(later, seq)
        self.num_preemptions += 1

    def _rotate(self, batch: list[Sequence]) -> None:
        """The rows left out of this micro-batch go first next time."""
        if batch:
            chosen = set(map(id, batch))
            self.running = [s for s in self.running if id(s) not in chosen] + batch

    def _prefill_chunk(self, prefilling: list[Sequence], riders: list[Sequence]) -> ScheduledStep:
        """Up to `prefill_chunk_size` tokens: one for each decode rider, the rest prompt tokens."""
        seqs, lens = list(riders), [1] * len(riders)
        budget = self.prefill_chunk_size - len(riders)
        for seq in prefilling:
            take = min(seq.prefill_len - seq.num_computed, budget)
            seqs.append(seq)
            lens.append(take)
            budget -= take
            if budget == 0:
                break
        return ScheduledStep(seqs, lens, is_prefill=True)

    def remove(self, seq: Sequence) -> None:
        """Stop scheduling a finished or aborted sequence (its blocks are the engine's to free)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

"""The one owner of request state: which sequences run in the next micro-batch, and what their
tokens do when they come back.

`schedule` admits requests, allocates KV blocks, advances the computed and in-flight counts and
emits a plain `ScheduledStep`; `update_from_output` takes the step back with its token ids, appends
them, ends sequences at EOS or max_tokens and frees their blocks (`finish` ends them for any other
reason). Blocks go back in `_give_back` only.

A micro-batch is either a prefill chunk (up to `prefill_chunk_size` tokens: prompt tokens from
one or more sequences plus one token for each decode row riding along; eager) or a decode batch
(one token per row, at most the largest bucket of tokens; replayed as a graph).

With a drafter (speculative decoding), a decode batch in which some rows have drafts is a verify
step: such a row feeds its newest token and its d drafts (each a decode row of the graph) and gets
a token sampled at each of the 1 + d positions. Which drafts go and what a row keeps is
graphrt.engine.speculation's to decide; here a verify row takes blocks for its drafts (free ones
only), and after its step its computed count goes back to what it kept, so the K/V past that is
never read, and the blocks it took for drafts it did not keep go back. How many it keeps is known
on the host only, so a verify row's next step waits for its read-back; rows without drafts keep
async scheduling.

KV blocks are allocated as a sequence grows: on admission for its prompt and first new token,
then one block whenever its next position starts a new one. When none is free, the youngest
sequence with nothing in flight gives its blocks back and waits to be recomputed (its prompt and
every token it has so far are prefilled again, and it goes on where it was), as vLLM does; an
older sequence is never preempted for a younger one (it waits for the younger ones to stop at a
block boundary). A request must fit the cache alone (`check`), so the oldest always makes progress.

With prefix caching (`prefix_root` set; graphrt.engine.block_allocator), a sequence's full blocks are
offered to the cache once the micro-batch that writes their K/V is built and their tokens are
known: every stage runs micro-batches in launch order, so a later one that reads them finds them
written, and within a prompt chunk every layer writes the whole chunk's K/V before any of its
attention reads, so a later prompt of the same chunk may read them too. A prompt looks up its
longest cached run of full blocks when it is admitted, and again as its first chunk is built
(requests arriving together, with a shared system prompt say, find what the first of them
computes, in the same chunk or an earlier one), and prefills only the rest; its last token is
always computed, so its logits exist. Requests that report their prompt's logprobs compute every
prompt token. After a stage failure nothing cached is trusted.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from graphrt.engine.block_allocator import BlockAllocator, block_keys
from graphrt.engine.drafter import Drafter
from graphrt.engine.sequence import FinishReason, Sequence, SequenceOutput
from graphrt.engine.speculation import Speculation
from graphrt.engine.stats import SpecStats
from graphrt.errors import ContextLengthError, RequestError
from graphrt.runtime.step import ScheduledStep

if TYPE_CHECKING:
    from graphrt.runtime.logprobs import StepLogprobs  # torch, which the scheduler never loads


def check_lengths(prompt_len: int, max_tokens: int | None, max_model_len: int, capacity_tokens: int) -> int:
    """Validate a request's lengths against the context and the whole KV cache (`capacity_tokens`);
    return its resolved max_tokens. Raises RequestError."""
    if prompt_len == 0:
        raise RequestError("the prompt is empty; give at least one token")
    if prompt_len >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt is {prompt_len} tokens "
            "(the prompt and at least one new token must fit); shorten the prompt"
        )
    if max_tokens is None:  # as much as the context and the cache allow
        max_tokens = max(1, min(max_model_len, capacity_tokens) - prompt_len)
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt ({prompt_len} tokens) "
            f"plus max_tokens ({max_tokens}) exceeds it; lower max_tokens to {max_model_len - prompt_len} or less"
        )
    if prompt_len + max_tokens > capacity_tokens:
        raise RequestError(
            f"the request needs {prompt_len + max_tokens} tokens of KV cache but the whole cache holds "
            f"{capacity_tokens}; lower max_tokens or raise kv_cache_tokens"
        )
    return max_tokens


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        prefill_chunk_size: int,
        max_model_len: int,
        max_decode_batch: int,
        eos_ids: frozenset[int] = frozenset(),
        prefix_root: bytes | None = None,
        drafter: Drafter | None = None,
    ):
        self.allocator = allocator
        self.spec = SpecStats()
        self.speculation = Speculation(drafter, self.spec) if drafter is not None else None  # None: no speculative decoding
        self.prefix_root = prefix_root  # None: no prefix caching
        self.eos_ids = eos_ids
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.max_model_len = max_model_len
        self.max_decode_batch = max_decode_batch  # the largest captured bucket
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.ended: list[SequenceOutput] = []  # sequences ended here, not by a step (a grammar that failed to compile)
        self.num_waiting_on_mask = 0  # constrained rows ready but for their newest token, at the last schedule
        # Whether the ring can make a constrained row's mask after it is launched (Ring.defers_masks):
        # then such a row rides in the micro-batch after the one sampling its newest token.
        self.defer_masks = False
        self._step_ids = itertools.count()

    def check(self, prompt_len: int, max_tokens: int | None) -> int:
        """Validate a request's lengths; return its resolved max_tokens. Raises RequestError."""
        return check_lengths(prompt_len, max_tokens, self.max_model_len, self.allocator.capacity_tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_ended(self) -> list[SequenceOutput]:
        """The deltas of sequences ended here rather than by a step (their grammar failed to compile)."""
        ended, self.ended = self.ended, []
        return ended

    def wait_for_grammars(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a waiting request's grammar to compile (none: return at once)."""
        pending = [seq.grammar for seq in self.waiting if seq.grammar is not None and not seq.grammar.ready()]
        if pending:
            pending[0].wait(timeout)

    def _admit(self) -> None:
        allocator = self.allocator
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                break
            if seq.grammar is not None and not seq.grammar.ready():
                continue  # its grammar is compiling: it waits here, not in the ring, and the requests after it go on
            if seq.grammar is not None and seq.grammar.failure is not None:
                self.finish(seq, FinishReason.ERROR)
                self.ended.append(SequenceOutput(seq.request_id, [], FinishReason.ERROR, failure=seq.grammar.failure))
                continue
            cached = self._cached_prefix(seq)
            needed = allocator.blocks_for(seq.prefill_len + 1) - len(cached)
            # Leave a block for each running sequence's next one, or admitting would force a preemption.
            if needed + allocator.num_unreferenced(cached) + len(self.running) > allocator.num_free:
                break  # first come, first served: later requests wait behind it
            if self.prefix_root is not None:
                allocator.count_lookup(seq.prefill_len, len(cached) * allocator.block_size)
            allocator.take(cached)
            seq.block_ids = cached + allocator.allocate(needed)
            seq.num_computed = seq.num_cached_tokens = len(cached) * allocator.block_size
            self.waiting.remove(seq)
            self.running.append(seq)

    # -- the prefix cache -------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that can stand for the start of what `seq` has to prefill (none taken)."""
        if self.prefix_root is None or seq.params.prompt_logprobs is not None:
            return []
        # Whole blocks only, and never the last token to prefill: its logits are needed.
        usable = (seq.prefill_len - 1) // self.allocator.block_size
        return self.allocator.cached_prefix(self._keys(seq, usable))

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of the first `num_blocks` full blocks of `seq`'s known tokens (made once each)."""
        if len(seq.block_keys) < num_blocks:
            tokens = seq.prompt_ids + seq.output_ids
            start = len(seq.block_keys)
            parent = seq.block_keys[-1] if start else None
            size = self.allocator.block_size
            seq.block_keys += block_keys(tokens[: num_blocks * size], size, self.prefix_root, start, parent)
        return seq.block_keys[:num_blocks]

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        """As a prompt's first chunk is built: swap its fresh leading blocks for cached ones
        registered since it was admitted (by a request admitted with it, say, in an earlier chunk
        or earlier in this one)."""
        cached = self._cached_prefix(seq)
        have = seq.num_cached_tokens // self.allocator.block_size
        if len(cached) <= have:
            return
        self.allocator.take(cached[have:])
        fresh = seq.block_ids[have : len(cached)]
        seq.block_ids[have : len(cached)] = cached[have:]
        self._give_back(fresh)
        seq.num_computed = seq.num_cached_tokens = len(cached) * self.allocator.block_size
        self.allocator.count_lookup(0, (len(cached) - have) * self.allocator.block_size)

    def _register_full_blocks(self, seq: Sequence, pending: int = 0) -> None:
        """Offer the cache each full block of `seq` whose K/V is written, or will be by the `pending`
        tokens of the micro-batch being built, and whose tokens are known."""
        full = min(seq.num_computed + pending, seq.num_tokens) // self.allocator.block_size
        if full > seq.num_registered and seq.block_ids:
            for block, key in zip(seq.block_ids[seq.num_registered : full], self._keys(seq, full)[seq.num_registered :]):
                self.allocator.register(block, key)
            seq.num_registered = full

    def schedule(self, num_slots: int = 1, follows: int | None = None) -> ScheduledStep | None:
        """The next micro-batch for one ring slot, or None if nothing can run now. The step's rows
        count as in flight from here until `update_from_output` gets it back.

        A decode row runs again once its last token is back, or, with async scheduling, while
        that token is still being sampled by `follows` (the id of the step this one runs after in its
        slot) or by an earlier one: micro-batches finish in launch order, so the new one
        waits for nothing it would not wait for anyway. Never past max_tokens.
        The prompt chunks of one sequence may fill several slots, since each stage runs them in
        order.
        Decode rows are spread over `num_slots` micro-batches (about 1/num_slots of them in each,
        never more than the largest bucket) so every stage that can work at once carries work; the
        engine passes EngineConfig.num_decode_micro_batches, which counts GPUs, not stages.
        """
        self._admit()
        prefilling = [s for s in self.running if s.in_prefill]
        decode_phase = [s for s in self.running if not s.in_prefill]
        self.num_waiting_on_mask = 0  # counted by _can_decode
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
                return self._launched(self._prefill_chunk(prefilling, riders))
            batch = riders
        else:
            candidates = ready[: min(rows_per_slot, self.max_decode_batch)]
            if follows is not None and self._waits_for_verify_rows(decode_phase, candidates, follows):
                return None
            batch = self._with_blocks(candidates)
        if not batch:
            return None
        self._rotate(batch)
        if self.speculation is not None and not prefilling:
            return self._launched(self._decode_step(batch))
        return self._launched(ScheduledStep(batch, [1] * len(batch), is_prefill=False, id=next(self._step_ids)))

    def _decode_step(self, batch: list[Sequence]) -> ScheduledStep:
        """A decode batch whose rows have drafts worth verifying (graphrt.engine.speculation) becomes
        a verify step, those rows last, each with blocks for its drafts. Its tokens are the rows of
        a decode batch, so they fit the largest bucket."""
        drafts = {}
        for seq, proposed in self.speculation.choose_drafts(batch, self.max_decode_batch - len(batch)):
            if kept := self._with_draft_blocks(seq, proposed):
                drafts[id(seq)] = kept
        if not drafts:
            return ScheduledStep(batch, [1] * len(batch), is_prefill=False, id=next(self._step_ids))
        rows = [seq for seq in batch if id(seq) not in drafts] + [seq for seq in batch if id(seq) in drafts]
        draft_ids = [drafts.get(id(seq), []) for seq in rows]
        for seq, row_drafts in zip(rows, draft_ids):
            seq.draft_ids = row_drafts
        return ScheduledStep(
            rows, [1 + len(d) for d in draft_ids], is_prefill=False, draft_ids=draft_ids, id=next(self._step_ids)
        )

    def _waits_for_verify_rows(self, decode_phase: list[Sequence], candidates: list[Sequence], follows: int) -> bool:
        """Whether the step launched ahead after step `follows` with `candidates` should wait
        instead for the rows whose verify steps (that one or earlier) are still in flight. Even
        where one step could not hold them all (more rows than a slot takes), waiting lets the
        rows come back together: at pp 2, concurrency 8, speculation went from about 1.0x to
        1.2x of no speculation without that limit (benchmarks/results.md)."""
        if self.speculation is None:
            return False
        verifying = sum(1 for seq in decode_phase if seq.draft_ids and seq.sampling_step <= follows)
        return self.speculation.waits_for_verify_rows(len(candidates), verifying)

    def record_host_gap(self, seconds: float) -> None:
        """The engine saw the device wait `seconds` from a read-back to the next decode launch."""
        if self.speculation is not None:
            self.speculation.record_host_gap(seconds)

    def _with_draft_blocks(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """`drafts`, cut to what free KV blocks hold, with blocks for their positions (after the
        newest token's, at num_computed) taken from the free ones only: a guess never preempts anyone."""
        room = (len(seq.block_ids) + self.allocator.num_free) * self.allocator.block_size - seq.num_computed - 1
        drafts = drafts[: max(0, room)]
        missing = self.allocator.blocks_for(seq.num_computed + 1 + len(drafts)) - len(seq.block_ids)
        if missing > 0:
            seq.block_ids += self.allocator.allocate(missing)
        return drafts

    def _launched(self, step: ScheduledStep) -> ScheduledStep:
        """Advance the counts of every row of a step about to launch."""
        for seq, query_len in zip(step.seqs, step.query_lens):
            seq.num_computed += query_len
            seq.num_in_flight += 1
            if self.prefix_root is not None:  # decode rows; a chunk's prompts registered theirs as it was built
                self._register_full_blocks(seq)
        for seq in step.sampled_seqs:
            seq.num_output_placeholders += 1
            seq.sampling_step = step.id
        return step

    def _can_decode(self, seq: Sequence, follows: int | None) -> bool:
        if seq.outputs_scheduled >= seq.max_tokens or seq.draft_ids:  # a verify step of it in flight
            return False
        if seq.num_in_flight == 0:
            return True
        token_on_device = seq.num_in_flight == 1 and seq.num_output_placeholders > 0
        if not (token_on_device and follows is not None and seq.sampling_step <= follows):
            return False
        if seq.grammar is not None and not self.defer_masks:  # its next mask needs its newest token on the host
            self.num_waiting_on_mask += 1
            return False
        return True

    def _with_blocks(self, rows: list[Sequence]) -> list[Sequence]:
        """The rows whose next position has a KV block, allocating one where it starts a new block."""
        kept: list[Sequence] = []
        for seq in rows:
            if seq.in_prefill:
                continue  # preempted for an earlier row of this batch
            while len(seq.block_ids) * self.allocator.block_size <= seq.num_computed:
                # A preempted sequence may free no block (all of them shared): preempt until one is free.
                while self.allocator.num_free == 0 and self._preempt_for(seq, protected=kept):
                    pass
                if self.allocator.num_free == 0 or not seq.block_ids:  # none to be had, or `seq` gave its own back
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
        """Give back every block of `seq` (and the drafter's cache of it) and queue it to be
        recomputed, in arrival order."""
        self._free_blocks(seq)
        if self.speculation is not None:
            self.speculation.release(seq)
        seq.num_computed, seq.prefill_len = 0, seq.num_tokens
        seq.num_cached_tokens = seq.num_registered = 0
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
            if seq.num_computed == seq.num_cached_tokens and self.prefix_root is not None:
                self._reuse_cached_prefix(seq)
            take = min(seq.prefill_len - seq.num_computed, budget)
            seqs.append(seq)
            lens.append(take)
            budget -= take
            if self.prefix_root is not None:
                self._register_full_blocks(seq, pending=take)  # the prompts after it in this chunk may share them
            if budget == 0:
                break
        return ScheduledStep(seqs, lens, is_prefill=True, id=next(self._step_ids))

    # -- results ----------------------------------------------------------------------------------

    def update_from_output(
        self, step: ScheduledStep, token_ids: list[int] | None, now: float, logprobs: StepLogprobs | None = None
    ) -> list[SequenceOutput]:
        """A step is back from the ring with one token per sampled row (None: it ran for its logits
        only, see Engine.run), and the logprobs of the requests that asked. Append the tokens and
        their logprobs, end sequences at EOS or max_tokens, free the blocks of every ended sequence
        nothing in flight still uses. Returns the delta of every sequence that got a token."""
        for seq in step.seqs:
            seq.num_in_flight -= 1
        if logprobs is not None:
            for row, position, entry in logprobs.prompt:  # a prompt token is scored once, even if recomputed
                seq = step.seqs[row]
                if len(seq.prompt_logprobs) == position:
                    seq.prompt_logprobs.append(entry)
        outputs: list[SequenceOutput] = []
        offset = 0
        for seq, count in zip(step.sampled_seqs, step.sample_counts):
            seq.num_output_placeholders -= 1
            first, offset = offset, offset + count  # the row's sample entries
            sampled = token_ids[first:offset] if token_ids is not None else None
            if count > 1:
                sampled = self._verified(seq, sampled)
            # Aborted while in flight, or finished a step earlier (async scheduling had already
            # launched the next one): the token is dropped.
            if sampled is not None and not seq.finished:
                new_token_ids = []
                for token_id in sampled:  # an accepted run may reach EOS or max_tokens: the rest is dropped
                    if seq.finished:
                        break
                    self._append(seq, token_id, now)
                    new_token_ids.append(token_id)
                new_logprobs = None
                if seq.params.logprobs is not None and logprobs is not None and first in logprobs.sampled:
                    # Kept token i was sampled at entry i (accept_drafts keeps a prefix of the entries).
                    new_logprobs = [logprobs.sampled[first + i] for i in range(len(new_token_ids))]
                    seq.logprobs += new_logprobs
                outputs.append(SequenceOutput(
                    seq.request_id, new_token_ids, seq.finish_reason, new_logprobs,
                    list(seq.prompt_logprobs)
                    if seq.params.prompt_logprobs is not None and len(seq.output_ids) == len(new_token_ids) else None,
                    stop_token=seq.stop_token,
                ))
                if self.prefix_root is not None:
                    self._register_full_blocks(seq)
        for seq in step.seqs:
            if seq.finished:
                self._free_when_idle(seq)
        return outputs

    def _verified(self, seq: Sequence, sampled: list[int] | None) -> list[int] | None:
        """A verify row is back: keep what `Speculation.keep` keeps (None: the step ran for its
        logits only, nothing is kept), and let go of what the row computed and allocated past that."""
        drafts, seq.draft_ids = seq.draft_ids, []
        kept, num_accepted = self.speculation.keep(seq, drafts, sampled)
        seq.num_computed -= len(drafts) - num_accepted  # the rejected drafts' K/V is never read
        if seq.block_ids:  # blocks past the next position go back (a finished row frees them all below)
            keep = self.allocator.blocks_for(seq.num_computed + 1)
            surplus, seq.block_ids = seq.block_ids[keep:], seq.block_ids[:keep]
            self._give_back(surplus)
        return kept if sampled is not None else None

    def _append(self, seq: Sequence, token_id: int, now: float) -> None:
        seq.output_ids.append(token_id)
        if seq.grammar is not None:
            seq.grammar.accept(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        params = seq.params
        # A stop token (EOS unless ignored, or one of stop_token_ids) ends it once min_tokens are
        # out; the sampler masks them before, so this only confirms it, as vLLM's check does.
        eos = token_id in self.eos_ids and not params.ignore_eos
        if (eos or token_id in params.stop_token_ids) and len(seq.output_ids) >= params.min_tokens:
            seq.stop_token = None if eos else token_id  # as vLLM: EOS is no stop reason, even when listed
            self.finish(seq, FinishReason.STOP)
        elif len(seq.output_ids) >= seq.max_tokens:
            self.finish(seq, FinishReason.LENGTH)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (a stop string, an abort...): stop scheduling it, and free its blocks
        now or, if a micro-batch in flight still uses them, when that one is back."""
        seq.finish_reason = reason
        if self.speculation is not None:
            self.speculation.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_when_idle(seq)

    def fail(self, lost: list[Sequence]) -> None:
        """The micro-batches carrying these sequences were lost with a failed stage: nothing of
        them is in flight any more; end them with an error (ended ones keep their reason)."""
        for seq in lost:
            seq.num_in_flight = seq.num_output_placeholders = 0
            self.finish(seq, seq.finish_reason or FinishReason.ERROR)
        self.allocator.forget_cache()  # blocks the lost micro-batches were writing may be registered

    def _free_when_idle(self, seq: Sequence) -> None:
        if seq.num_in_flight == 0 and seq.block_ids:
            self._free_blocks(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        self._give_back(seq.block_ids)
        seq.block_ids = []

    def _give_back(self, blocks: list[int]) -> None:
        """The one place KV blocks go back to the allocator (one reference each)."""
        self.allocator.free(blocks)

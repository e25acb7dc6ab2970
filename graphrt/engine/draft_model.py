"""The `draft_model` drafter: a smaller model with the target's vocabulary guesses each row's next
tokens, greedily, with a paged KV cache of its own.

It runs graphrt's own model code (one stage, eager) on the target's last device, when the
scheduler builds a decode step: first one prompt-shaped step that feeds every drafting row the
tokens its cache lacks (a row's whole context the first time, then the tokens kept since its last
guess) and gives each row's first draft, then a decode step per further draft. A row's cache
keeps the K/V of every token it was fed; what the target rejected is found by comparing the fed
tokens with the row's tokens the next time, and only the differing tail is fed again, as the
target itself overwrites rejected K/V.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.drafter import StepCosts
from graphrt.model import SCRATCH_BLOCK
from graphrt.model.config import ModelConfig
from graphrt.model.kv_cache import bytes_per_block
from graphrt.model.weights import WeightFiles
from graphrt.profiling.nvtx import Ranges
from graphrt.profiling.timing import median_seconds
from graphrt.runtime.pipeline import Pipeline
from graphrt.runtime.ring import build_inputs
from graphrt.runtime.step import ScheduledStep


@dataclass
class DraftRow:
    """One sequence in the draft model's cache (graphrt.runtime.step.Row, as far as build_inputs reads)."""

    request_id: int
    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # what it is guessing from, then its guesses
    fed: list[int] = field(default_factory=list)  # tokens whose K/V its cache holds, in order

    def token_at(self, position: int) -> int:
        return self.tokens[position]


class DraftModelDrafter:
    def __init__(
        self,
        model_dir: Path,
        num_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        max_position: int,
        target_vocab_size: int,
        ranges: Ranges | None = None,
    ):
        """Load the draft model's weights onto `device`; its KV cache comes with `allocate`, once
        the engine has sized the target's, counting this model's weights and its bytes per block."""
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"the draft model folder {model_dir} has no config.json; give the speculative config's \"model\" "
                "as a Hugging Face style folder (config.json, *.safetensors) of a smaller model with the target's tokenizer"
            )
        cfg = ModelConfig.from_dir(model_dir)
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model {model_dir} has a vocabulary of {cfg.vocab_size} tokens and the target "
                f"{target_vocab_size}; a draft model must share the target's tokenizer (e.g. a smaller model of its family)"
            )
        self.num_tokens = num_tokens
        self.cfg, self.dtype = cfg, dtype
        self.pipeline = Pipeline.load(cfg, WeightFiles(model_dir), [device], dtype, max_position)
        self.allocator: BlockAllocator | None = None  # allocate() makes it, and sets block_size
        self.block_size: int | None = None
        self.rows: dict[int, DraftRow] = {}
        self.guess_costs: StepCosts | None = None  # measure_guess_costs sets it, before any request
        self.ranges = ranges or Ranges()  # NVTX: a `draft` range around each step's guesses

    def kv_bytes_per_block(self, block_size: int) -> int:
        """What a block of its KV cache takes (every layer's K and V for `block_size` tokens)."""
        return bytes_per_block(self.cfg, self.cfg.num_layers, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int, max_rows: int) -> None:
        """Its paged KV cache of `num_blocks` blocks, and the kernels fastest here for decode steps
        of up to `max_rows` rows (a row per drafting sequence)."""
        self.block_size = block_size
        self.pipeline.allocate_kv(num_blocks, block_size)
        self.pipeline.choose_kernels(max_rows, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)

    def measure_guess_costs(self, row_counts: list[int], repeats: int = 3) -> None:
        """Time a round of guesses (one decode step of the draft model) for each number of rows in
        `row_counts` (graphrt.engine.drafter.Drafter). Run before any request: every row is padding
        in the scratch block."""
        seconds = {}
        for count in row_counts:
            rows = [DraftRow(-1 - i, block_ids=[SCRATCH_BLOCK], tokens=[0]) for i in range(count)]
            step = ScheduledStep(rows, [1] * count, is_prefill=False, starts=[0] * count, sample_rows=list(range(count)))
            seconds[count] = median_seconds(lambda step=step: self._forward(step), repeats)
        self.guess_costs = StepCosts(seconds)

    def propose_batch(self, requests: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (request id, tokens, limit): up to `limit` greedy guesses of the tokens after
        `tokens` (graphrt.engine.drafter.Drafter); [] for a row whose guesses the draft cache has no room for."""
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, DraftRow, int]] = []  # (request index, its row, guesses wanted)
        starts = []
        for index, (request_id, tokens, limit) in enumerate(requests):
            count = limit
            if count <= 0 or not tokens:
                continue
            row = self.rows.setdefault(request_id, DraftRow(request_id))
            if not self._make_room(row, len(tokens) + count - 1):  # the last guess is never fed
                continue
            starts.append(common_prefix(row.fed, tokens, len(tokens) - 1))  # the newest token is always fed
            row.tokens = list(tokens)
            active.append((index, row, count))
        if not active:
            return drafts
        with self.ranges.draft(len(active), max(count for _, _, count in active)):
            self._guess(active, starts, drafts)
        return drafts

    def _guess(self, active: list[tuple[int, DraftRow, int]], starts: list[int], drafts: list[list[int]]) -> None:
        """Each active row's guesses, appended to `drafts` by request index; its cache fed as they go."""
        rows = [row for _, row, _ in active]
        catch_up = [len(row.tokens) - start for row, start in zip(rows, starts)]
        # What the target kept since a row's last guesses is a few tokens: decode-shaped, a row per
        # token (as a verify step is), it runs on the decode kernels. A row's first guesses need its
        # whole context: prompt-shaped.
        decode_shaped = max(catch_up) <= self.num_tokens + 1
        step = ScheduledStep(rows, catch_up, is_prefill=not decode_shaped, starts=starts, sample_rows=list(range(len(rows))))
        guesses = self._forward(step)
        if decode_shaped:  # a guess at every token: each row's is at its last
            ends = list(itertools.accumulate(catch_up))
            guesses = [guesses[end - 1] for end in ends]
        for _, row, _ in active:
            row.fed = row.tokens[:]  # what this step and each one after it feeds; the last guess is not
        going = active
        while True:
            for (index, row, _), guess in zip(going, guesses):
                drafts[index].append(guess)
                row.tokens.append(guess)
            going = [(index, row, count) for index, row, count in going if len(drafts[index]) < count]
            if not going:
                break
            rows = [row for _, row, _ in going]
            for row in rows:
                row.fed.append(row.tokens[-1])
            step = ScheduledStep(
                rows, [1] * len(rows), is_prefill=False, starts=[len(row.tokens) - 1 for row in rows],
                sample_rows=list(range(len(rows))),
            )
            guesses = self._forward(step)

    def _forward(self, step: ScheduledStep) -> list[int]:
        token_ids, meta = build_inputs(step, self.block_size)
        logits = self.pipeline.forward(token_ids, meta)
        return logits.argmax(dim=-1).tolist()

    def _make_room(self, row: DraftRow, num_positions: int) -> bool:
        """Blocks for `row`'s first `num_positions` positions; False (and its cache given back)
        where the draft cache has too few free."""
        missing = self.allocator.blocks_for(num_positions) - len(row.block_ids)
        if missing > self.allocator.num_free:
            self.release(row.request_id)
            return False
        if missing > 0:
            row.block_ids += self.allocator.allocate(missing)
        return True

    def release(self, request_id: int) -> None:
        """The sequence is done (finished, aborted or preempted): its draft cache goes back."""
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.allocator.free(row.block_ids)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    count = 0
    for x, y in zip(a, b):
        if count >= limit or x != y:
            break
        count += 1
    return count

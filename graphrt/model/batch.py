"""The metadata a stage's forward pass reads besides its tokens or hidden states."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class StepMetadata:
    """One micro-batch, as every stage sees it (a copy lives on each stage's device).

    Decode micro-batches have one token per sequence (`query_lens is None`) and static shapes, so a
    graph can be recorded over them. Prefill chunks are ragged and always run eagerly.
    """

    positions: torch.Tensor  # (tokens,) int64
    slot_mapping: torch.Tensor  # (tokens,) int64 flat KV slot per token
    block_tables: torch.Tensor  # (batch, max_blocks) int64
    seq_lens: torch.Tensor  # (batch,) int64 context length including this step's tokens
    logits_indices: torch.Tensor  # (batch,) int64 row of each sequence's last token
    seq_lens_host: list[int] | None  # None inside a graph, where host values can't change per replay
    query_lens: list[int] | None = None  # prefill only: tokens per sequence in this chunk

    @property
    def max_seq_len(self) -> int | None:
        """The longest context, when the host knows it (eager runs read only that many blocks)."""
        return max(self.seq_lens_host) if self.seq_lens_host else None

    @property
    def is_prefill(self) -> bool:
        return self.query_lens is not None

    def to(self, device: torch.device) -> StepMetadata:
        if self.positions.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return replace(
            self,
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            block_tables=move(self.block_tables),
            seq_lens=move(self.seq_lens),
            logits_indices=move(self.logits_indices),
        )

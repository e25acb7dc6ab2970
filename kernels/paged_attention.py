"""Paged KV cache writes and attention that reads K/V through block tables.

Cache layout, per layer: (num_blocks, block_size, num_kv_heads, head_dim). A token's slot is
`block_id * block_size + offset`. Block 0 is scratch: padding rows write there and nothing reads it
as real context, so a padded batch can never corrupt another sequence's blocks.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: (tokens, kv_heads, head_dim); slot_mapping: (tokens,) int64 flat slot ids."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # (..., num_blocks) block ids -> (..., num_blocks * block_size, kv_heads, head_dim).
    # index_select copies whole blocks; `cache[block_ids]` (advanced indexing) goes element by
    # element and is about 4x slower on the CPU, where this gather is a sixth of a decode step.
    gathered = cache.index_select(0, block_ids.flatten())
    return gathered.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence.

    q: (batch, heads, head_dim); block_tables: (batch, max_blocks); seq_lens: (batch,) tokens of
    context including the current one (at least 1). `max_seq_len`, when the caller knows it on the
    host, trims the block table so the reference reads only live blocks. Returns (batch, heads, head_dim).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if max_seq_len is not None:
        block_tables = block_tables[:, : -(-max_seq_len // block_size)]
    keys = _gather_context(k_cache, block_tables)  # (batch, ctx, kv_heads, head_dim)
    values = _gather_context(v_cache, block_tables)
    ctx = keys.shape[1]
    visible = torch.arange(ctx, device=q.device)[None, :] < seq_lens[:, None]  # (batch, ctx)
    # The query heads that share a KV head are that head's query rows (head h reads KV head
    # h // group, as in transformers), so attention is plain multi-query per KV head; faster on
    # the CPU than enable_gqa, which gives every query head its own pass over the keys.
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2),  # (batch, kv_heads, ctx, head_dim)
        values.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, num_heads, -1)  # values may be narrower than keys (MLA: kernels/mla.py)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    decode_attention: Callable = paged_decode_attention,
    prompt_attention: Callable | None = None,
    device_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk of prompt tokens from several sequences, each attending causally to its context.

    q: (tokens, heads, head_dim), the sequences' query tokens back to back; `query_lens[i]` of them
    belong to sequence i, whose context (already written to the cache) is `seq_lens[i]` tokens long
    and ends with those queries. Returns (tokens, heads, head_dim).

    The leading rows with one query token (the decode rows riding along with a chunk, which the
    scheduler puts first) attend as one decode batch through `decode_attention`: one call instead
    of a gather and an attention call per row, in every layer. The rows after them go to
    `prompt_attention` (same arguments as this function, for those rows only) where given, else one
    F.scaled_dot_product_attention call per row here.

    `device_seq_lens`: `seq_lens` as a (batch,) int64 tensor on q's device, which the decode rows
    read. The caller builds it once per micro-batch (StepMetadata.seq_lens, copied from pinned
    memory without blocking); without it, it is made here, which from a list on a GPU is a
    synchronous copy: the host would wait for the device in every layer.
    """
    block_size = k_cache.shape[1]
    num_single = next((row for row, query_len in enumerate(query_lens) if query_len != 1), len(query_lens))
    if num_single and device_seq_lens is None:
        device_seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device=q.device)
    if num_single == len(query_lens):
        return _decode_rows(q, k_cache, v_cache, block_tables, seq_lens, device_seq_lens, scale, decode_attention)
    outputs = []
    if num_single:
        leading = slice(0, num_single)
        outputs.append(_decode_rows(
            q[leading], k_cache, v_cache, block_tables[leading], seq_lens[leading], device_seq_lens[leading], scale,
            decode_attention,
        ))
    if prompt_attention is not None:
        rest = slice(num_single, len(query_lens))
        outputs.append(prompt_attention(
            q[sum(query_lens[:num_single]):], k_cache, v_cache, block_tables[rest], query_lens[rest], seq_lens[rest], scale
        ))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    start = num_single
    for row in range(num_single, len(query_lens)):
        query_len, seq_len = query_lens[row], seq_lens[row]
        q_seq = q[start : start + query_len].transpose(0, 1).unsqueeze(0)  # (1, heads, q_len, head_dim)
        start += query_len
        block_ids = block_tables[row, : -(-seq_len // block_size)]
        keys = _gather_context(k_cache, block_ids)[:seq_len].transpose(0, 1).unsqueeze(0)
        values = _gather_context(v_cache, block_ids)[:seq_len].transpose(0, 1).unsqueeze(0)
        if query_len == seq_len:
            out = F.scaled_dot_product_attention(q_seq, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(
                q_seq, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
            )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _decode_rows(
    q: torch.Tensor,  # (rows, heads, head_dim): one query token per row
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (rows, max_blocks)
    seq_lens: list[int],
    device_seq_lens: torch.Tensor,  # (rows,) the same, on q's device
    scale: float,
    decode_attention: Callable,
) -> torch.Tensor:
    """Rows with one query token each, attended as a decode batch: (rows, heads, head_dim)."""
    return decode_attention(q, k_cache, v_cache, block_tables, device_seq_lens, scale, max(seq_lens))

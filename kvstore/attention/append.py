"""Append one decode token to every kv head of a tail block, and widen the block's key summary.

A captured decode step (kvstore/decode/step.py) appends in every layer of every token; done with torch
ops it is ~8 launches per layer (stack, index_put, index_select, min, max, stack, index_copy),
which a 32-layer graph pays ~250 times per token. Positions come from device state, so the
launch is the same for every token: slot = tail_slot[0], offset = num_tokens[0] % B, block
index = num_tokens[0] // B.

`NewToken` hands the same append to paged_decode: the one-tile walk (one_tile.py) writes the token from
the program that attends its tile, in the same launch (no launch of its own: a captured llama3-8b token's dense
8K layer step takes 25.5 us on the H200 against 27.7 with a separate append: bench_longctx.decode_bench;
BENCHMARKS.md, Decode step); the split walk runs `append_token` first.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def append_head(hot_ptr, sum_ptr, tail_slot_ptr, count_ptr, k, v, head, offs_d, s_pool_slot, s_pool_kv,
                s_pool_head, s_pool_tok, s_sum_blk, s_sum_kind, s_sum_head, BLOCK_TOKENS: tl.constexpr):
    """One kv head's k, v [D] (offs_d = arange(D)) at token count % B of its tail slot; its block's summary widened."""
    count = tl.load(count_ptr)
    slot = tl.load(tail_slot_ptr)
    row = hot_ptr + slot * s_pool_slot + head * s_pool_head + (count % BLOCK_TOKENS) * s_pool_tok + offs_d
    tl.store(row, k)
    tl.store(row + s_pool_kv, v)
    low = sum_ptr + (count // BLOCK_TOKENS) * s_sum_blk + head * s_sum_head + offs_d
    tl.store(low, tl.minimum(tl.load(low), k))
    tl.store(low + s_sum_kind, tl.maximum(tl.load(low + s_sum_kind), k))


@triton.jit
def _append_kernel(pool_ptr, summaries_ptr, k_ptr, v_ptr, tail_slot_ptr, num_tokens_ptr,
                   s_pool_slot, s_pool_kv, s_pool_head, s_pool_tok, s_sum_blk, s_sum_kind, s_sum_head,
                   s_kv_head, BLOCK_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):
    head = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + head * s_kv_head + d)
    v = tl.load(v_ptr + head * s_kv_head + d)
    append_head(pool_ptr, summaries_ptr, tail_slot_ptr, num_tokens_ptr, k, v, head, d, s_pool_slot, s_pool_kv,
                s_pool_head, s_pool_tok, s_sum_blk, s_sum_kind, s_sum_head, BLOCK_TOKENS)


@triton.jit
def _append_rows_kernel(pool_ptr, sum_addrs, like_sum, k_ptr, v_ptr, tail_slot_ptr, num_tokens_ptr,
                        s_pool_slot, s_pool_kv, s_pool_head, s_pool_tok, s_sum_blk, s_sum_kind, s_sum_head,
                        s_kv_row, s_kv_head, BLOCK_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (kv head, sequence): that sequence's token, its summaries read through their address."""
    head = tl.program_id(0)
    row = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + row * s_kv_row + head * s_kv_head + d)
    v = tl.load(v_ptr + row * s_kv_row + head * s_kv_head + d)
    summaries = tl.load(sum_addrs + row).to(like_sum.dtype)
    append_head(pool_ptr, summaries, tail_slot_ptr + row, num_tokens_ptr + row, k, v, head, d, s_pool_slot,
                s_pool_kv, s_pool_head, s_pool_tok, s_sum_blk, s_sum_kind, s_sum_head, BLOCK_TOKENS)


@triton.jit
def _open_tails_kernel(sum_addrs, like_sum, h2o_addrs, like_h2o, h2o_strides, index_ptr, s_sum_blk, s_sum_kind,
                       num_heads, head_elems, BLOCK: tl.constexpr, HEADS: tl.constexpr):
    """Program per table: its tail entry index_ptr[table] opened (summary min +inf, max -inf, H2O scores 0 for
    every head)."""
    table = tl.program_id(0)
    index = tl.load(index_ptr + table)
    summary = tl.load(sum_addrs + table).to(like_sum.dtype) + index * s_sum_blk
    offs = tl.arange(0, BLOCK)
    tl.store(summary + offs, tl.full((BLOCK,), float("inf"), tl.float32), mask=offs < head_elems)
    tl.store(summary + s_sum_kind + offs, tl.full((BLOCK,), float("-inf"), tl.float32), mask=offs < head_elems)
    h2o = tl.load(h2o_addrs + table).to(like_h2o.dtype)
    heads = tl.arange(0, HEADS)
    tl.store(h2o + heads * tl.load(h2o_strides + table) + index, tl.zeros((HEADS,), tl.float32),
             mask=heads < num_heads)


class NewToken(NamedTuple):
    """A decode token to append before attending: k, v fp16 [H, D]; the layer's summaries fp16 [N, 2, H, D];
    tail_slot int64 [1], the hot-pool slot of its tail block; count int64 [1], the tokens held before it."""

    k: torch.Tensor
    v: torch.Tensor
    summaries: torch.Tensor
    tail_slot: torch.Tensor
    count: torch.Tensor


def append_token(pool: torch.Tensor, summaries: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 tail_slot: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """Write k, v [H, D] fp16 at token num_tokens[0] % B of pool slot tail_slot[0] (pool fp16 [S, 2, H, B, D])
    and widen summaries[num_tokens[0] // B] (fp16 [N, 2, H, D]: min, max) by k. No host sync."""
    _check(pool, summaries, k, v, tail_slot, num_tokens)
    h, d = k.shape
    _append_kernel[(h,)](pool, summaries, k, v, tail_slot, num_tokens,
                         pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
                         summaries.stride(0), summaries.stride(1), summaries.stride(2), k.stride(0),
                         BLOCK_TOKENS=pool.shape[3], HEAD_DIM=d, num_warps=1)


def append_token_ref(pool: torch.Tensor, summaries: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     tail_slot: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """The same contract in torch (still no host sync: device-tensor indices)."""
    _check(pool, summaries, k, v, tail_slot, num_tokens)
    h, b = k.shape[0], pool.shape[3]
    heads = torch.arange(h, device=k.device)[None].expand(2, h)  # [2, H]
    kinds = torch.tensor([[0], [1]], device=k.device).expand(2, h)  # [2, H]
    offset, block = num_tokens % b, num_tokens // b  # [1] each
    pool.index_put_((tail_slot.expand(2, h), kinds, heads, offset.expand(2, h)), torch.stack([k, v]))
    summary = summaries.index_select(0, block)  # [1, 2, H, D]
    widened = torch.stack([torch.minimum(summary[0, 0], k), torch.maximum(summary[0, 1], k)])
    summaries.index_copy_(0, block, widened[None])


def append_tokens(pool: torch.Tensor, summaries: list[torch.Tensor], sum_addrs: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, tail_slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """`append_token` for B sequences in one launch: row b's k, v [B, H, D] into pool slot tail_slots[b] at
    num_tokens[b] (int64 [B] each), widening summaries[b] (addresses in sum_addrs int64 [B], one layout)."""
    b = k.shape[0]
    if len(summaries) != b or tail_slots.shape != (b,) or num_tokens.shape != (b,) or sum_addrs.shape != (b,) or \
            tail_slots.stride(0) != 1 or num_tokens.stride(0) != 1:
        raise ValueError(f"append_tokens: {b} rows need {b} summaries, addresses and contiguous tail slots and "
                         f"counts, got {len(summaries)}, {list(tail_slots.shape)}, {list(num_tokens.shape)}")
    first = summaries[0]
    _check(pool, first, k[0], v[0], tail_slots[:1], num_tokens[:1])
    if any(s.stride() != first.stride() or s.dtype != first.dtype for s in summaries) or k.stride(0) != v.stride(0):
        raise ValueError("append_tokens: summaries of one layout, and k, v of the same strides, expected")
    _append_rows_kernel[(k.shape[1], b)](pool, sum_addrs, first, k, v, tail_slots, num_tokens,
                                         pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
                                         first.stride(0), first.stride(1), first.stride(2), k.stride(0),
                                         k.stride(1), BLOCK_TOKENS=pool.shape[3], HEAD_DIM=k.shape[2], num_warps=1)


def append_tokens_ref(pool: torch.Tensor, summaries: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                      tail_slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """`append_tokens` in torch, one sequence at a time."""
    for i, s in enumerate(summaries):
        append_token_ref(pool, s, k[i], v[i], tail_slots[i: i + 1], num_tokens[i: i + 1])


def open_tails(summaries: list[torch.Tensor], h2o_scores: list[torch.Tensor], addresses: tuple[torch.Tensor, ...],
               indices: torch.Tensor, checked: Sequence[int]) -> None:
    """Open entry indices[i] of table i in one launch (the layers of a sequence, of a batch's sequences):
    summaries[i][indices[i]] min +inf, max -inf (fp16 [N, 2, H, D]; the step's append widens them),
    h2o_scores[i][:, indices[i]] = 0 (fp32 [H, N]). addresses: int64 [n] of the summaries' and H2O scores'
    addresses and the H2O row strides; indices: int64 [n] on the device, `checked` the same on the host (the
    bounds are checked there)."""
    first, h2o = summaries[0], h2o_scores[0]
    _, _, heads, dim = first.shape
    if first.stride(2) != dim or first.stride(3) != 1 or h2o.dtype != torch.float32 or len(checked) != len(summaries) \
            or not all(0 <= i < min(s.shape[0], h.shape[1]) for s, h, i in zip(summaries, h2o_scores, checked)):
        raise ValueError(f"open_tails: summaries [N, 2, H, D] contiguous in H, D and fp32 H2O scores holding "
                         f"entries {list(checked)[:8]} expected")
    sum_addrs, h2o_addrs, h2o_strides = addresses
    _open_tails_kernel[(len(summaries),)](sum_addrs, first, h2o_addrs, h2o, h2o_strides, indices, first.stride(0),
                                          first.stride(1), heads, heads * dim,
                                          BLOCK=triton.next_power_of_2(heads * dim),
                                          HEADS=triton.next_power_of_2(heads), num_warps=4)


def open_tails_ref(summaries: list[torch.Tensor], h2o_scores: list[torch.Tensor], indices: Sequence[int]) -> None:
    """`open_tails` in torch, table by table."""
    for s, h, index in zip(summaries, h2o_scores, indices, strict=True):
        s[index, 0] = float("inf")
        s[index, 1] = float("-inf")
        h[:, index] = 0.0


def check_new_token(pool: torch.Tensor, new: NewToken) -> None:
    _check(pool, new.summaries, new.k, new.v, new.tail_slot, new.count)


def _check(pool: torch.Tensor, summaries: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           tail_slot: torch.Tensor, num_tokens: torch.Tensor) -> None:
    h, d = k.shape
    if pool.dim() != 5 or pool.shape[1:3] != (2, h) or pool.shape[4] != d or pool.dtype != torch.float16:
        raise ValueError(f"pool: expected fp16 [S, 2, {h}, B, {d}], got {pool.dtype} {list(pool.shape)}")
    if summaries.dim() != 4 or summaries.shape[1:] != (2, h, d) or summaries.dtype != torch.float16:
        raise ValueError(f"summaries: expected fp16 [N, 2, {h}, {d}], got {summaries.dtype} {list(summaries.shape)}")
    if k.shape != v.shape or k.dtype != torch.float16 or v.dtype != torch.float16:
        raise ValueError(f"k, v: expected fp16 [{h}, {d}] each, got {k.dtype} {list(k.shape)}, {v.dtype} {list(v.shape)}")
    if pool.stride(4) != 1 or summaries.stride(3) != 1 or k.stride(1) != 1 or v.stride() != k.stride():
        raise ValueError("pool, summaries, k and v need a contiguous last dim (and k, v the same strides)")
    for name, t in (("tail_slot", tail_slot), ("num_tokens", num_tokens)):
        if t.dtype != torch.int64 or t.numel() != 1:
            raise ValueError(f"{name}: expected int64 [1], got {t.dtype} {list(t.shape)}")

"""Quest block scores (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference"), fused: one pass over the block summaries.

For q head i and block b with key bounds min_b, max_b, every key k in b obeys
    q_i . k <= sum_d max(q_id * max_bd, q_id * min_bd) = q_i+ . max_b + q_i- . min_b
with q+ = max(q, 0), q- = min(q, 0). The right-hand form is two dot products, so
the kernel can put it on tensor cores. A kv head's score is the max over its GQA
group's q heads (default): the max of upper bounds bounds every head's logits,
so a block that one head needs is never outranked by being useless to the
others (with "sum", the group's total, it could be). Scores are float32
[kv_heads, num_blocks].

The scan is memory-bound: each program reads the min and max rows of BLOCK_N
blocks for one kv head exactly once (2 * head_dim * 2 bytes per block and head
in fp16, half that in fp8), and its q group, which every program shares, from
L2. It can also write +inf over the protected blocks, so `torch.topk` keeps
them without a separate masking pass.

Layout: kernel -> launcher -> pure-torch reference. Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SUMMARY_DTYPES = (torch.float16, torch.float8_e4m3fn)


@triton.jit
def _quest_tile(q_ptr, s_ptr, count_ptr, offs_n, head, num_blocks, sink_blocks, recent, block_tokens, stride_qh,
                stride_sn, stride_sm, stride_sh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, REDUCE_MAX: tl.constexpr,
                USE_DOT: tl.constexpr, DEVICE_COUNTS: tl.constexpr):
    """float32 [BLOCK_N]: kv head `head`'s scores of blocks offs_n (protection applied)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < num_blocks
    mask_d = offs_d < HEAD_DIM
    tile = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + head * stride_sh + offs_d[None, :]
    if DEVICE_COUNTS:  # the captured decode step: the sequence grows under a fixed launch over its capacity
        n = tl.load(count_ptr) + 1  # tokens once the current one is appended
        live = (n + block_tokens - 1) // block_tokens
        tile_mask = ((offs_n < live) & mask_n)[:, None] & mask_d[None, :]  # capacity past the sequence: unread
    else:
        tile_mask = mask_n[:, None] & mask_d[None, :]
    k_min = tl.load(tile, mask=tile_mask, other=0.0).to(tl.float16)  # [BLOCK_N, BLOCK_D]
    k_max = tl.load(tile + stride_sm, mask=tile_mask, other=0.0).to(tl.float16)
    q_row = head * GROUP
    if USE_DOT:
        offs_g = tl.arange(0, GROUP_PAD)
        q_ptrs = q_ptr + (q_row + offs_g)[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=(offs_g < GROUP)[:, None] & mask_d[None, :], other=0.0)  # [GROUP_PAD, BLOCK_D]
        zero = tl.zeros_like(q)
        bound = tl.dot(k_max, tl.trans(tl.maximum(q, zero)))  # [BLOCK_N, GROUP_PAD] float32
        bound = tl.dot(k_min, tl.trans(tl.minimum(q, zero)), bound)
        if REDUCE_MAX:
            score = tl.max(tl.where((offs_g < GROUP)[None, :], bound, float("-inf")), axis=1)
        else:
            score = tl.sum(bound, axis=1)  # padded q rows are 0
    else:
        k_min32 = k_min.to(tl.float32)
        k_max32 = k_max.to(tl.float32)
        if REDUCE_MAX:
            score = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        else:
            score = tl.zeros((BLOCK_N,), tl.float32)
        for g in tl.static_range(GROUP):
            q = tl.load(q_ptr + (q_row + g) * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            b = tl.sum(tl.maximum(q, 0.0)[None, :] * k_max32 + tl.minimum(q, 0.0)[None, :] * k_min32, axis=1)
            if REDUCE_MAX:
                score = tl.maximum(score, b)
            else:
                score = score + b
    # Only protected blocks may score +inf, or topk could drop one of them.
    score = tl.where(score != score, float("-inf"), tl.minimum(score, 3.4028234663852886e38))  # NaN -> -inf
    if DEVICE_COUNTS:
        start = tl.minimum(tl.maximum(n - recent, 0) // block_tokens, live - 1)
        protected = (offs_n < sink_blocks) | (offs_n >= start)
        score = tl.where(offs_n < live, tl.where(protected, float("inf"), score), float("-inf"))
    else:
        protected = (offs_n < sink_blocks) | (offs_n >= recent)
        score = tl.where(protected, float("inf"), score)
    return score


@triton.jit(do_not_specialize=["num_blocks", "sink_blocks", "recent", "block_tokens"])  # one compile per decode run
def _quest_kernel(
    q_ptr,  # float16 [num_q_heads, HEAD_DIM]
    s_ptr,  # float16 or float8e4nv [num_blocks, 2, kv_heads, HEAD_DIM]
    out_ptr,  # float32 [kv_heads, num_blocks]
    count_ptr,  # DEVICE_COUNTS: int64 [1], tokens held before the current one
    num_blocks,
    sink_blocks,  # blocks [0, sink_blocks) score +inf, and the recent ones:
    recent,  # [recent, num_blocks) (the first block of the window); DEVICE_COUNTS: the window's tokens
    block_tokens,  # DEVICE_COUNTS only
    stride_qh,
    stride_sn,
    stride_sm,
    stride_sh,
    stride_oh,
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_PAD: tl.constexpr,  # >= max(GROUP, 16), a power of two: tl.dot's minimum
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REDUCE_MAX: tl.constexpr,
    USE_DOT: tl.constexpr,
    DEVICE_COUNTS: tl.constexpr,  # count from count_ptr: blocks past it score -inf, the window from it
):
    head = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    score = _quest_tile(q_ptr, s_ptr, count_ptr, offs_n, head, num_blocks, sink_blocks, recent, block_tokens,
                        stride_qh, stride_sn, stride_sm, stride_sh, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_N,
                        REDUCE_MAX, USE_DOT, DEVICE_COUNTS)
    tl.store(out_ptr + head * stride_oh + offs_n, score, mask=offs_n < num_blocks)


def check_inputs(q: torch.Tensor, summaries: torch.Tensor, group_reduce: str) -> tuple[int, int, int]:
    """(num_blocks, kv_heads, group) or ValueError."""
    if summaries.dim() != 4 or summaries.shape[1] != 2 or summaries.dtype not in _SUMMARY_DTYPES:
        raise ValueError(
            f"summaries: expected float16 or float8_e4m3fn [num_blocks, 2, kv_heads, head_dim], "
            f"got {summaries.dtype} {list(summaries.shape)}"
        )
    num_blocks, _, num_kv_heads, head_dim = summaries.shape
    if q.dim() != 2 or q.shape[1] != head_dim or q.dtype != torch.float16:
        raise ValueError(f"q: expected float16 [num_q_heads, {head_dim}], got {q.dtype} {list(q.shape)}")
    if q.shape[0] % num_kv_heads:
        raise ValueError(f"q: num_q_heads ({q.shape[0]}) must be a multiple of kv_heads ({num_kv_heads})")
    if q.device != summaries.device:
        raise ValueError(f"q is on {q.device} but summaries on {summaries.device}")
    if group_reduce not in ("max", "sum"):
        raise ValueError(f"group_reduce must be 'max' or 'sum', got {group_reduce!r}")
    return num_blocks, num_kv_heads, q.shape[0] // num_kv_heads


def quest_scores(
    q: torch.Tensor,
    summaries: torch.Tensor,
    *,
    group_reduce: str = "max",
    sink_blocks: int = 0,
    recent_start: int | None = None,
    use_dot: bool = True,
    block_n: int = 64,
    num_warps: int = 8,
) -> torch.Tensor:
    """float32 [kv_heads, num_blocks] Quest upper bounds; blocks outside [sink_blocks, recent_start) get +inf.

    q: float16 [num_q_heads, head_dim]; summaries: float16 or float8_e4m3fn
    [num_blocks, 2, kv_heads, head_dim], last dim contiguous. The defaults protect nothing.
    use_dot picks tensor-core dot products over an fp32 elementwise loop (same math);
    use_dot, block_n and num_warps are tuning knobs (bench_longctx/select_bench.py sweeps them).
    """
    num_blocks = check_inputs(q, summaries, group_reduce)[0]
    recent_start = num_blocks if recent_start is None else recent_start
    return _launch(q, summaries, None, sink_blocks, recent_start, 1, group_reduce, use_dot, block_n, num_warps)


def quest_scores_live(q: torch.Tensor, summaries: torch.Tensor, count: torch.Tensor, *, block_tokens: int,
                      sink_blocks: int, recent_tokens: int, group_reduce: str = "max") -> torch.Tensor:
    """float32 [kv_heads, capacity] scores of a preallocated table whose length lives on the device.

    count: int64 [1], tokens held before the current token (which the table already holds: n = count + 1).
    Blocks past ceil(n / block_tokens) score -inf; the first sink_blocks and every block holding one of the
    last recent_tokens tokens (the tail included) score +inf; the rest their Quest bound. One launch, no host
    sync: what the captured decode step (kvstore/decode/step.py) replays as the sequence grows.
    """
    check_inputs(q, summaries, group_reduce)
    if count.dtype != torch.int64 or count.numel() != 1 or count.device != q.device:
        raise ValueError(f"count: expected int64 [1] on {q.device}, got {count.dtype} {list(count.shape)} "
                         f"on {count.device}")
    return _launch(q, summaries, count, sink_blocks, recent_tokens, block_tokens, group_reduce, True, LIVE_BLOCK_N,
                   LIVE_WARPS)


def quest_scores_live_ref(q: torch.Tensor, summaries: torch.Tensor, count: torch.Tensor, *, block_tokens: int,
                          sink_blocks: int, recent_tokens: int, group_reduce: str = "max") -> torch.Tensor:
    """`quest_scores_live` in torch (unwritten capacity may hold anything: non-finite bounds count as 0)."""
    bound = quest_scores_ref(q, summaries.nan_to_num(0.0, 0.0, 0.0), group_reduce=group_reduce)
    bound = bound.nan_to_num(0.0, 0.0, 0.0)  # [H, N]
    live, protected = live_and_protected(count, summaries.shape[0], block_tokens=block_tokens,
                                         sink_blocks=sink_blocks, recent_tokens=recent_tokens)
    return bound.masked_fill(protected, float("inf")).masked_fill(~live, float("-inf"))


def live_and_protected(count: torch.Tensor, capacity: int, *, block_tokens: int, sink_blocks: int,
                       recent_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [capacity] each, from the device count (tokens before the current one; no host sync): the
    blocks the sequence holds once the current token is in, and among them the protected ones (the first
    sink_blocks and every block holding one of the last recent_tokens tokens, the tail included).
    The same arithmetic as the kernel's DEVICE_COUNTS branch."""
    n = count + 1  # [1]
    live = (n + block_tokens - 1) // block_tokens
    start = torch.minimum(torch.clamp(n - recent_tokens, min=0) // block_tokens, live - 1)
    blocks = torch.arange(capacity, device=count.device)  # [N]
    return blocks < live, ((blocks < sink_blocks) | (blocks >= start)) & (blocks < live)


# The decode step's tile (quest_scores_live, and batch_kernels.quest_scores_rows: a row scores what its
# sequence scores alone): 32 blocks a program, 2 warps. 12 tables of 2,048 live 64-token blocks (d128, 8 kv
# heads) on an H100: 54 us (1.9 TB/s of summaries) against 104 us at 64 blocks and 8 warps (BENCHMARKS.md)
LIVE_BLOCK_N, LIVE_WARPS = 32, 2


def _launch(q: torch.Tensor, summaries: torch.Tensor, count: torch.Tensor | None, sink_blocks: int,
            recent: int, block_tokens: int, group_reduce: str, use_dot: bool, block_n: int,
            num_warps: int) -> torch.Tensor:
    if summaries.stride(3) != 1 or q.stride(1) != 1:
        raise ValueError(f"q and summaries need a contiguous last dim, got strides {q.stride()} {summaries.stride()}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    num_blocks, _, num_kv_heads, head_dim = summaries.shape
    out = torch.empty(num_kv_heads, num_blocks, dtype=torch.float32, device=q.device)  # [H, N]
    if num_blocks == 0:
        return out
    group = q.shape[0] // num_kv_heads
    grid = (triton.cdiv(num_blocks, block_n), num_kv_heads)
    _quest_kernel[grid](
        q, summaries, out, out if count is None else count, num_blocks, sink_blocks, recent, block_tokens,
        q.stride(0), summaries.stride(0), summaries.stride(1), summaries.stride(2), out.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        REDUCE_MAX=group_reduce == "max",
        USE_DOT=use_dot,
        DEVICE_COUNTS=count is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def quest_scores_ref(q: torch.Tensor, summaries: torch.Tensor, *, group_reduce: str = "max") -> torch.Tensor:
    """Pure-torch reference of `quest_scores` (no protection): float32 [kv_heads, num_blocks].

    Uses the q+ . max + q- . min form as two batched matmuls, so it also serves as
    the CPU path at long context without materializing [heads, blocks, head_dim].
    """
    num_blocks, num_kv_heads, group = check_inputs(q, summaries, group_reduce)
    k_min, k_max = summaries.float().permute(1, 2, 3, 0)  # each [H, D, N]
    qg = q.float().view(num_kv_heads, group, -1)  # [H, G, D]
    bound = torch.bmm(qg.clamp(min=0), k_max) + torch.bmm(qg.clamp(max=0), k_min)  # [H, G, N]
    return bound.amax(1) if group_reduce == "max" else bound.sum(1)

"""Test cases for the paged decode kernel (tests/kvstore/attention/): pools and block tables built from dense K/V.

Each used (row, kv head, block) gets its own slot in the hot or warm pool; everything the kernel must not read
is poisoned (NaN in unused slots and heads, in the tails of partial blocks and in their v_scale; garbage slot
ids past each row's end), so a stray read shows up as NaN or a wrong answer. The dense answers (output, block
mass, log-sum-exp) come from the true K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tiers.quant import dequantize, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPARE_SLOTS = 3  # never referenced: poisoned


@dataclass
class Case:
    q: torch.Tensor  # fp16 [B, Hq, D]
    hot: torch.Tensor  # fp16 [n_hot, 2, H, T, D]
    warm_data: torch.Tensor  # int8 [n_warm, 2, H, T, D], or fp8 / int4 (tiers/layout.py)
    k_scale: torch.Tensor  # f32 [n_warm, H, D] (int4: f16 [n_warm, 2, H, T // gk, D])
    v_scale: torch.Tensor  # f32 [n_warm, H, T] (int4: f16 [n_warm, 2, H, T, D // gv])
    table: torch.Tensor  # int32 [B, H, max_blocks]
    is_int8: torch.Tensor  # bool [B, H, max_blocks]
    num_tokens: torch.Tensor  # int32 [B]
    k_true: torch.Tensor  # f32 [B, H, max_blocks * T, D]: what the pools hold, int8 blocks dequantized
    v_true: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.hot, self.warm_data, self.k_scale, self.v_scale, self.table, self.is_int8,
                self.num_tokens)


def _assign_slots(used: torch.Tensor, is_int8: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A distinct slot per used entry in its pool; garbage (never a valid read) elsewhere."""
    table = torch.randint(-(2**30), 2**30, used.shape, generator=gen, dtype=torch.int32)
    for pool in (used & ~is_int8, used & is_int8):
        n = int(pool.sum())
        table[pool] = torch.randperm(n + SPARE_SLOTS, generator=gen)[:n].int()
    return table


def _fill_pools(case_shape, table, is_int8, used, k, v):
    """Scatter dense K/V [B, H, S, D] into the pools; returns (hot, warm fp16, warm rows that hold data)."""
    batch, heads, block_tokens, head_dim = case_shape
    n_hot = int((used & ~is_int8).sum()) + SPARE_SLOTS
    n_warm = int((used & is_int8).sum()) + SPARE_SLOTS
    hot = torch.full((n_hot, 2, heads, block_tokens, head_dim), float("nan"), dtype=torch.float16)
    warm = torch.randn((n_warm, 2, heads, block_tokens, head_dim)).half()  # unused heads: quantized noise
    warm_used = torch.zeros((n_warm, heads), dtype=torch.bool)
    for b, th, j in used.nonzero().tolist():
        slot = int(table[b, th, j])
        for h in range(heads) if table.shape[1] == 1 else [th]:
            tokens = slice(j * block_tokens, (j + 1) * block_tokens)
            pool = warm if is_int8[b, th, j] else hot
            pool[slot, 0, h], pool[slot, 1, h] = k[b, h, tokens], v[b, h, tokens]
            if is_int8[b, th, j]:
                warm_used[slot, h] = True
    return hot, warm, warm_used


def make_case(lengths: list[int], heads: int, group: int, head_dim: int, block_tokens: int, frac_int8: float,
              *, seed: int = 0, shared_table: bool = False, pad_blocks: int = 2, empty_pool: str | None = None,
              sinks_recent: tuple[int, int] | None = None, warm_format: str = "int8", int4_group: int = 32) -> Case:
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    n_blocks = [-(-n // block_tokens) for n in lengths]
    max_blocks = max(n_blocks) + pad_blocks
    k = torch.randn((batch, heads, max_blocks * block_tokens, head_dim), generator=gen).half()
    v = torch.randn((batch, heads, max_blocks * block_tokens, head_dim), generator=gen).half()
    q = (torch.randn((batch, heads * group, head_dim), generator=gen) * 1.5).half()
    table_heads = 1 if shared_table else heads
    is_int8 = torch.rand((batch, table_heads, max_blocks), generator=gen) < frac_int8
    if empty_pool is not None:
        is_int8[:] = empty_pool == "hot"
    if sinks_recent is not None:  # the decode step's table: first and last blocks of each row fp16, the rest int8
        for b, nb in enumerate(n_blocks):
            is_int8[b] = True
            is_int8[b, :, : sinks_recent[0]] = False
            is_int8[b, :, max(0, nb - sinks_recent[1]) : nb] = False
    used = torch.arange(max_blocks)[None, None, :] < torch.tensor(n_blocks)[:, None, None]
    used = used.expand(batch, table_heads, max_blocks)
    table = _assign_slots(used, is_int8, gen)
    hot, warm_fp16, warm_used = _fill_pools((batch, heads, block_tokens, head_dim), table, is_int8, used, k, v)
    warm = quantize(warm_fp16, warm_format, int4_group)
    k_true, v_true = _true_kv(k, v, table, is_int8, used, dequantize(warm), block_tokens)
    for scales in (warm.k_scale, warm.v_scale):  # int4's (scale, zero) [n, 2, H, ...]: heads on dim 2
        (scales.transpose(1, 2) if scales.dim() == 5 else scales)[~warm_used] = float("nan")
    _poison_tails(lengths, n_blocks, table, is_int8, hot, warm, block_tokens)
    if empty_pool == "hot":
        hot = hot[:0]
    if empty_pool == "warm":
        warm = warm.index(slice(0, 0))
    expand = (batch, heads, max_blocks)
    return Case(q.to(DEVICE), hot.to(DEVICE), warm.data.to(DEVICE), warm.k_scale.to(DEVICE),
                warm.v_scale.to(DEVICE), table.to(DEVICE).expand(expand), is_int8.to(DEVICE).expand(expand),
                torch.tensor(lengths, dtype=torch.int32, device=DEVICE), k_true, v_true)


def _true_kv(k, v, table, is_int8, used, warm_deq, block_tokens):
    """Dense K/V as the pools hold them: fp16 blocks exact, int8 blocks after the codec's round trip."""
    k_true, v_true = k.float(), v.float()
    for b, th, j in (used & is_int8).nonzero().tolist():
        slot, tokens = int(table[b, th, j]), slice(j * block_tokens, (j + 1) * block_tokens)
        for h in range(k.shape[1]) if table.shape[1] == 1 else [th]:
            k_true[b, h, tokens] = warm_deq[slot, 0, h].float()
            v_true[b, h, tokens] = warm_deq[slot, 1, h].float()
    return k_true, v_true


def _poison_tails(lengths, n_blocks, table, is_int8, hot, warm, block_tokens):
    """Tokens past num_tokens in each row's last block: NaN (fp16) or garbage data and NaN v_scale (int8)."""
    for b, (n, nb) in enumerate(zip(lengths, n_blocks)):
        r = n - (nb - 1) * block_tokens
        for th in range(table.shape[1]):
            if n == 0 or r == block_tokens:
                continue
            slot = int(table[b, th, nb - 1])
            for h in range(hot.shape[2]) if table.shape[1] == 1 else [th]:
                if is_int8[b, th, nb - 1]:
                    warm.data[slot, :, h, r:] = 127
                    if warm.v_scale.dim() == 5:  # int4: V's (scale, zero) per token; K's groups hold real tokens
                        warm.v_scale[slot, :, h, r:] = float("nan")
                    else:
                        warm.v_scale[slot, h, r:] = float("nan")
                else:
                    hot[slot, :, h, r:] = float("nan")


def dense_expected(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA over the true K/V of each row, and the per-block mass from an explicit softmax."""
    batch, num_q_heads, head_dim = case.q.shape
    heads, max_blocks = case.table.shape[1], case.table.shape[2]
    block_tokens = case.hot.shape[3]
    out = torch.zeros((batch, num_q_heads, head_dim))
    mass = torch.zeros((batch, heads, max_blocks))
    for b, n in enumerate(case.num_tokens.tolist()):
        if n == 0:
            continue
        q, k, v = case.q[b].float().cpu()[None, :, None], case.k_true[b, :, :n][None], case.v_true[b, :, :n][None]
        out[b] = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[0, :, 0]
        group = num_q_heads // heads
        scores = q[0] @ k[0].repeat_interleave(group, 0).transpose(1, 2) * head_dim**-0.5  # [Hq, 1, n]
        p = F.pad(torch.softmax(scores[:, 0], -1), (0, max_blocks * block_tokens - n))  # [Hq, S]
        mass[b] = p.view(heads, group, max_blocks, block_tokens).sum(-1).mean(1)
    return out, mass


CASES = {  # lengths, kv heads, group, head_dim, block_tokens, fraction int8, kwargs
    "gqa4_mixed": ([37, 70, 5], 2, 4, 64, 16, 0.5, {}),
    "gqa1_tiny_blocks": ([50, 13], 3, 1, 32, 8, 0.3, {"num_splits": 3}),
    "gqa3_partial": ([100, 33], 2, 3, 64, 32, 0.7, {}),
    "gqa8_d128": ([61], 1, 8, 128, 16, 0.5, {"num_splits": 2}),
    "all_fp16_warm_present": ([45, 80], 2, 4, 32, 16, 0.0, {}),
    "all_int8_hot_present": ([45, 80], 2, 4, 32, 16, 1.0, {}),
    "shared_table_dense_mode": ([29, 64], 2, 2, 32, 16, 0.5, {"shared_table": True}),
    "full_blocks_only": ([64, 32], 2, 2, 32, 16, 0.5, {}),
    "empty_row": ([0, 40], 2, 2, 32, 16, 0.5, {}),
    "warm_pool_empty": ([77], 2, 4, 32, 16, 0.0, {"empty_pool": "warm"}),
    "hot_pool_empty": ([77], 2, 4, 32, 16, 1.0, {"empty_pool": "hot"}),
    "block_tokens_128": ([300], 1, 4, 32, 128, 0.5, {"num_splits": 2}),
    # the other warm formats (tiers/quant.py): one-tile and split walks, mixed and warm-only tables
    "fp8_mixed": ([37, 70, 5], 2, 4, 64, 16, 0.5, {"warm_format": "fp8"}),
    "fp8_split": ([100, 33], 2, 3, 64, 32, 0.7, {"warm_format": "fp8", "num_splits": 3}),
    "fp8_hot_pool_empty": ([77], 2, 4, 32, 16, 1.0, {"empty_pool": "hot", "warm_format": "fp8", "num_splits": 2}),
    "int4_mixed": ([37, 70, 5], 2, 4, 64, 16, 0.5, {"warm_format": "int4"}),
    "int4_split_small_groups": ([100, 33], 2, 3, 64, 32, 0.7,
                                {"warm_format": "int4", "int4_group": 8, "num_splits": 3}),
    "int4_hot_pool_empty": ([77], 2, 4, 32, 16, 1.0, {"empty_pool": "hot", "warm_format": "int4", "num_splits": 2}),
}
CASE_KEYS = ("shared_table", "empty_pool", "sinks_recent", "warm_format", "int4_group")


def build_case(name: str) -> tuple[Case, dict]:
    lengths, heads, group, head_dim, block_tokens, frac, kwargs = CASES[name]
    build = {k: v for k, v in kwargs.items() if k in CASE_KEYS}
    run = {k: v for k, v in kwargs.items() if k not in CASE_KEYS}
    seed = sum(map(ord, name))
    return make_case(lengths, heads, group, head_dim, block_tokens, frac, seed=seed, **build), run


def dense_lse(case: Case) -> torch.Tensor:
    """float32 [B, Hq]: log-sum-exp of each q head's scaled logits over its row's true keys (-inf: no tokens)."""
    batch, num_q_heads, head_dim = case.q.shape
    group = num_q_heads // case.table.shape[1]
    lse = torch.full((batch, num_q_heads), float("-inf"))
    for b, n in enumerate(case.num_tokens.tolist()):
        if n:
            k = case.k_true[b, :, :n].repeat_interleave(group, 0)  # [Hq, n, D]
            lse[b] = torch.logsumexp((k @ case.q[b].float().cpu()[:, :, None])[..., 0] * head_dim**-0.5, -1)
    return lse

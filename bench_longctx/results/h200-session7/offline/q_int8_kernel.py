"""Session 7 experiment (not part of kvtier): the warm-only split loop with Q.K^T on int8 tensor cores. K stays in
its int8 codes; its per-(block, channel) scale is folded into the query, which is quantized per row and block
(q_int8_study.py measures what that costs in accuracy); V is dequantized as in kvstore/attention/tiles.py.
Direct walk only (the table is the row), batch 1, one block per iteration, block mass stored per block.
Offline sm_90 compile (count.py): 127 registers, 35.6 KB shared (4 programs per SM), 641 loop instructions per
64 tokens against the tile loop's 739 (and 183 registers, 104 KB: 2 programs per SM). Checked against a torch
model of the same arithmetic in the interpreter (`python q_int8_kernel.py`, TRITON_INTERPRET=1); not timed.
"""
import math
import sys

import torch
import triton
import triton.language as tl
from kvstore.attention.tiles import words_to_fp16


@triton.jit
def _imma_kernel(q_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, table_ptr, num_tokens_ptr, o_part_ptr, lse_part_ptr,
                 lse_block_ptr, s_q_head, s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok, s_ks_slot, s_ks_head,
                 s_vs_slot, s_vs_head, s_tab_head, qk_scale, blocks_per_split, num_splits, max_blocks, num_q_heads,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                 USE_ASM: tl.constexpr):
    head = tl.program_id(1)
    split = tl.program_id(2)
    n_tok = tl.load(num_tokens_ptr)
    n_blocks = tl.minimum(tl.cdiv(n_tok, BLOCK_TOKENS), max_blocks)
    lo = split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, n_blocks)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK_TOKENS)
    offs_w = tl.arange(0, HEAD_DIM // 4)
    g_ok = offs_g < GROUP
    q_head = head * GROUP + offs_g
    q = tl.load(q_ptr + q_head[:, None] * s_q_head + offs_d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
    lse_rows = lse_block_ptr + q_head * max_blocks
    slot_row = table_ptr + head * s_tab_head
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j in range(lo, hi):
        slot = tl.load(slot_row + j).to(tl.int64)
        base = warm_ptr + slot * s_warm_slot + head * s_warm_head
        k8 = tl.load(base + offs_t[:, None] * s_warm_tok + offs_d[None, :])  # int8 [T, D]
        k_scale = tl.load(k_scale_ptr + slot * s_ks_slot + head * s_ks_head + offs_d)  # [D]
        qs = q * k_scale[None, :]  # [M, D] fp32
        amax = tl.max(tl.abs(qs), 1)  # [M]
        step = tl.where(amax > 0, amax / 127.0, 1.0)
        q8 = (qs / step[:, None] + tl.where(qs >= 0, 0.5, -0.5)).to(tl.int8)
        s = tl.dot(q8, tl.trans(k8)).to(tl.float32) * (step * qk_scale)[:, None]  # [M, T]
        tok_ok = j * BLOCK_TOKENS + offs_t < n_tok
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vbase = (base + s_warm_kv).to(tl.pointer_type(tl.int32))
        vw = tl.load(vbase + offs_t[:, None] * (s_warm_tok // 4) + offs_w[None, :])  # int32 [T, D/4]
        v = tl.reshape(words_to_fp16(vw, USE_ASM), [BLOCK_TOKENS, HEAD_DIM])
        vs = tl.load(v_scale_ptr + slot * s_vs_slot + head * s_vs_head + offs_t, mask=tok_ok, other=0.0)
        acc = tl.dot((p * (vs * 256.0)[None, :]).to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
        tl.store(lse_rows + j, m_new + tl.log2(tl.sum(p, 1)), mask=g_ok)
    acc = acc / 256.0
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    part = q_head * num_splits + split
    tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=g_ok[:, None])
    tl.store(lse_part_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_ok)


def q_int8_partials(q, warm_data, k_scale, v_scale, table, num_tokens, num_splits, use_asm):
    """q fp16 [Hq, D], warm int8 [n, 2, H, T, D], table int32 [H, blocks] -> (o_part [Hq, S, D], lse_part [Hq, S],
    lse_block [Hq, blocks]) as kvstore/attention/merge.py reads them (batch 1)."""
    nq, d = q.shape
    h, max_blocks = table.shape
    t = warm_data.shape[3]
    per_split = -(-max_blocks // num_splits)
    o_part = torch.zeros((nq, num_splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.full((nq, num_splits), float("-inf"), device=q.device)
    lse_block = torch.full((nq, max_blocks), float("-inf"), device=q.device)
    _imma_kernel[(1, h, num_splits)](
        q, warm_data, k_scale, v_scale, table, num_tokens, o_part, lse_part, lse_block,
        q.stride(0), *warm_data.stride()[:4], k_scale.stride(0), k_scale.stride(1), v_scale.stride(0),
        v_scale.stride(1), table.stride(0), d**-0.5 * 1.4426950408889634, per_split, num_splits, max_blocks, nq,
        GROUP=nq // h, GROUP_PAD=max(16, triton.next_power_of_2(nq // h)), HEAD_DIM=d, BLOCK_TOKENS=t,
        USE_ASM=use_asm, num_warps=4, num_stages=2)
    return o_part, lse_part, lse_block


def model(q, warm_data, k_scale, v_scale, table, n_tok):
    """The same arithmetic in torch: softmax over the row's tokens of the int8-q logits, V dequantized."""
    nq, d = q.shape
    h = table.shape[0]
    t = warm_data.shape[3]
    out = torch.zeros((nq, d))
    for qh in range(nq):
        head = qh // (nq // h)
        slots = table[head, : -(-n_tok // t)].long()
        codes_k = warm_data[slots, 0, head].float()  # [b, T, D]
        codes_v = warm_data[slots, 1, head].float()
        qs = q[qh].float()[None] * k_scale[slots, head]  # [b, D]
        step = qs.abs().amax(1, keepdim=True) / 127
        q8 = torch.where(qs >= 0, qs / step + 0.5, qs / step - 0.5).trunc()
        logits = (codes_k * q8[:, None]).sum(-1) * step * d**-0.5  # [b, T]
        logits = logits.flatten()[:n_tok]
        v = (codes_v * v_scale[slots, head][..., None]).reshape(-1, d)[:n_tok]
        out[qh] = torch.softmax(logits, 0) @ v
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    h, group, d, t, blocks, n_tok = 2, 4, 64, 16, 7, 100
    q = (torch.randn((h * group, d)) * 1.5).half()
    warm = torch.randint(-127, 128, (blocks + 2, 2, h, t, d), dtype=torch.int8)
    k_scale = torch.rand((blocks + 2, h, d)) * 0.02 + 0.005
    v_scale = torch.rand((blocks + 2, h, t)) * 0.02 + 0.005
    table = torch.stack([torch.randperm(blocks + 2)[:blocks] for _ in range(h)]).int()
    o_part, lse_part, _ = q_int8_partials(q, warm, k_scale, v_scale, table, torch.tensor([n_tok], dtype=torch.int32),
                                          3, False)
    w = torch.softmax(lse_part * math.log(2), -1).nan_to_num(0.0)  # merge the splits
    out = (w[..., None] * o_part).sum(1)
    expected = model(q, warm, k_scale, v_scale, table, n_tok)
    err = (out - expected).abs().max().item()
    print(f"max abs error vs the torch model: {err:.2e}")
    sys.exit(0 if err < 1e-3 else 1)

import sys, math, itertools, torch, triton
sys.path.insert(0, ".")
from tests.eviction.test_sketch_kernel import make_case
from eviction.sketch_channels import channel_block_stats_ref, _plan_kernel, _channel_kernel
from eviction.sketch_kernel import check_inputs

def launch(q, summaries, codes, num_tokens, channels, bpp, nw, gmin=1, hmin=1):
    num_blocks, H, B = check_inputs(q, summaries, codes, num_tokens)
    lse = torch.empty(q.shape[0], num_blocks, dtype=torch.float32, device=q.device); upper = torch.empty_like(lse)
    group, D = q.shape[0] // H, summaries.shape[3]
    ch = torch.empty(H, channels, dtype=torch.int32, device=q.device)
    gp = max(triton.next_power_of_2(group), gmin); hp = max(triton.next_power_of_2(B // 2), hmin)
    _plan_kernel[(H,)](q, ch, q.stride(0), ch.stride(0), GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=D, CHANNELS=channels)
    full = num_tokens == num_blocks * B and B & (B - 1) == 0 and hp == B // 2
    _channel_kernel[(triton.cdiv(num_blocks, bpp), H)](q, summaries, codes, ch, lse, lse, upper, num_tokens, num_blocks,
        1.0 / math.sqrt(D), q.stride(0), summaries.stride(0), summaries.stride(1), summaries.stride(2), codes.stride(0),
        codes.stride(1), ch.stride(0), lse.stride(0), GROUP=group, GROUP_PAD=gp, HEAD_DIM=D, CHANNELS=channels,
        BLOCK_TOKENS=B, HALF_PAD=hp, BLOCKS=bpp, HAS_VALID=False, DECODE=1, num_warps=nw, FULL=full, num_stages=1)
    return lse, upper

def bad(got, want):
    return sum(not torch.allclose(g, w, rtol=1e-5, atol=1e-4) for g, w in zip(got, want))

for B, group, bpp, nw in itertools.product((16, 32, 64), (1, 2, 4), (4, 16), (1, 4)):
    q, s, c, k = make_case(40 * B - 3, B, 2, group, 64, seed=B + group)
    want = channel_block_stats_ref(q, s, c, k.shape[0], 16)
    r = [bad(launch(q, s, c, k.shape[0], 16, bpp, nw), want)]
    if r[0]:
        r += [bad(launch(q, s, c, k.shape[0], 16, bpp, nw, gmin=gm, hmin=hm), want) for gm, hm in ((2, 1), (4, 1), (16, 1), (1, 16), (4, 16))]
    print(f"B={B} group={group} bpp={bpp} nw={nw} mismatch={r[0]}" + (f" fixes(g2,g4,g16,h16,g4h16)={r[1:]}" if r[0] else ""), flush=True)

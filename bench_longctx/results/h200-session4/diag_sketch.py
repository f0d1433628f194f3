import sys, torch
sys.path.insert(0, ".")
import tests.eviction.test_sketch_channels as t
from bench_longctx.sketch_bench import true_block_lse
from eviction.sketch import sketch_keys
from eviction.sketch_channels import channel_block_stats, channel_block_stats_ref, read_channels_ref, _plan_kernel
import triton
torch.set_printoptions(precision=4, linewidth=200)
for scale in (1.0, 30.0):
    g = torch.Generator().manual_seed(2)
    head_dim, block_tokens, channels = 64, 16, 16
    q = torch.randn(head_dim, generator=g); q[:3] *= 20.0
    read = torch.zeros(head_dim, dtype=torch.bool)
    read[read_channels_ref(q.half()[None], 1, channels)[0]] = True
    keys = t._adversarial_keys(q, read, 12, block_tokens, g)
    norm = keys.norm(dim=-1).median()
    for pos in (40, 100, 150): keys[pos] = q / q.norm() * norm
    keys[16 * 5: 16 * 7] = 0.25
    keys = torch.cat((keys, torch.randn(5, head_dim, generator=g)))[:, None].half()
    s_cpu, c_cpu = sketch_keys(keys, block_tokens)
    s_gpu, c_gpu = sketch_keys(keys.cuda(), block_tokens)
    print("scale", scale, "sketch cpu==gpu", torch.equal(s_cpu, s_gpu.cpu()), torch.equal(c_cpu, c_gpu.cpu()))
    qh = (q * scale).half()[None]
    print("true cpu", true_block_lse(qh, keys, block_tokens))
    print("true gpu", true_block_lse(qh.cuda(), keys.cuda(), block_tokens).cpu())
    print("ref cpu ", channel_block_stats_ref(qh, s_cpu, c_cpu, keys.shape[0], channels)[1])
    print("ref gpu ", channel_block_stats_ref(qh.cuda(), s_cpu.cuda(), c_cpu.cuda(), keys.shape[0], channels)[1].cpu())
    ch = torch.empty(1, channels, dtype=torch.int32, device="cuda")
    _plan_kernel[(1,)](qh.cuda(), ch, qh.stride(0), ch.stride(0), GROUP=1, GROUP_PAD=1, HEAD_DIM=64, CHANNELS=channels)
    print("channels gpu", ch.sort().values.cpu().tolist(), "ref", read_channels_ref(qh, 1, channels).tolist())
    for bpp in (1, 4, 16):
        for dec in (0, 1):
            for nw in (1, 4):
                up = channel_block_stats(qh.cuda(), s_cpu.cuda(), c_cpu.cuda(), keys.shape[0], channels,
                                         blocks_per_program=bpp, decode=dec, num_warps=nw)[1].cpu()
                print(f"kern bpp={bpp} dec={dec} nw={nw}", up)

"""copy_sequence: one prefill serves stores that differ only in Config.recent_tokens."""

from __future__ import annotations

import pytest
import torch

from bench_longctx.models import copy_sequence
from kvstore import Config, KVStore, ModelSpec

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
TOKENS = 500  # not a whole number of 8-token blocks: the copy ends in a partial block too


def store(path, recent_tokens: int) -> KVStore:
    return KVStore(Config(model=SPEC, block_tokens=8, sink_tokens=8, hot_tokens=1024, warm_tokens=0,
                          recent_tokens=recent_tokens, gpu_bytes=1 << 20, cpu_bytes=1 << 20, staging_tokens=64,
                          ssd_path=str(path), ssd_bytes=64 << 20, device="cpu",
                          host_memory_reserve=0))


def filled(s: KVStore, seed: int) -> int:
    """A sequence of TOKENS random tokens appended in uneven chunks, as a chunked prefill would."""
    g = torch.Generator().manual_seed(seed)
    seq = s.create_sequence()
    s.extend_tokens(seq, torch.randint(0, 1000, (TOKENS,), generator=g).tolist())
    for start, end in ((0, 96), (96, 301), (301, TOKENS)):
        for layer in range(SPEC.num_layers):
            k = (torch.randn(end - start, 2, 16, generator=g) + torch.randn(16, generator=g)).half()
            s.append(seq, layer, k, torch.randn(end - start, 2, 16, generator=g).half())
    return seq


@pytest.mark.parametrize("mode", ["topk", "sketch", "cascade"])
def test_a_copy_decodes_like_its_source_and_with_its_own_window(tmp_path, mode):
    src, same, smaller = store(tmp_path / "src", 64), store(tmp_path / "same", 64), store(tmp_path / "smaller", 8)
    seq = filled(src, seed=1)
    copies = [copy_sequence(src, seq, dst) for dst in (same, smaller)]
    assert same.token_ids(copies[0]) == src.token_ids(seq)
    q = torch.randn(SPEC.num_q_heads, SPEC.head_dim, generator=torch.Generator().manual_seed(2)).half() * 3
    for layer in range(SPEC.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(same.read(copies[0], layer), src.read(seq, layer)))
        want = src.attend(seq, layer, q, mode=mode, budget=128)
        assert torch.equal(same.attend(copies[0], layer, q, mode=mode, budget=128), want)
        assert not torch.equal(smaller.attend(copies[1], layer, q, mode=mode, budget=128), want)
    for s in (src, same, smaller):
        s.check_integrity()
        s.close()

"""mode="cascade" in the captured decode step: the same blocks as store.attend's cascade (one _rerank), and
the needles Quest's bound misses found through the store."""

from __future__ import annotations

import torch

from eviction import CascadeTopK
from kvstore import Config, KVStore, ModelSpec
from tests.eviction.test_cascade import needle_haystack
from tests.kvstore.decode.test_step import SPEC, eager_path, tokens, twin_stores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_cascade_step_equals_the_eager_cascade(tmp_path):
    eager, stepped, sa, sb = twin_stores(tmp_path, 100, seed=0)
    step = stepped.decode_step(sb, mode="cascade", budget=128, capacity_tokens=1024)
    work = tokens(70, seed=1)  # 100 -> 170 tokens: the topk phase from 129, block boundaries
    differs_from_quest = 0
    for t in range(70):
        step.begin_token()
        for layer in range(SPEC.num_layers):
            q, k, v = work[t * SPEC.num_layers + layer]
            eager.append(sa, layer, k[None], v[None])
            want = eager_path(eager, sa, layer, q, "cascade", 128)
            got = step.attend(layer, q, k, v)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
            quest = eager_path(eager, sa, layer, q, "topk", 128)
            differs_from_quest += not torch.allclose(quest.float(), want.float(), atol=2e-3, rtol=2e-3)
        step.end_token()
    assert differs_from_quest > 0  # the cascade's rerank changed what was read
    stepped.check_integrity()
    eager.close(), stepped.close()


def test_cascade_step_reads_the_needles(tmp_path):
    """A haystack whose decoys outrank the needles in Quest's bound: the step's cascade output matches dense
    attention, the topk step's does not. 4 x k candidates (64 of the 256 blocks: at the default 16 x k every block
    would be one, and Quest's candidate stage would go untested)."""
    spec = ModelSpec(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=32)
    keys, q, _ = needle_haystack(seed=3)
    values = torch.randn(keys.shape, generator=torch.Generator().manual_seed(4)).half()
    errors = {}
    for mode in ("cascade", "topk", "dense"):
        store = KVStore(Config(model=spec, block_tokens=16, sink_tokens=16, hot_tokens=8192, warm_tokens=0,
                               recent_tokens=32, gpu_bytes=32 << 20, device=DEVICE, host_memory_reserve=0))
        store.policies["cascade"] = CascadeTopK(candidate_factor=4)
        seq = store.create_sequence()
        store.append(seq, 0, keys[:-1].to(DEVICE), values[:-1].to(DEVICE))
        step = store.decode_step(seq, mode=mode, budget=256)
        step.begin_token()
        out = step.attend(0, q.to(DEVICE), keys[-1].to(DEVICE), values[-1].to(DEVICE)).float()
        step.end_token()
        errors[mode] = out
        store.close()
    dense = errors.pop("dense")
    err = {m: float((o - dense).norm() / dense.norm()) for m, o in errors.items()}
    assert err["cascade"] < 0.15 and err["topk"] > 0.5, err  # the budget leaves ~7% of the mass out

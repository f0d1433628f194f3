"""Random interleavings of create/append/read/free with tiny budgets (hypothesis)."""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import CapacityError, Config, KVStore, ModelSpec
from tiers.quant import within_bound as within_int8

SPEC = ModelSpec(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=8)
BLOCK = 4


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        # Tiny budgets: a few hot/warm/cpu blocks, so every sequence spills through every tier.
        self.store = KVStore(Config(
            model=SPEC, block_tokens=BLOCK, sink_tokens=4, hot_tokens=8, warm_tokens=8,
            gpu_bytes=3 << 10, cpu_bytes=1 << 10, ssd_path=self.dir, ssd_bytes=1 << 24,
            device="cpu", host_memory_reserve=0,
        ))
        self.data: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.seqs: list[int] = []
        self.seed = 0

    @rule()
    def create(self) -> None:
        seq = self.store.create_sequence()
        self.seqs.append(seq)
        for layer in range(SPEC.num_layers):
            self.data[(seq, layer)] = (torch.empty(0, 1, 8).half(), torch.empty(0, 1, 8).half())

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 99), layer=st.integers(0, 1), tokens=st.sampled_from([1, 1, 2, 3, 5, 9, 17, 40]))
    def append(self, pick: int, layer: int, tokens: int) -> None:
        seq = self.seqs[pick % len(self.seqs)]
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        k, v = (torch.randn((tokens, 1, 8), generator=g).half() for _ in range(2))
        before = self.store.stats()
        try:
            self.store.append(seq, layer, k, v)
        except CapacityError:  # many live sequences can fill the hot pool with tail blocks
            assert self.store.stats() == before
            return
        old_k, old_v = self.data[(seq, layer)]
        self.data[(seq, layer)] = (torch.cat([old_k, k]), torch.cat([old_v, v]))

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 99), layer=st.integers(0, 1))
    def read(self, pick: int, layer: int) -> None:
        seq = self.seqs[pick % len(self.seqs)]
        want = self.data[(seq, layer)]
        if want[0].shape[0] == 0:
            return
        got = self.store.read(seq, layer)
        assert got[0].shape == want[0].shape
        assert within_int8(got, want, BLOCK)
        tail = (want[0].shape[0] - 1) // BLOCK * BLOCK  # the tail block is always hot and exact
        assert torch.equal(got[0][tail:], want[0][tail:]) and torch.equal(got[1][tail:], want[1][tail:])

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 99))
    def free(self, pick: int) -> None:
        seq = self.seqs.pop(pick % len(self.seqs))
        self.store.free(seq)
        for layer in range(SPEC.num_layers):
            del self.data[(seq, layer)]

    @invariant()
    def integrity_holds(self) -> None:
        self.store.check_integrity()

    def teardown(self) -> None:
        for seq in self.seqs:
            self.store.free(seq)
        self.store.check_integrity()
        stats = self.store.stats()["tiers"]
        assert all(t["blocks"] == 0 and t["bytes"] == 0 for t in stats.values()), stats
        assert self.store.tiers.cold._scan() == {}  # every ssd key removed
        assert all(t.slots.num_free == t.slots.num_slots for t in self.store.tiers.stack[:3])
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestStoreProperties = StoreMachine.TestCase

"""Faults and abuse: a tier that fails, damages bytes or vanishes mid-batch loses no block, and bad
input changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from kvstore import CapacityError, Config, IntegrityError, KVStore, ModelSpec
from kvstore.blocks.tier_stack import staging_bytes
from tiers.codec import HEADER_BYTES
from tiers.layout import BlockLayout

SPEC = ModelSpec(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64)
LAYOUT = BlockLayout.of(SPEC, 16)


def issue_config(tmp_path, **overrides) -> Config:
    """A store small enough to fill: 4 cpu blocks, 8 ssd blocks, tiny windows."""
    base = dict(model=SPEC, block_tokens=16, sink_tokens=16, hot_tokens=32, warm_tokens=32,
                gpu_bytes=32 * LAYOUT.fp16_bytes + staging_bytes(LAYOUT, 512), staging_tokens=512, cpu_bytes=4 * LAYOUT.fp16_bytes,
                ssd_path=str(tmp_path / "ssd"), ssd_bytes=8 * (LAYOUT.fp16_bytes + HEADER_BYTES + 64),
                device="cpu", host_memory_reserve=0, ssd_compression="none")
    return Config(**{**base, **overrides})


def kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((t, 2, 64), generator=g).half(), torch.randn((t, 2, 64), generator=g).half()


def snapshot(store: KVStore, seq: int) -> tuple:
    k, v = store.read(seq, 0)
    return store.sequences[seq][0].num_tokens, k.clone(), v.clone(), copy.deepcopy(store.stats()["tiers"])


def assert_unchanged(store: KVStore, seq: int, before: tuple) -> None:
    store.check_integrity()
    now = snapshot(store, seq)
    assert now[0] == before[0] and torch.equal(now[1], before[1]) and torch.equal(now[2], before[2])


class FaultyTier:
    """Wraps a tier: `fail_puts` puts raise, `fail_after` blocks of the next put land before it raises
    (unreachable mid-batch), `damage_gets` flips a byte of what get returns."""

    def __init__(self, tier, error: Exception) -> None:
        self.inner, self.error = tier, error
        self.fail_puts, self.fail_after, self.damage_gets = 0, None, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.inner

    def put(self, ids, blocks) -> None:
        if self.fail_after is not None:
            n, self.fail_after = self.fail_after, None
            self.inner.put(ids[:n], blocks[:n])
            raise self.error
        if self.fail_puts:
            self.fail_puts -= 1
            raise self.error
        self.inner.put(ids, blocks)

    def get(self, ids):
        blocks = self.inner.get(ids)
        if self.damage_gets:
            blocks = blocks.clone()
            blocks.view(torch.uint8).view(-1)[7] ^= 0x10
            raise IntegrityError("damaged in transit (injected)")
        return blocks

    def fetch(self, ids, device):
        return self.get(ids).to(device)

    def fetch_as_stored(self, ids, device):  # what decode staging reads from a tier holding both formats
        if self.damage_gets:
            raise IntegrityError("damaged in transit (injected)")
        return self.inner.fetch_as_stored(ids, device)


def inject(store: KVStore, index: int, error: Exception) -> FaultyTier:
    faulty = FaultyTier(store.tiers.stack[index], error)
    store.tiers.stack.tiers[index] = faulty
    store.tiers.hot, store.tiers.warm, store.tiers.cpu, store.tiers.cold = store.tiers.stack[:4]
    return faulty


def test_a_full_ssd_refuses_an_append_and_loses_nothing(tmp_path):
    store = KVStore(issue_config(tmp_path))
    seq = store.create_sequence()
    k, v = kv(16 * 80, seed=1)
    refused = None
    for step in range(80):  # cold tiers fill first; then blocks stay on the GPU past their windows
        before = snapshot(store, seq) if step else None
        try:
            store.append(seq, 0, k[16 * step: 16 * step + 16], v[16 * step: 16 * step + 16])
        except CapacityError:
            refused = step
            assert_unchanged(store, seq, before)
            break
        store.check_integrity()
    assert refused is not None and refused > 17  # a store that lost blocks did so at the 18th
    assert store.sequences[seq][0].num_tokens == 16 * refused


@pytest.mark.parametrize("error", [ConnectionError("sidecar unreachable"), MemoryError("full"), OSError("disk")])
def test_a_failing_cold_put_keeps_every_block_where_it_was(tmp_path, error):
    store = KVStore(issue_config(tmp_path, ssd_bytes=1 << 24))
    seq = store.create_sequence()
    k, v = kv(400, seed=2)
    store.append(seq, 0, k[:96], v[:96])
    faulty = inject(store, 3, error)
    faulty.fail_puts = 10
    for t in range(96, 160):  # decode steps: each block boundary cools blocks towards the failing tier
        before = snapshot(store, seq)
        try:
            store.append(seq, 0, k[t:t + 1], v[t:t + 1])
        except (CapacityError, type(error)):
            assert_unchanged(store, seq, before)
        store.check_integrity()
    faulty.fail_puts = 0
    store.append(seq, 0, k[160:400], v[160:400])
    store.check_integrity()
    got_k, _ = store.read(seq, 0)
    assert got_k.shape[0] == store.sequences[seq][0].num_tokens


def test_a_tier_that_vanishes_mid_batch_loses_nothing(tmp_path):
    store = KVStore(issue_config(tmp_path, ssd_bytes=1 << 24))
    seq = store.create_sequence()
    k, v = kv(600, seed=3)
    store.append(seq, 0, k[:64], v[:64])
    faulty = inject(store, 3, ConnectionError("connection reset mid-batch"))
    faulty.fail_after = 2  # two blocks of the next put land, then the connection drops
    before = snapshot(store, seq)
    with pytest.raises((ConnectionError, CapacityError)):
        store.append(seq, 0, k[64:600], v[64:600])  # a prefill chunk whose oldest blocks spill to ssd
    assert_unchanged(store, seq, before)
    assert store.tiers.cold.inner.num_blocks == store.stats()["tiers"]["ssd"]["blocks"]
    store.append(seq, 0, k[64:600], v[64:600])
    store.check_integrity()


def test_a_damaged_get_is_never_served_and_changes_nothing(tmp_path):
    store = KVStore(issue_config(tmp_path, ssd_bytes=1 << 24))
    seq = store.create_sequence()
    k, v = kv(300, seed=4)
    store.append(seq, 0, k, v)
    before = snapshot(store, seq)
    faulty = inject(store, 3, ConnectionError())
    faulty.damage_gets = True
    q = torch.randn(4, 64).half()
    with pytest.raises(IntegrityError):
        store.read(seq, 0)
    with pytest.raises(IntegrityError):
        store.attend(seq, 0, q, mode="dense")
    faulty.damage_gets = False
    assert_unchanged(store, seq, before)


def test_flipped_cpu_bytes_raise_and_promotions_never_lose_blocks(tmp_path):
    store = KVStore(issue_config(tmp_path, ssd_bytes=1 << 24, cpu_bytes=8 * LAYOUT.fp16_bytes))
    seq = store.create_sequence()
    k, v = kv(400, seed=5)
    store.append(seq, 0, k, v)
    q = torch.randn(4, 64).half()
    for _ in range(4):  # dense steps fetch every cold block twice: both cpu and ssd groups promote
        store.attend(seq, 0, q, mode="dense")
        store.check_integrity()
    assert store.decode.stats.promotions > 0
    cpu = store.tiers.cpu
    assert cpu.num_blocks > 0
    slot = min(cpu.slots.slot_of.values())
    cpu.slabs[0][slot].view(torch.uint8).view(-1)[3] ^= 0xFF
    with pytest.raises(IntegrityError):
        store.read(seq, 0)
    assert store.stats()["integrity_errors"] == 1


def test_mixed_fp16_and_int8_blocks_in_ssd_stay_readable(tmp_path):
    store = KVStore(issue_config(tmp_path, cpu_bytes=0, warm_tokens=64, ssd_bytes=1 << 26))
    seq = store.create_sequence()
    k, v = kv(1024, seed=6)
    store.append(seq, 0, k[:100], v[:100])
    for t in range(100, 400, 7):  # warm blocks cool into ssd as int8
        store.append(seq, 0, k[t:min(t + 7, 400)], v[t:min(t + 7, 400)])
    store.append(seq, 0, k[400:1024], v[400:1024])  # prefill-placed blocks land in ssd as fp16
    store.check_integrity()
    got_k, _ = store.read(seq, 0)
    assert got_k.shape == k.shape
    q = torch.randn(4, 64).half()
    for _ in range(3):
        store.attend(seq, 0, q, mode="dense")
        store.check_integrity()


@pytest.mark.parametrize("indices", [[-1], [-2], [1, 1], [99], [1.0], [True], "12", None])
def test_drop_validates_before_changing_anything(tmp_path, indices):
    store = KVStore(issue_config(tmp_path, ssd_bytes=1 << 24))
    seq = store.create_sequence()
    k, v = kv(200, seed=7)
    store.append(seq, 0, k, v)
    before = snapshot(store, seq)
    with pytest.raises(ValueError):
        store.drop(seq, 0, indices)
    assert_unchanged(store, seq, before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_kv_is_refused(tmp_path, bad):
    store = KVStore(issue_config(tmp_path, ssd_bytes=1 << 24))
    seq = store.create_sequence()
    k, v = kv(64, seed=8)
    store.append(seq, 0, k, v)
    before = snapshot(store, seq)
    k2, v2 = kv(40, seed=9)
    k2[17, 1, 5] = bad
    with pytest.raises(ValueError, match="finite"):
        store.append(seq, 0, k2, v2)
    v2[3, 0, 0], k2[17, 1, 5] = bad, 0.0
    with pytest.raises(ValueError, match="finite"):
        store.append(seq, 0, k2, v2)
    k2[0, 0, 0], v2[3, 0, 0] = float("inf"), float("-inf")  # one of each sign: still refused
    with pytest.raises(ValueError, match="finite"):
        store.append(seq, 0, k2, v2)
    assert_unchanged(store, seq, before)
    big = torch.full_like(k2, 65504.0)  # the largest finite fp16 everywhere: its sum must not overflow the check
    store.append(seq, 0, big, -big)
    assert store.table(seq, 0).num_tokens == 104


@pytest.mark.parametrize("field, value", [
    ("block_tokens", 32.0), ("block_tokens", "32"), ("block_tokens", None), ("block_tokens", 24),
    ("gpu_bytes", float("nan")), ("gpu_bytes", 2 ** 62), ("cpu_bytes", 2 ** 62), ("ssd_bytes", 2 ** 70),
    ("ssd_level", "1"), ("ssd_level", 100), ("hot_tokens", True), ("recent_tokens", -1), ("device", 3),
])
def test_config_names_the_field_and_its_range(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{"model": SPEC, "device": "cpu", field: value})


@pytest.mark.parametrize("field", ["num_layers", "num_q_heads", "num_kv_heads", "head_dim"])
def test_model_spec_refuses_bools_and_non_ints(field):
    fields = dict(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64)
    for value in (True, 2.0, "2", 0):
        with pytest.raises(ValueError, match=field):
            ModelSpec(**{**fields, field: value})


def test_a_huge_cpu_budget_costs_nothing_until_used_and_huge_warm_windows_leave_hot_room(tmp_path):
    store = KVStore(issue_config(tmp_path, cpu_bytes=1 << 48, warm_tokens=10 ** 12, ssd_bytes=1 << 24))
    assert store.tiers.hot.slots.num_slots >= 4  # sinks + hot window + tail of one sequence
    seq = store.create_sequence()
    k, v = kv(300, seed=10)
    store.append(seq, 0, k, v)
    store.check_integrity()

"""Block sums: the kernel against its torch reference and the reference against Python integers (CPU under
TRITON_INTERPRET=1; pinned host rows read by the GPU on CUDA), and what the docstring promises to catch."""

from __future__ import annotations

import pytest
import torch

from tiers.block_checksum import block_sums, block_sums_ref, multipliers

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def random_words(n: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (n, words), generator=g, dtype=torch.int64).to(torch.int32)


def python_sums(words: list[int]) -> tuple[int, int]:
    """The docstring's definition in Python integers: S1 exact, S2 mod 2^64 (as a signed int64)."""
    def pi(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    s2 = sum(w * (0x5851F42D4C957F2D * (2 * pi(p) + 1)) for p, w in enumerate(words)) % 2**64
    return sum(words), s2 - 2**64 if s2 >= 2**63 else s2


def sums_on_device(fields: list[torch.Tensor], rows: list[int] | None = None) -> torch.Tensor:
    fields = [f.to(DEVICE) for f in fields]
    got = block_sums(fields, None if rows is None else torch.tensor(rows, dtype=torch.int64, device=DEVICE))
    return got.cpu()


def test_reference_is_the_definition():
    x = random_words(4, 77, seed=1)
    got = block_sums_ref([x])
    for i in range(4):
        assert tuple(got[i].tolist()) == python_sums(x[i].tolist())


@pytest.mark.parametrize("shapes, rows", [
    ([(5, 7)], None),
    ([(9, 2049)], [8, 0, 8, 3]),  # past one loop step of the kernel
    ([(6, 2, 3, 5, 4), (6, 3, 4), (6, 3, 5)], [5, 1, 2]),  # an int8 block's data, k_scale, v_scale
    ([(3, 4100), (3, 1)], None),
    ([(4, 3), (4, 2050), (4, 6)], [3, 3, 0]),
])
def test_kernel_matches_reference(shapes, rows):
    g = torch.Generator().manual_seed(len(shapes) * 100 + shapes[0][1])
    fields = []
    for i, shape in enumerate(shapes):
        if len(shape) == 5:
            fields.append(torch.randint(-127, 128, shape, generator=g, dtype=torch.int8))
        else:
            fields.append(torch.randn(shape, generator=g) * (10.0 ** i))
    want = block_sums_ref(fields, None if rows is None else torch.tensor(rows))
    assert torch.equal(sums_on_device(fields, rows), want)


def test_fp16_blocks_and_empty_batches():
    x = torch.randn((5, 2, 3, 16, 8)).half()
    assert torch.equal(sums_on_device([x]), block_sums_ref([x]))
    assert sums_on_device([x], []).shape == (0, 2)


@pytest.mark.cuda
def test_gpu_reads_pinned_host_rows():
    x = random_words(40, 3000, seed=2).pin_memory()
    rows = torch.tensor([39, 0, 7, 7], device="cuda")
    assert torch.equal(block_sums([x], rows).cpu(), block_sums_ref([x], rows.cpu()))


def test_multipliers_are_odd_and_distinct_mod_2_33():
    m = multipliers(1 << 20, torch.device("cpu"))
    assert bool((m & 1).all())
    assert torch.unique(m & ((1 << 33) - 1)).numel() == m.numel()


def differs_from_base(base: torch.Tensor, damaged: torch.Tensor) -> torch.Tensor:
    """[n] bool: which damaged copies of `base` [W] change its sums (the kernel, checked by the reference)."""
    got = sums_on_device([damaged])
    assert torch.equal(got, block_sums_ref([damaged]))
    return (got != block_sums_ref([base[None]])).any(dim=1)


def test_every_single_bit_flip_is_caught():
    base = random_words(1, 40, seed=3)[0]
    bits = torch.arange(40 * 32)
    damaged = base.repeat(len(bits), 1)
    flip = torch.ones(len(bits), dtype=torch.int64) << (bits % 32)
    damaged[torch.arange(len(bits)), bits // 32] ^= flip.to(torch.int32)  # bit 31: the int32 sign bit
    assert bool(differs_from_base(base, damaged).all())


def test_every_one_word_change_is_caught():
    base = random_words(1, 48, seed=4)[0]
    damaged = base.repeat(3 * 48, 1)
    for p in range(48):
        for k, value in enumerate((0, ~int(base[p]), int(base[p]) ^ -0x80000000)):  # zero, all bits, top bit
            damaged[3 * p + k, p] = value
    damaged = damaged[(damaged != base).any(dim=1)]  # a word that was already 0 is no change
    assert bool(differs_from_base(base, damaged).all())


def test_every_swapped_pair_and_every_balanced_two_word_change_is_caught():
    base = random_words(1, 36, seed=5)[0]
    pairs = [(p, q) for p in range(36) for q in range(p + 1, 36)]
    swapped, balanced = base.repeat(len(pairs), 1), base.repeat(len(pairs), 1)
    for i, (p, q) in enumerate(pairs):
        swapped[i, p], swapped[i, q] = base[q], base[p]
        balanced[i, p] ^= -0x80000000  # top bits of two words: S1 cannot see it (d_q = -d_p), S2 must
        balanced[i, q] ^= -0x80000000
    assert bool(differs_from_base(base, swapped).all())
    shift = (balanced.to(torch.int64) - base.to(torch.int64)).sum(dim=1)
    assert bool(differs_from_base(base, balanced[shift == 0]).all()) and int((shift == 0).sum()) > 100


def test_a_zeroed_block_and_fletchers_blind_spot_are_caught():
    base = random_words(1, 64, seed=6)[0]
    bumps = base.repeat(62, 1).to(torch.int64)
    for p in range(62):  # +1, -2, +1 on three neighbours: Fletcher's two lanes both stay put
        bumps[p, p:p + 3] += torch.tensor([1, -2, 1])
    bumps = ((bumps + 2**31) % 2**32 - 2**31).to(torch.int32)
    damaged = torch.cat([torch.zeros((1, 64), dtype=torch.int32), bumps])
    assert bool(differs_from_base(base, damaged).all())


def test_bad_arguments_are_named():
    x = torch.zeros((4, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="1 to 3"):
        block_sums([x] * 4)
    with pytest.raises(ValueError, match=r"fields\[1\]"):
        block_sums([x, torch.zeros((3, 8), dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"fields\[0\].*strided"):
        block_sums([x.t()])
    with pytest.raises(ValueError, match="32-bit words"):
        block_sums([torch.zeros((4, 3), dtype=torch.int8)])
    with pytest.raises(ValueError, match="rows"):
        block_sums([x], torch.tensor([0, 1], dtype=torch.int32))
    if CUDA:
        with pytest.raises(ValueError, match="pinned"):
            block_sums([x], device="cuda")


def test_host_block_checksums_are_each_blocks_checksum():
    """tiers.base.block_checksums (the cpu tier's xxh3 digests): per block, `checksum` of its fields in order,
    for fp16 batches and quantized ones, strided views and an empty batch included."""
    from tiers.base import block_checksums, checksum
    from tiers.layout import QuantBlocks
    g = torch.Generator().manual_seed(3)
    fp16 = torch.randn(7, 2, 3, 16, 8, generator=g).half()
    quant = QuantBlocks(torch.randint(-128, 128, (7, 2, 3, 16, 8), generator=g, dtype=torch.int8),
                        torch.rand(7, 3, 8, generator=g).half(), torch.rand(7, 3, 16, generator=g).half())
    for blocks in (fp16, fp16[::2], fp16[:, :, 1:]):
        assert block_checksums(blocks) == [checksum([b]) for b in blocks]
    for blocks in (quant, quant.index(slice(1, None, 3))):
        assert block_checksums(blocks) == [checksum(blocks.index(i).tensors()) for i in range(len(blocks))]
    assert len(set(block_checksums(fp16))) == 7 and block_checksums(fp16[:0]) == []

"""The one-launch decode append against its torch reference, on irregular shapes (TRITON_INTERPRET=1 on CPU), and
the same append inside the attention launch (paged_decode(append=...))."""

from __future__ import annotations

import pytest
import torch

from eviction.batch_kernels import addresses
from kvstore.attention.append import (NewToken, append_token, append_token_ref, append_tokens,
                                     append_tokens_ref, open_tails, open_tails_ref)
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.reference import paged_decode_ref
from tests.kvstore.attention.cases import make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads, block_tokens, head_dim, num_tokens", [(3, 16, 64, 0), (8, 64, 128, 1000),
                                                                       (1, 32, 32, 31), (5, 8, 16, 64)])
def test_append_matches_reference(heads, block_tokens, head_dim, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    pool = torch.randn((7, 2, heads, block_tokens, head_dim), generator=g).half().to(DEVICE)
    summaries = torch.randn((num_tokens // block_tokens + 3, 2, heads, head_dim), generator=g).half().to(DEVICE)
    k, v = (torch.randn((heads, head_dim), generator=g).half().to(DEVICE) for _ in range(2))
    slot = torch.tensor([5], device=DEVICE)
    count = torch.tensor([num_tokens], device=DEVICE)
    want_pool, want_summaries = pool.clone(), summaries.clone()
    append_token_ref(want_pool, want_summaries, k, v, slot, count)
    append_token(pool, summaries, k, v, slot, count)
    assert torch.equal(pool, want_pool) and torch.equal(summaries, want_summaries)
    offset, block = num_tokens % block_tokens, num_tokens // block_tokens
    assert torch.equal(pool[5, 0, :, offset], k) and torch.equal(pool[5, 1, :, offset], v)
    assert bool((summaries[block, 0] <= k).all() and (summaries[block, 1] >= k).all())


def test_batch_append_matches_reference():
    g = torch.Generator().manual_seed(3)
    heads, block_tokens, head_dim = 3, 16, 32
    pool = torch.randn((9, 2, heads, block_tokens, head_dim), generator=g).half().to(DEVICE)
    counts = torch.tensor([0, 47, 200], device=DEVICE)  # three sequences of different lengths and capacities
    summaries = [torch.randn((n, 2, heads, head_dim), generator=g).half().to(DEVICE) for n in (2, 5, 14)]
    k, v = (torch.randn((3, heads, head_dim), generator=g).half().to(DEVICE) for _ in range(2))
    slots = torch.tensor([4, 0, 7], device=DEVICE)
    want_pool, want_summaries = pool.clone(), [s.clone() for s in summaries]
    append_tokens_ref(want_pool, want_summaries, k, v, slots, counts)
    append_tokens(pool, summaries, addresses(summaries, DEVICE), k, v, slots, counts)
    assert torch.equal(pool, want_pool) and all(torch.equal(a, b) for a, b in zip(summaries, want_summaries))
    assert torch.equal(pool[7, 1, :, 200 % block_tokens], v[2])


def test_open_tails_matches_reference():
    """One launch opens an entry of each table: the layers of two sequences, tables of different capacities, each
    at its own entry (a batch's new tails)."""
    g = torch.Generator().manual_seed(8)
    capacities, entries = [5, 9, 5, 12, 7], [4, 4, 4, 11, 0]
    summaries = [torch.randn((n, 2, 3, 16), generator=g).half().to(DEVICE) for n in capacities]
    h2o = [torch.rand((3, n), generator=g).to(DEVICE) for n in capacities]
    want_s, want_h = [s.clone() for s in summaries], [h.clone() for h in h2o]
    addresses = tuple(torch.tensor(v, dtype=torch.int64, device=DEVICE) for v in
                      ([s.data_ptr() for s in summaries], [h.data_ptr() for h in h2o], [h.stride(0) for h in h2o]))
    indices = torch.tensor(entries, dtype=torch.int64, device=DEVICE)
    open_tails(summaries, h2o, addresses, indices, entries)
    open_tails_ref(want_s, want_h, entries)
    assert all(torch.equal(a, b) for a, b in zip(summaries + h2o, want_s + want_h))
    assert (summaries[1][4, 0] == float("inf")).all() and (summaries[3][11, 1] == float("-inf")).all()
    assert not h2o[2][:, 4].any() and h2o[2][:, 3].all() and not h2o[4][:, 0].any() and h2o[4][:, 1].all()
    with pytest.raises(ValueError, match="holding entries"):
        open_tails(summaries, h2o, addresses, indices, [4, 4, 5, 11, 0])


def test_append_checks_its_inputs():
    pool = torch.zeros((2, 2, 2, 8, 16), dtype=torch.float16)
    summaries = torch.zeros((4, 2, 2, 16), dtype=torch.float16)
    k = torch.zeros((2, 16), dtype=torch.float16)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_tokens"):
        append_token_ref(pool, summaries, k, k, one, one.int())
    with pytest.raises(ValueError, match="pool"):
        append_token_ref(pool.float(), summaries, k, k, one, one)
    with pytest.raises(ValueError, match="k, v"):
        append_token_ref(pool, summaries, k, k.float(), one, one)


APPEND_CASES = {  # length with the new token, kv heads, group, head_dim, block_tokens, paged_decode kwargs
    "part_filled_tail": (16 * 64 - 17, 2, 4, 128, 64, {"walk": "one_tile", "blocks_per_iter": 1}),
    "first_of_a_block": (5 * 32 + 1, 3, 2, 64, 32, {"walk": "one_tile", "blocks_per_iter": 1}),
    "second_block_of_a_tile": (7 * 32 - 3, 1, 4, 64, 32, {"walk": "one_tile", "blocks_per_iter": 2}),
    "split_walk": (9 * 32 - 1, 2, 2, 64, 32, {"num_splits": 3}),
}


@pytest.mark.parametrize("name", sorted(APPEND_CASES))
def test_attention_appends_the_new_token(name):
    """paged_decode(append=...) stores the token and widens its summary as append_token does, attends it as
    the row's last token whatever the pool held there, and answers bit for bit as append-then-attend."""
    n, heads, group, head_dim, block_tokens, kwargs = APPEND_CASES[name]
    case = make_case([n], heads, group, head_dim, block_tokens, 1.0, seed=n, shared_table=True, sinks_recent=(1, 2))
    block, offset = divmod(n - 1, block_tokens)
    assert not bool(case.is_int8[0, 0, block])  # the tail is hot, as in a decode step
    slot = int(case.table[0, 0, block])
    g = torch.Generator().manual_seed(n + 1)
    k, v = (torch.randn((heads, head_dim), generator=g).half().to(DEVICE) for _ in range(2))
    case.hot[slot, :, :, offset] = float("nan")  # what the row held before: must not be read
    summaries = torch.randn((block + 3, 2, heads, head_dim), generator=g).half().to(DEVICE)
    tail, count = torch.tensor([slot], device=DEVICE), torch.tensor([n - 1], device=DEVICE)
    pools = {kind: (case.hot.clone(), summaries.clone()) for kind in ("fused", "ref", "first")}

    def run(kind):
        hot, sums = pools[kind]
        args = (case.q, hot, *case.args()[2:])
        if kind == "ref":
            return paged_decode_ref(*args, return_block_mass=True, append=NewToken(k, v, sums, tail, count))
        if kind == "first":
            append_token(hot, sums, k, v, tail, count)
            return paged_decode(*args, return_block_mass=True, **kwargs)
        return paged_decode(*args, return_block_mass=True, append=NewToken(k, v, sums, tail, count), **kwargs)

    (out, mass), (ref_out, ref_mass), (first_out, first_mass) = run("fused"), run("ref"), run("first")
    exact = dict(atol=0, rtol=0, equal_nan=True)  # the pools' poisoned rows stay NaN
    for hot, sums in pools.values():
        torch.testing.assert_close(hot, pools["ref"][0], **exact)
        torch.testing.assert_close(sums, pools["ref"][1], **exact)
    assert torch.equal(hot[slot, 0, :, offset], k) and torch.equal(hot[slot, 1, :, offset], v)
    assert torch.equal(out, first_out) and torch.equal(mass, first_mass)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)


def test_append_is_refused_where_it_cannot_run():
    case = make_case([40, 50], 2, 2, 32, 16, 0.0, shared_table=True)
    k = torch.zeros((2, 32), dtype=torch.float16, device=DEVICE)
    new = NewToken(k, k, torch.zeros((8, 2, 2, 32), dtype=torch.float16, device=DEVICE),
                   torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE))
    for decode in (paged_decode, paged_decode_ref):
        with pytest.raises(ValueError, match="batch of 1"):
            decode(*case.args(), append=new)
    single = make_case([40], 2, 2, 32, 16, 0.0, shared_table=True)
    with pytest.raises(ValueError, match="k, v"):
        paged_decode(*single.args(), append=new._replace(v=k.float()))


def test_batch_append_of_an_empty_row_writes_only_the_scratch_row():
    """A batch row with no sequence (kvstore/decode/batch_slots.py) appends at count 0 into the pool's scratch row
    and widens its one scratch summary: every other pool row and summary is what the real rows alone make."""
    g = torch.Generator().manual_seed(4)
    heads, block_tokens, head_dim, scratch = 2, 16, 32, 8
    pool = torch.randn((scratch + 1, 2, heads, block_tokens, head_dim), generator=g).half().to(DEVICE)
    real = [torch.randn((n, 2, heads, head_dim), generator=g).half().to(DEVICE) for n in (5, 12)]
    scratch_summary = torch.randn((1, 2, heads, head_dim), generator=g).half().to(DEVICE)
    summaries = [real[0], scratch_summary, real[1]]
    k, v = (torch.randn((3, heads, head_dim), generator=g).half().to(DEVICE) for _ in range(2))
    slots, counts = torch.tensor([3, scratch, 6], device=DEVICE), torch.tensor([47, 0, 180], device=DEVICE)
    want_pool, want_real = pool.clone(), [s.clone() for s in real]
    append_tokens_ref(want_pool, want_real, k[[0, 2]], v[[0, 2]], slots[[0, 2]], counts[[0, 2]])  # without it
    append_tokens(pool, summaries, addresses(summaries, DEVICE), k, v, slots, counts)
    assert torch.equal(pool[:scratch], want_pool[:scratch]) and all(map(torch.equal, real, want_real))
    assert torch.equal(pool[scratch, 0, :, 0], k[1]) and torch.equal(pool[scratch, 1, :, 0], v[1])

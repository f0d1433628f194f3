"""Several client processes putting and getting at once: no errors, every read consistent."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch

from tiers.remote.client import Client
from tests.kvstore.service.conftest import random_tensor, same_bits

NUM_WORKERS, ROUNDS = 3, 10
SHAPES = [(torch.float16, (2, 4, 16, 32)), (torch.int8, (2, 4, 16, 32)), (torch.float32, (4, 32)), (torch.bfloat16, (7,))]


def own_values(worker: int, rnd: int) -> dict[str, torch.Tensor]:
    return {f"w{worker}/r{rnd:02d}/{j}": random_tensor(dtype, shape, seed=worker * 10_000 + rnd * 10 + j)
            for j, (dtype, shape) in enumerate(SHAPES)}


def shared_value(worker: int, rnd: int) -> torch.Tensor:
    """Names its writer in its first two entries, so a reader can check it is whole."""
    body = random_tensor(torch.int32, (3000,), seed=worker * 100 + rnd)
    return torch.cat([torch.tensor([worker, rnd], dtype=torch.int32), body])


def work(url: str, worker: int) -> list[str]:
    errors = []
    with Client(url) as c:
        for rnd in range(ROUNDS):
            own = own_values(worker, rnd)
            if rnd % 2:
                c.put_many("conc", own)
            else:
                for key, t in own.items():
                    c.put("conc", key, t)
            got = c.get_many("conc", list(own))
            errors += [f"{k} differs" for k, g, t in zip(own, got, own.values()) if not same_bits(g, t)]
            c.put("conc", "shared", shared_value(worker, rnd))
            seen = c.get("conc", "shared")
            if not same_bits(seen, shared_value(int(seen[0]), int(seen[1]))):
                errors.append(f"shared value torn after round {rnd}")
    return errors


def test_client_processes_put_and_get_at_once(server):
    # Fresh processes (never forked from this one's threads); the fork server imports torch once for all.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(NUM_WORKERS, mp_context=context) as pool:
        results = list(pool.map(work, [server.url] * NUM_WORKERS, range(NUM_WORKERS)))
    assert results == [[]] * NUM_WORKERS
    with Client(server.url) as c:
        keys = c.keys("conc")
        assert len(keys) == NUM_WORKERS * ROUNDS * len(SHAPES) + 1
        expected = {k: t for w in range(NUM_WORKERS) for r in range(ROUNDS) for k, t in own_values(w, r).items()}
        got = c.get_many("conc", list(expected))
        assert all(same_bits(g, t) for g, t in zip(got, expected.values()))
        last = c.get("conc", "shared")
        assert int(last[1]) == ROUNDS - 1 and same_bits(last, shared_value(int(last[0]), ROUNDS - 1))
        assert c.stats("conc")["blocks"] == len(keys)

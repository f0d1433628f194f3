"""Subprocess side of tests/kvstore/contexts/test_saved.py and test_saved_redis.py: one store in a fresh process.

    python -m tests.kvstore.contexts.saved_worker open <ssd_path> <name> <out.pt> <warm_tokens>   attend the opened context
    python -m tests.kvstore.contexts.saved_worker save <ssd_path> <name> <seed>     fill and save slowly, printing progress
    python -m tests.kvstore.contexts.saved_worker bgsave <ssd_path> <name> <seed>   the same with save(background=True),
        pumped between appended tokens (test_saved_background_save.py)
    python -m tests.kvstore.contexts.saved_worker decode <redis_url> <name> <out.pt> <last token>   open the context
        through Redis, attend it, and decode greedily after <last token> (test_saved_redis.py)
"""

from __future__ import annotations

import sys
import time

import torch

from kvstore import KVStore
from tests.kvstore.contexts.test_saved import NUM_TOKENS, attend_all, config, filled, opened_config, query


def main(argv: list[str]) -> None:
    what, path, name = argv[:3]
    if what == "decode":
        from tests.kvstore.contexts.test_saved_redis import decode_opened

        torch.save(decode_opened(path, name, int(argv[4])), argv[3])
        return
    store = KVStore(opened_config(path, int(argv[4])) if what == "open" else config(path))
    if what == "open":
        started = time.perf_counter()
        seq = store.open(name)
        opened = time.perf_counter() - started
        outs = attend_all(store, seq, query(1))
        store.check_integrity()
        torch.save({"outs": outs, "open_s": opened, "stats": store.stats()}, argv[3])
    else:
        seq = filled(store, NUM_TOKENS, seed=int(argv[3]))
        commit = store.saved.values._commit

        def slow(batch):  # one progress line per batch committed, so the parent can kill mid-save
            commit(batch)
            print("batch", flush=True)
            time.sleep(0.2)

        store.saved.values._commit = slow
        if what == "bgsave":
            store.saves.pump_blocks = 8
            job = store.save(seq, name, background=True)
            while not job.done():
                store.pump_saves()
                store.extend_tokens(seq, [1])
                for layer in range(store.spec.num_layers):
                    store.append(seq, layer, *(torch.ones((1, 2, 16), dtype=torch.float16),) * 2)
            job.wait()
        else:
            store.save(seq, name)
        print("saved", flush=True)
        time.sleep(60)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])

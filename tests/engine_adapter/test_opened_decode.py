"""A context saved by one store and opened by another decodes through the captured step as soon as every block
is on the GPU pools or in the cpu tier: after store.load, and by itself when open starts a background load.
On CPU the captured path's bookkeeping runs (Decoder._captures patched; GraphDecoder's forward runs eagerly)
and Decoder.paths says which path each token took. Logits equal the never-saved sequence's bit for bit where
it took the same path per token (the two paths' forwards round differently). An opened sequence's eager tokens
run the DecodePath (blocks in the save: kvstore/decode/eager_step.py), so the never-saved one's do too."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from eviction import TopK
from kvstore import Config, KVStore
from tests.engine_adapter.test_llama import TINY

VOCAB, PROMPT, BUDGET = 97, 600, 48


def config(path) -> Config:
    """Short GPU windows: most blocks go to an int8 cpu tier (the warm format, so no move changes a block's
    values), checksummed where the step verifies them, with a staging row per selected block."""
    return Config(model=TINY, block_tokens=16, sink_tokens=16, hot_tokens=32, warm_tokens=64, gpu_bytes=8 << 20,
                  cpu_bytes=8 << 20, cpu_dtype="int8", cpu_checksums="cpu", staging_tokens=64, ssd_path=str(path),
                  device="cpu", host_memory_reserve=0, model_id="tiny")


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Decoder, "_captures", lambda self: self.graphs)  # graphs=False: the eager path


class PathTopK(TopK):
    """Quest's bound as the DecodePath runs it: the step serves TopK itself, not a subclass (eager_step.step_mode),
    so the never-saved sequence's eager tokens take the path an opened sequence's take."""


def forced(n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(3)).tolist()


def never_saved(path, paths: list[str]) -> list[torch.Tensor]:
    """Prefill, save as "doc", then decode forced tokens, token i on the path paths[i]: their logits."""
    model = random_llama(TINY, seed=5, vocab_size=VOCAB)
    ids = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(0))
    with KVStore(config(path)) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        decoder.prefill(seq, ids, 64)
        store.save(seq, "doc")
        out = []
        for token, path in zip(forced(len(paths)), paths):
            decoder.graphs = path == "captured"
            out.append(decoder.decode_step(seq, token, "topk" if decoder.graphs else PathTopK(), BUDGET))
        assert decoder.paths["captured"] == paths.count("captured")
        return out


def decode(decoder: Decoder, seq: int, tokens: list[int]) -> tuple[list[torch.Tensor], list[str]]:
    """Logits of each forced token and the path it took."""
    out, paths = [], []
    for token in tokens:
        before = decoder.paths["captured"]
        out.append(decoder.decode_step(seq, token, "topk", BUDGET))
        paths.append("captured" if decoder.paths["captured"] > before else "eager")
    return out, paths


def test_an_opened_context_decodes_captured_after_store_load_and_equals_the_never_saved_one(tmp_path, captures):
    want = never_saved(tmp_path, ["captured"] * 12)
    with KVStore(config(tmp_path)) as store:
        decoder = Decoder(random_llama(TINY, seed=5, vocab_size=VOCAB), store)
        seq = store.open("doc")
        assert store.table(seq, 0).num_far > 0  # blocks still in the save: no captured step reaches them
        assert store.load(seq) > 0 and store.stats()["tiers"]["saved"]["blocks"] == 0
        got, paths = decode(decoder, seq, forced(12))
        assert paths == ["captured"] * 12
        assert store.stats()["attend"]["cold_slices_staged"] > 0  # cpu blocks read by the step itself
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        store.check_integrity()


def test_a_background_load_switches_an_opened_context_to_the_captured_step(tmp_path, captures):
    """open(background_load=True): the first tokens go the eager way (blocks in the save), the Decoder places the
    blocks read meanwhile before every token, and once all are in, every token runs captured, without a call to
    store.load; outputs equal the never-saved sequence's on the same paths."""
    model = random_llama(TINY, seed=5, vocab_size=VOCAB)
    never_saved(tmp_path, [])  # the save
    tokens = forced(200)
    with KVStore(config(tmp_path)) as store:
        store.loads.batch_blocks = 8  # many batches: the queue fills and is placed over several tokens
        decoder = Decoder(model, store)
        seq = store.open("doc", background_load=True)
        got, paths = [], []
        while len(got) < len(tokens) and paths[-6:].count("captured") < 6:
            logits, path = decode(decoder, seq, tokens[len(got): len(got) + 1])
            got += logits
            paths += path
        assert paths[0] == "eager" and paths[-6:] == ["captured"] * 6
        first = paths.index("captured")
        assert set(paths[first:]) == {"captured"}  # no way back once every block is in
        assert not store.loads.loading(seq) and store.stats()["tiers"]["saved"]["blocks"] == 0
        attend = store.stats()["attend"]
        assert attend["cold_slices_staged"] > 0 and attend["step_calls"] == 0  # eager tokens: blocks in the save
        assert attend["fallback_calls"] == {"not_ready": first * TINY.num_layers}
        store.check_integrity()
    want = never_saved(tmp_path / "again", paths)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("warm_format", ["int8", "int4"])
def test_a_context_saved_right_after_the_step_cooled_ahead_decodes_as_never_saved(tmp_path, captures, warm_format):
    """A captured token cools what the next token pushes out of the hot window once it has run (step.py): a save
    then holds that block in the warm format though its position is still in the window. Opened and loaded, the
    block stays in the warm tier with the writer's bytes (as fp16 in the hot tier it would be quantized a second
    time by the next token, not exact for int4), and the context's next dense tokens, which read every block, equal
    the writer's bit for bit."""
    def cfg() -> Config:
        return Config(model=TINY, block_tokens=16, sink_tokens=16, hot_tokens=32, warm_tokens=1 << 20,
                      gpu_bytes=8 << 20, cpu_bytes=8 << 20, ssd_path=str(tmp_path), device="cpu",
                      host_memory_reserve=0, model_id="tiny", warm_format=warm_format)

    model = random_llama(TINY, seed=5, vocab_size=VOCAB)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    tokens = forced(12)
    with KVStore(cfg()) as writer:
        decoder = Decoder(model, writer)
        seq = writer.create_sequence()
        decoder.prefill(seq, ids, 64)
        while (decoder.length(seq) + 1) % 16:  # up to 207 tokens: the 208th pushes block 10 out of the hot window
            decoder.decode_step(seq, tokens.pop(), "dense", 4096)
        leaving = writer.table(seq, 0).block_ids[10]
        assert writer.tiers.blocks.tier_of[leaving] == 1 and decoder.paths["eager"] == 0  # cooled ahead
        writer.save(seq, "doc")
        saved_bytes = writer.tiers.warm.get([leaving]).tensors()
        want = [decoder.decode_step(seq, t, "dense", 4096) for t in tokens[:3]]
    with KVStore(cfg()) as reader:
        decoder = Decoder(model, reader)
        opened = reader.open("doc")
        reader.load(opened)
        block = reader.table(opened, 0).block_ids[10]
        assert reader.tiers.blocks.tier_of[block] == 1
        assert all(torch.equal(a, b) for a, b in zip(reader.tiers.warm.get([block]).tensors(), saved_bytes))
        got = [decoder.decode_step(opened, t, "dense", 4096) for t in tokens[:3]]
        assert decoder.paths == {"captured": 3, "eager": 0}
    assert all(torch.equal(a, b) for a, b in zip(want, got))

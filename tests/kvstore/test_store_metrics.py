"""The in-process store's Prometheus collector reports what stats() says, certified mass included."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Config, KVStore, ModelSpec
from kvstore.store_metrics import StoreCollector


def scrape(collector: StoreCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_scrape_follows_the_store(tmp_path):
    spec = ModelSpec(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16)
    config = Config(model=spec, block_tokens=16, sink_tokens=16, hot_tokens=64, warm_tokens=64,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, ssd_path=str(tmp_path / "ssd"), device="cpu")
    g = torch.Generator().manual_seed(0)
    with KVStore(config) as store:
        collector = StoreCollector(store)
        before = scrape(collector)
        assert before[("kvtier_store_attend_calls_total", ())] == 0
        seq = store.create_sequence()
        store.append(seq, 0, torch.randn(400, 2, 16, generator=g).half(), torch.randn(400, 2, 16, generator=g).half())
        for _ in range(3):
            store.attend(seq, 0, torch.randn(4, 16, generator=g).half(), mode="sketch", budget=64, measure_mass=True)
        assert scrape(collector) == before  # the scraping thread serves the last snapshot
        collector.refresh()  # the engine's thread takes a new one
        got, stats = scrape(collector), store.stats()
        attend = stats["attend"]
        assert got[("kvtier_store_attend_calls_total", ())] == 3
        assert got[("kvtier_store_certified_calls_total", ())] == 3 == attend["certified_calls"]
        assert abs(got[("kvtier_store_certified_omitted_mass_total", ())] - attend["certified_omitted"]) < 1e-6
        assert got[("kvtier_store_measured_calls_total", ())] == 3
        assert abs(got[("kvtier_store_true_omitted_mass_total", ())] - attend["true_omitted"]) < 1e-6
        assert got[("kvtier_store_true_omitted_mass_total", ())] <= got[("kvtier_store_certified_omitted_mass_total", ())]
        assert got[("kvtier_store_certificate_violations_total", ())] == 0
        for tier, held in stats["tiers"].items():
            assert got[("kvtier_store_tier_bytes", (("tier", tier),))] == held["bytes"]
        assert got[("kvtier_store_sequence_tokens", ())] == 400
        assert got[("kvtier_store_freeing_blocks", ())] == 0
        store.free(seq, background=True)
        collector.refresh()
        assert scrape(collector)[("kvtier_store_freeing_blocks", ())] == 400 // 16 > 0  # blocks of 16 tokens

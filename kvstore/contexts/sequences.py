"""Content keys: a sequence's token ids and the hash chain that names its full blocks.

Block i of a sequence covers token ids [i*B, (i+1)*B). Its chain hash (tiers/keys.py, which the
sidecar's prefix routes and the remote Client use too) is

    h_i = blake2b-128(h_{i-1} || token ids of block i as little-endian int64),
    h_-1 = blake2b-128("kvtier-chain/1" || model identity || geometry || block_tokens)

so h_i names the whole prefix up to block i under one model, and block i of layer l carries the
content key `l (2 bytes) || h_i`. Identical prefixes give identical keys: `KVStore.match_prefix`
finds the longest held one and `KVStore.create_sequence(prefix=...)` starts a sequence on its
blocks by reference (vLLM's and SGLang's prefix caching, per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvstore.blocks.table import DROPPED, LayerTable, TableTensors
from kvstore.blocks.tierset import HOT_TIER, TierSet
from kvstore.config import Config, ModelSpec
from kvstore.contexts.freeing import PendingFrees
from kvstore.contexts.opening import SavedContext, SavedLayer
from kvstore.contexts.unread_codes import UnreadCodes
from tiers import keys
from tiers.keys import block_key, chain_hashes  # noqa: F401  (also re-exported)


def chain_root(model_id: str, spec: ModelSpec, block_tokens: int) -> bytes:
    return keys.chain_root(model_id, spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim,
                           block_tokens)


@dataclass(slots=True)
class TokenRecord:
    """The token ids a sequence holds, from position 0, and the chain hashes of its full blocks."""

    root: bytes
    block_tokens: int
    num_layers: int
    token_ids: list[int] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)  # chain hash of each full block of token_ids
    keyed: list[int] = field(default_factory=list)  # per layer: leading blocks whose keys are registered

    def __post_init__(self) -> None:
        if not self.keyed:
            self.keyed = [0] * self.num_layers

    def extend(self, token_ids: Sequence[int]) -> None:
        b = self.block_tokens
        self.token_ids.extend(token_ids)
        pending = self.token_ids[len(self.chain) * b:]
        self.chain += chain_hashes(self.chain[-1] if self.chain else self.root, pending, b)

    def copy(self) -> TokenRecord:
        return TokenRecord(self.root, self.block_tokens, self.num_layers, list(self.token_ids), list(self.chain),
                           list(self.keyed))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest prefix of some token ids whose blocks the store holds in every layer."""

    num_tokens: int  # a multiple of block_tokens (full blocks only)
    token_ids: tuple[int, ...]  # the matched tokens
    block_ids: tuple[tuple[int, ...], ...]  # [layer][block index] -> block id


def check_token_ids(token_ids: object) -> list[int]:
    """Token ids as a list of non-negative ints (a list, tuple, range, numpy array or 1-d tensor)."""
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, range):
        token_ids = list(token_ids)
    if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 62 for t in token_ids):
        raise ValueError(f"token_ids must be a sequence of non-negative ints, got {str(token_ids)[:80]}")
    return list(token_ids)


class Contexts:
    """Sequences, their token records, content keys and sharing over the store's tables: create, fork,
    prefix lookup, sequences started on a prefix or a saved context, free. Handed the tables, the tier
    set, the table tensors and the unread sketch codes; never the store."""

    def __init__(self, config: Config, tables: dict[int, list[LayerTable]], tiers: TierSet,
                 tensors: TableTensors, unread: UnreadCodes) -> None:
        self.block_tokens, self.num_layers = config.block_tokens, config.model.num_layers
        self.root = chain_root(config.model_id, config.model, config.block_tokens)
        self.tables, self.tiers, self.tensors, self.unread = tables, tiers, tensors, unread
        self.records: dict[int, TokenRecord] = {}  # sequences whose token ids are known from position 0
        self.freeing = PendingFrees(tables, tiers, config.block_tokens)  # freed sequences' blocks still held
        self._next_sequence = 0

    def new_record(self) -> TokenRecord:
        return TokenRecord(self.root, self.block_tokens, self.num_layers)

    def _new_sequence(self) -> int:
        self._next_sequence += 1
        return self._next_sequence - 1

    def create(self, prefix: PrefixMatch | None) -> int:
        """A new sequence: empty (token ids tracked from 0 when a prefix, even an empty one, was asked for),
        or started on the blocks of `prefix`."""
        seq = self._new_sequence()
        if prefix is not None and prefix.num_tokens:
            self.start_on(seq, prefix)
            return seq
        self.tables[seq] = [LayerTable() for _ in range(self.num_layers)]
        if prefix is not None:
            self.records[seq] = self.new_record()
        return seq

    def tracks_tokens(self, seq: int) -> bool:
        record, held = self.records.get(seq), max(t.num_tokens for t in self.tables[seq])
        return len(record.token_ids) >= held if record is not None else held == 0

    def token_ids(self, seq: int) -> list[int] | None:
        record = self.records.get(seq)
        return None if record is None else list(record.token_ids)

    # -- token ids and keys ---------------------------------------------------------------
    def extend(self, seq: int, token_ids: list[int], catch_up: bool = False) -> None:
        record = self.records.get(seq)
        held = max(t.num_tokens for t in self.tables[seq])
        if record is None:
            if held and not (catch_up and len(token_ids) == held):
                raise ValueError(f"sequence {seq} holds {held} tokens of K/V whose ids were never given: "
                                 "token ids must cover a sequence from position 0")
            record = self.records[seq] = self.new_record()
        elif catch_up and len(record.token_ids) + len(token_ids) != held:
            raise ValueError(f"sequence {seq}: {len(record.token_ids)} recorded + {len(token_ids)} catching up "
                             f"!= the {held} tokens of K/V it holds")
        elif not catch_up and len(record.token_ids) < held:
            raise ValueError(f"sequence {seq} holds {held} tokens of K/V but only {len(record.token_ids)} "
                             "token ids: give each token's id before or when its K/V are appended")
        record.extend(token_ids)
        for layer in range(self.num_layers):
            self.key_blocks(seq, layer)

    def key_blocks(self, seq: int, layer: int) -> None:
        """Register the content keys of the layer's full blocks whose token ids are known."""
        record = self.records.get(seq)
        if record is None:
            return
        table = self.tables[seq][layer]
        first, upto = record.keyed[layer], min(table.num_tokens // self.block_tokens, len(record.chain))
        if upto > first:
            prefix = block_key(layer, b"")  # a block key is the layer's prefix and the chain hash
            ids, keys = table.block_ids[first:upto], [prefix + h for h in record.chain[first:upto]]
            if table.num_dropped:
                keys = [k for b, k in zip(ids, keys) if b != DROPPED]
                ids = [b for b in ids if b != DROPPED]
            self.tiers.blocks.set_keys(ids, keys)
        record.keyed[layer] = max(record.keyed[layer], upto)

    # -- sharing ----------------------------------------------------------------------------
    def fork(self, seq: int) -> int:
        """A new sequence holding what `seq` holds: full blocks by reference, partial tails copied."""
        partial = sum(t.num_tokens % self.block_tokens != 0 for t in self.tables[seq])
        self.tiers.check_room(partial)
        new = self._new_sequence()
        self.tables[new] = [self.tensors.copy(t) for t in self.tables[seq]]
        if seq in self.records:
            self.records[new] = self.records[seq].copy()
        self.unread.fork(seq, new)
        self._share_all(new)
        return new

    def match(self, token_ids: list[int]) -> PrefixMatch:
        registry, found = self.tiers.blocks, []
        for h in chain_hashes(self.root, token_ids, self.block_tokens):
            ids = [registry.find(block_key(layer, h)) for layer in range(self.num_layers)]
            if None in ids:
                break
            found.append(ids)
        n = len(found) * self.block_tokens
        return PrefixMatch(n, tuple(token_ids[:n]), tuple(zip(*found)) if found else ((),) * self.num_layers)

    def start_on(self, new: int, match: PrefixMatch) -> None:
        """Sequence `new` starts on the blocks of `match` (by reference, no K/V copied)."""
        registry, b = self.tiers.blocks, self.block_tokens
        chain = chain_hashes(self.root, match.token_ids, b)
        if len(match.block_ids) != self.num_layers or match.num_tokens != len(chain) * b or any(
                len(ids) != len(chain) or any(registry.key(i) != block_key(layer, h) for i, h in zip(ids, chain))
                for layer, ids in enumerate(match.block_ids)):
            raise ValueError("prefix match is stale or not from this store: its blocks were freed; match again")
        try:
            self.tables[new] = [self._table_on(new, layer, list(ids)) for layer, ids in enumerate(match.block_ids)]
        except BaseException:
            self.unread.forget(new)
            raise
        record = self.records[new] = self.new_record()
        record.extend(match.token_ids)
        record.keyed = [len(chain)] * self.num_layers
        self._share_all(new)

    def start_saved(self, saved: SavedContext) -> int:
        """A new sequence on the saved context: tables, summaries and token ids now; sketch codes when the
        sketch policy first needs them (unread_codes.py); each block stays in the saved tier until
        selected, except tails and the hot window (sinks, recent tokens), loaded here."""
        tables = [self._table_saved(s) for s in saved.layers]  # read and verified before anything is held
        new = self._new_sequence()
        self.tables[new] = tables
        for layer, (table, s) in enumerate(zip(tables, saved.layers)):
            table.block_ids = self.tiers.blocks.new_ids(s.num_blocks, new, layer, 0)
            self.tiers.blocks.forget_owners([table.block_ids[i] for i in s.dropped])
            for i in s.dropped:
                table.block_ids[i] = DROPPED
        self.tiers.adopt_saved(tables, [key for s in saved.layers for key in s.keys])  # every block, or none
        self.unread.opened(new, [(s.sketch, t.num_blocks, s.num_tokens % self.block_tokens != 0)
                                 for s, t in zip(saved.layers, tables)])
        try:
            if saved.token_ids is not None:
                self.records[new] = self.new_record()
                self.records[new].extend(saved.token_ids)
                for layer in range(self.num_layers):
                    self.key_blocks(new, layer)
            for table in tables:
                self.tiers.promote(self._hot_window(table), HOT_TIER)  # opportunistic: the rest staged when selected
                self.tiers.pin_tail(table)
        except BaseException:
            self.free(new)
            raise
        return new

    def _table_saved(self, saved: SavedLayer) -> LayerTable:
        """A table of the saved layer's length with its summaries and H2O scores read in; no blocks yet."""
        n = saved.num_blocks
        table = LayerTable(num_tokens=saved.num_tokens, num_dropped=len(saved.dropped))
        if n:
            self.tensors.reserve(table, n)
            saved.read_into(table.summaries[:n], table.h2o_scores[:, :n])
        return table

    def _hot_window(self, table: LayerTable) -> list[int]:
        """The blocks of `table`, its tail aside, whose tier is hot: the sinks and the recent window, looked
        for where the placement's windows put them (not block by block over a million-block table)."""
        p, n, num_tokens = self.tiers.placement, table.num_blocks, table.num_tokens
        recent = max(p.sink_blocks, (num_tokens - p.hot_tokens) // p.block_tokens - 1)
        return [table.block_ids[i] for i in [*range(min(p.sink_blocks, n - 1)), *range(recent, n - 1)]
                if table.block_ids[i] != DROPPED and self.tiers.first_tier(i, num_tokens) == HOT_TIER]

    def _table_on(self, new: int, layer: int, ids: list[int]) -> LayerTable:
        """Layer `layer` of `new` over held full blocks: summaries and sketch codes copied from a table holding
        each (codes still unread there stay unread here)."""
        table = LayerTable(ids, len(ids) * self.block_tokens)
        self.tensors.reserve(table, len(ids))
        by_source: dict[int, tuple[list[int], list[int]]] = {}
        for i, block_id in enumerate(ids):
            seq, _, index = self.tiers.blocks.any_holder(block_id)  # a block's holders are all in its layer
            dst, src = by_source.setdefault(seq, ([], []))
            dst.append(i)
            src.append(index)
        for seq, (dst, src) in by_source.items():
            self.unread.carry(seq, layer, src, new, dst)
            table.summaries[dst] = self.tables[seq][layer].summaries[src]
            table.sketch[dst] = self.tables[seq][layer].sketch[src]
        return table

    def _share_all(self, new: int) -> None:
        tables, done = self.tables[new], 0
        try:
            for layer, table in enumerate(tables):
                self._share(new, layer, table)
                done += 1
        except BaseException:  # the failing layer's table is empty already; later ones never held anything
            tables[done + 1:] = [LayerTable() for _ in tables[done + 1:]]
            self.free(new)
            raise

    def _share(self, seq: int, layer: int, table: LayerTable) -> None:
        """`table`, registered as (seq, layer), points at recorded blocks (a fork's copy, or a prefix): its
        full blocks become held by reference and its maps and counts follow the registry; a partial tail
        block, which appends write in place, is copied into the hot tier (copy-on-write). On failure the
        table is left empty and holds nothing."""
        n = table.num_blocks
        partial = table.num_tokens % self.block_tokens != 0
        shared = [i for i in range(n - 1 if partial else n) if table.block_ids[i] != DROPPED]
        self.tiers.holders.share(seq, layer, table, shared)
        try:
            if partial:
                self.tiers.copy_into(table, seq, layer, n - 1)
            else:
                self.tiers.pin_tail(table)
        except BaseException:
            self.tiers.holders.unshare(seq, layer, table, shared)
            table.block_ids.clear()
            table.num_tokens = table.num_warm = table.num_cold = table.num_far = table.num_dropped = 0
            raise

    def free(self, seq: int, background: bool = False) -> None:
        """Let go of every block of `seq`; blocks no other sequence holds return to their tiers, now or (background)
        in bounded batches between tokens (freeing.py)."""
        self.records.pop(seq, None)
        self.unread.forget(seq)
        self.freeing.add(seq)
        if not background:
            self.freeing.release(seq=seq)

"""What a DecodeStep is built from and hands on: its parts from the store (StepParts), one layer's selection
(Selection, from DecodeStep.select to the attention launch and DecodeStep.account), and tail blocks: new ones
placed (place_tails) and their table entries opened (open_tail_entries), a step's or a batch's in one call, and
filled ones encoded (encode_filled_tails)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import torch

from kvstore.attention.append import NewToken, open_tails, open_tails_ref
from kvstore.blocks.table import LayerTable, TableTensors
from kvstore.blocks.tierset import HOT_TIER, TierSet
from kvstore.config import Config, ModelSpec
from kvstore.decode.eager import DecodePath
from tiers.base import device_ints


@dataclass(frozen=True, slots=True)
class StepParts:
    """What a DecodeStep works on, handed over by the store that owns them (KVStore.decode_step)."""
    config: Config
    device: torch.device
    tiers: TierSet
    tensors: TableTensors
    path: DecodePath  # the eager decode path: its kernel, stats and recent window


class Selection(NamedTuple):
    """What one layer of a token reads: block indices [H, k] (ascending, the tail last), their kernel table
    (slots int32, is_int8 [H, k]), the sketch's block upper bounds [Hq, N] (else None) and the token to append
    inside the attention launch (None: appended already)."""
    selected: torch.Tensor
    slots: torch.Tensor
    is_int8: torch.Tensor
    upper: torch.Tensor | None
    append: NewToken | None


def place_tails(tiers: TierSet, ids: list[int], spec: ModelSpec, block_tokens: int, device: torch.device) -> None:
    """Empty tail blocks `ids` into the hot tier in one placement: the room they need is made once (blocks
    cooled in one move per pair of tiers), not once per block."""
    empty = torch.zeros((len(ids), 2, spec.num_kv_heads, block_tokens, spec.head_dim), dtype=torch.float16,
                        device=device)
    tiers.place(ids, empty, HOT_TIER, coldest=HOT_TIER)  # a tail lives in the hot tier, or CapacityError


class HasTails(Protocol):
    """A DecodeStep, as open_tail_entries sees it."""
    tables: list[LayerTable]
    table_addresses: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    device: torch.device


def open_tail_entries(steps: Sequence[HasTails], kernel: bool | None = None) -> None:
    """The last entry of every layer's table of each step (its new tail) opened: summary min +inf, max -inf (the
    step's append widens them), H2O scores 0. kernel (default: on CUDA): one launch for all of them."""
    tables = [t for s in steps for t in s.tables]
    summaries, h2o, indices = [t.summaries for t in tables], [t.h2o_scores for t in tables], \
        [t.num_blocks - 1 for t in tables]
    if not (steps[0].device.type == "cuda" if kernel is None else kernel):
        open_tails_ref(summaries, h2o, indices)
        return
    addresses = steps[0].table_addresses if len(steps) == 1 else \
        tuple(torch.cat(parts) for parts in zip(*(s.table_addresses for s in steps)))
    open_tails(summaries, h2o, addresses, device_ints(indices, steps[0].device), indices)


def encode_filled_tails(tables: Sequence[LayerTable], tiers: TierSet, tensors: TableTensors) -> None:
    """The sketch codes of the tail block of each of `tables`, which a token just filled, from the hot pool's row
    (a step's tail is always hot): queued, no gather, no host sync."""
    hot = tiers.hot
    for table in tables:
        keys = hot.pool[hot.slots.slot_of[table.block_ids[-1]], 0]  # [H, B, D]
        tensors.encode_block(table, table.num_blocks - 1, keys.transpose(0, 1))


def topk_blocks(budget: int, block_tokens: int, sink_blocks: int, recent_tokens: int) -> int:
    """Blocks a topk step selects per kv head: the budget's, at least the sinks, the recent window and one more."""
    return max(budget // block_tokens, sink_blocks + -(-recent_tokens // block_tokens) + 1)

"""The dense phase of a DecodeStep: how long a table its kernel reads, and the tables partitioned by pool.

dense_bucket: the step's dense table is viewed up to a bucket of blocks, so that a short sequence in a long
capacity gets a short table's kernel (one captured graph per bucket).

StepPartitions: a long dense table holding hot (fp16) and warm (int8) blocks takes paged_decode's partition walk:
the table is reordered on the device, fp16 entries first (kvstore/attention/partition.py, two launches: 5.6 us a
layer of a 1M-token dense int8 token on an H200: bench_longctx.step_profile; BENCHMARKS.md, Decode step), then each
pool's entries are attended by a launch specialised to its format. Between block boundaries a step's tables do not
change: the token goes into the tail block, which stays where it is; blocks change tier or slot only through
TableTensors.set_location, which counts the change in LayerTable.moves (new tail blocks and cooled blocks included).
So the step partitions each layer's table before a token (host side, eager launches on the step's stream, not part
of the graph) only when the tables' moves, the table length the kernel reads or the block count differ from the last
partition, into buffers of fixed address that the captured kernel reads (paged_decode(partition=...)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.attention.partition import PartitionedTable, partition_table
from kvstore.attention.plan import DecodeGeometry, decode_config
from kvstore.blocks.table import LayerTable

if TYPE_CHECKING:
    from kvstore.config import ModelSpec


def dense_bucket(num_tokens: int, block_tokens: int, capacity: int) -> int:
    """Blocks of the dense table at num_tokens: the blocks held rounded up to a multiple of a quarter of the
    power of two below them (at most 1.25x; >= 16), at most capacity. The kernel sizes its walk and grid by
    the table's length; a graph serves one bucket, four per doubling of the context."""
    blocks = -(-num_tokens // block_tokens)
    quarter = max(1, (1 << max(0, (blocks - 1).bit_length() - 1)) // 4)
    return min(capacity, max(16, -(-blocks // quarter) * quarter))


def partition_walk(device: torch.device, geom: DecodeGeometry) -> bool:
    """Whether the store's kernel walks a table of both pools of this geometry partitioned: on CUDA when the table
    is too long for the one-tile walk (the CPU reference walks no partition)."""
    return device.type == "cuda" and not decode_config(geom, device).one_tile


class StepPartitions:
    """Per layer, the dense table [1, H, m] (the layer's maps over its first m entries, shared by the kv heads)
    partitioned at the token count of the coming token."""

    def __init__(self, spec: ModelSpec, capacity: int, block_tokens: int, device: torch.device) -> None:
        self.spec, self.block_tokens, self.device = spec, block_tokens, device
        i32 = dict(dtype=torch.int32, device=device)
        self.slots = torch.zeros((spec.num_layers, capacity), **i32)  # [L, N] one row per layer (tables are shared)
        self.positions = torch.zeros((spec.num_layers, capacity), **i32)  # [L, N]
        self.num_fp16 = torch.zeros((spec.num_layers, 1), **i32)  # [L, 1]
        self.count = torch.zeros(1, **i32)  # [1] tokens the coming token's kernel reads
        self.layers: list[PartitionedTable] = []  # what the kernel of each layer reads; [] when none is needed
        self._key: tuple | None = None
        self.partitions = 0  # times the tables were partitioned (tests read it)

    def update(self, tables: list[LayerTable], num_entries: int, num_tokens: int, both_pools: bool) -> None:
        """Before a token: each table's first num_entries entries partitioned at num_tokens tokens where the kernel
        gets both pools (both_pools: a dense phase with warm blocks) and would walk the table partitioned;
        unless the buffers hold that already (same length, block count and moves)."""
        if not both_pools:
            self.layers, self._key = [], None
            return
        s, m = self.spec, num_entries
        key = (m, -(-num_tokens // self.block_tokens), tuple(t.moves for t in tables))
        if key == self._key:  # host work of most tokens ends here
            return
        self.layers = []
        if partition_walk(self.device, DecodeGeometry(1, s.num_q_heads, s.num_kv_heads, s.head_dim,
                                                      self.block_tokens, m)):
            self.count.fill_(num_tokens)
            for layer, table in enumerate(tables):
                out = (self.slots[layer, :m].view(1, 1, m), self.positions[layer, :m].view(1, 1, m),
                       self.num_fp16[layer].view(1, 1))
                self.layers.append(partition_table(table.slot_map[None, None, :m].expand(1, s.num_kv_heads, m),
                                                   table.tier_map[None, None, :m].expand(1, s.num_kv_heads, m),
                                                   self.count, self.block_tokens, out=out))
            self.partitions += 1
        self._key = key

    def of_layer(self, layer: int) -> PartitionedTable | None:
        return self.layers[layer] if self.layers else None

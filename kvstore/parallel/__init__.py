"""Context parallelism: one sequence's blocks sharded over ranks (processes, one per GPU).

    shards.py    ShardPlan (which contiguous, block-aligned range of the sequence each rank holds; the last rank
                 holds the tail, so every appended token), the protected blocks of a shard, and the budget rule:
                 how many blocks each rank selects beyond its protected ones
    group.py     RankGroup: the ranks of torch.distributed's process group (NCCL on GPUs, gloo on CPU; gloo with
                 CUDA tensors stages them through the host), all_gather; `spawn` for tests and benchmarks
    merge.py     partial attention outputs of the ranks -> the sequence's output, by their log-sum-exps
                 (kvstore.attention.merge's split merge; its torch reference on CPU)
    sequence.py  ShardedSequence: fill, append (only the owner stores), attend (select and attend over the
                 shard, all_gather [q heads, head_dim + 1], merge)
    saved.py     save_sharded / open_sharded: each rank's shard through store.save / store.open, and a checksummed
                 manifest of the split (ranks, starts, tokens per layer, geometry, each shard's save id)
    reference.py ShardedSelection: the ranks' selection computed in one process over the whole sequence (a
                 policy for store.attend), what the multi-process runs are tested against

Weights are replicated; only the sequence is split. docs/context-parallel.md describes the design.
"""

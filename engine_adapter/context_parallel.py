"""ContextParallelDecoder: a Llama (engine_adapter/llama.py) decoding one sequence whose KV cache is sharded
over ranks (kvstore.parallel.ShardedSequence).

Every rank holds the whole model and runs the same per-token math; only attention differs: each rank attends
its shard and the partial outputs merge by log-sum-exp (one all_gather of [q heads, head_dim + 1] per layer,
and for topk / sketch one of [kv heads, k_free] bounds before it). The merged output is the same on every rank,
so every rank computes the same logits and greedy tokens. The prefill's compute is replicated (every rank runs
the whole prompt, as Decoder does, and keeps its range of the K/V); the decode loop is the eager one
(append, attend per layer), not the captured step. docs/context-parallel.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_adapter.llama import Llama, chunk_attention
from kvstore.parallel.group import RankGroup
from kvstore.parallel.sequence import ShardedSequence
from kvstore.parallel.shards import ShardPlan
from kvstore.store import KVStore


class ContextParallelDecoder:
    """This rank's part of a greedy decode of one sharded sequence: prefill once, then decode_step per token."""

    def __init__(self, model: Llama, store: KVStore, group: RankGroup) -> None:
        if model.args.spec != store.config.model:
            raise ValueError(f"store geometry {store.config.model} does not match the model's {model.args.spec}")
        self.model, self.store, self.group = model, store, group
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        if self.device.type != store.device.type:
            raise ValueError(f"model on {self.device} but store on {store.device}; put both on one device type")
        self.sequence: ShardedSequence | None = None

    def use(self, sequence: ShardedSequence) -> None:
        """Decode on a sequence filled some other way (e.g. K/V written by ShardedSequence.fill), not prefilled."""
        if self.sequence is not None:
            raise ValueError("this decoder holds a sequence already")
        if sequence.store is not self.store or sequence.group.rank != self.group.rank:
            raise ValueError("the sequence must live in this decoder's store, on this rank")
        self.sequence = sequence

    @property
    def length(self) -> int:
        """Tokens of the sequence (its next position)."""
        return 0 if self.sequence is None else self.sequence.lengths[0]

    def _tokens(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)  # [T]
        vocab = self.model.args.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"need at least one token id, each in [0, {vocab}), got {ids.tolist()[:16]}")
        return ids

    @torch.no_grad()
    def prefill(self, token_ids: Sequence[int] | torch.Tensor, chunk_tokens: int = 512) -> torch.Tensor:
        """Shard the prompt over the ranks (ShardPlan.split) and prefill it layer-wise, as Decoder does (K/V
        rounded to fp16 before anyone attends to them); returns the next-token logits [vocab] (fp32)."""
        if self.sequence is not None:
            raise ValueError("this decoder holds a sequence already: one prefill, then decode_step")
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        ids = self._tokens(token_ids)
        a, t = self.model.args, ids.numel()
        plan = ShardPlan.split(t, self.group.world_size, self.store.config.block_tokens)
        self.sequence = ShardedSequence(self.store, self.group, plan)
        cos, sin = self.model.rope(torch.arange(t, device=self.device), self.dtype)  # [T, D]
        x = self.model.embed_tokens(ids)  # [T, dim]
        for i, layer in enumerate(self.model.layers):
            keys = torch.empty((t, a.num_kv_heads, a.head_dim), dtype=self.dtype, device=self.device)  # [T, Hkv, D]
            values = torch.empty_like(keys)
            for lo in range(0, t, chunk_tokens):
                hi = min(t, lo + chunk_tokens)
                q, k, v = layer.qkv(x[lo:hi], cos[lo:hi], sin[lo:hi])
                keys[lo:hi], values[lo:hi] = k.half(), v.half()
                x[lo:hi] = layer.finish(x[lo:hi], chunk_attention(q, keys[:hi], values[:hi], lo))
            self.sequence.fill(i, keys.half(), values.half())  # each rank keeps its range
        return self.model.logits(x[-1:])[0]

    @torch.no_grad()
    def decode_step(self, token_id: int, mode: str = "dense", budget: int = 4096) -> torch.Tensor:
        """Append token_id (stored by the rank holding the tail) and attend over every shard; fp32 logits [vocab]."""
        if self.sequence is None:
            raise ValueError("prefill a prompt before decode_step")
        ids = self._tokens([token_id])
        cos, sin = self.model.rope(torch.tensor([self.length], device=self.device), self.dtype)
        x = self.model.embed_tokens(ids)  # [1, dim]
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(x, cos, sin)
            self.sequence.append(i, k.half(), v.half())
            attn = self.sequence.attend(i, q[0].half(), mode, budget)  # [Hq, D] fp16, merged over the ranks
            x = layer.finish(x, attn[None])
        return self.model.logits(x)[0]

    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, mode: str = "dense",
                 budget: int = 4096, chunk_tokens: int = 512) -> list[int]:
        """Greedy: prefill, then max_new_tokens - 1 decode steps; the same tokens on every rank."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        out = [int(self.prefill(prompt_ids, chunk_tokens).argmax())]
        while len(out) < max_new_tokens:
            out.append(int(self.decode_step(out[-1], mode, budget).argmax()))
        return out

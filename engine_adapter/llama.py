"""A compact Llama-family decoder (gpt-fast style) whose KV cache lives in a KVStore.

The module holds the math only: RMSNorm, RoPE, GQA attention projections and the
SwiGLU MLP, with parameter names that mirror Hugging Face's so an HF state dict
loads after stripping prefixes (see engine_adapter.weights). `Decoder` runs it
against a store: a layer-wise prefill (per layer, the prompt's causal attention with SDPA
over its K/V on the device, the sequence's earlier tokens read from the store once, then
the K/V appended to the store), decode one token at a time through `store.attend`,
greedy `generate`.

K and V enter the store as fp16 with RoPE already applied to K; compute is in the
model's dtype (fp32 matches the HF reference best on CPU).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from kvstore.config import ModelSpec
from kvstore.step import STEP_MODES, StepNotReady

if TYPE_CHECKING:
    from kvstore.store import KVStore

TokenIds = Sequence[int] | torch.Tensor
APPEND_TOKENS = 1 << 16  # prefill appends a layer's K/V to the store this many tokens at a time


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    """Everything the module needs to build itself; `spec` is the KV geometry the store sees."""

    vocab_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dim: int
    hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "dim", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaArgs.{name} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim)

    @staticmethod
    def from_spec(spec: ModelSpec, vocab_size: int = 32000, rope_theta: float = 500000.0) -> LlamaArgs:
        """A Llama-shaped model around a KV geometry; the MLP width follows gpt-fast's 8/3 rule."""
        dim = spec.num_q_heads * spec.head_dim
        hidden = -(-int(8 * dim / 3) // 256) * 256
        return LlamaArgs(vocab_size, spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim,
                         dim, hidden, rope_theta=rope_theta)


def default_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Plain RoPE frequencies [D/2] (fp32, on the CPU whatever the default device)."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float32, device="cpu") / args.head_dim
    return 1.0 / args.rope_theta ** exponents


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)  # same rounding order as HF's LlamaRMSNorm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-split convention: x [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Layer(nn.Module):
    """One decoder block; attention itself happens outside, against the store."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        q_dim, kv_dim = args.num_q_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.args = args
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.q_proj = nn.Linear(args.dim, q_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, args.dim, bias=False)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, dim] -> q [T, Hq, D], k [T, Hkv, D] (both rotated), v [T, Hkv, D]."""
        a, h = self.args, self.input_layernorm(x)
        q = self.q_proj(h).view(-1, a.num_q_heads, a.head_dim)
        k = self.k_proj(h).view(-1, a.num_kv_heads, a.head_dim)
        v = self.v_proj(h).view(-1, a.num_kv_heads, a.head_dim)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + output projection of attn [T, Hq, D], then the SwiGLU MLP."""
        x = x + self.o_proj(attn.reshape(x.shape[0], -1).to(x.dtype))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """Weights and per-token math; `inv_freq` and `rope_scale` carry whatever RoPE variant the checkpoint uses."""

    def __init__(self, args: LlamaArgs, inv_freq: torch.Tensor | None = None, rope_scale: float = 1.0) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        if inv_freq is None:
            inv_freq = default_inv_freq(args)
        if inv_freq.shape != (args.head_dim // 2,):
            raise ValueError(f"inv_freq must have shape ({args.head_dim // 2},), got {tuple(inv_freq.shape)}")
        self.inv_freq = inv_freq.float()  # [D/2]; not a buffer, so casting the model to fp16 leaves it fp32
        self.rope_scale = rope_scale

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D], computed in fp32 like HF, then cast."""
        if self.inv_freq.device != positions.device:  # once: a captured decode step cannot copy from the host
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden [T, dim] -> fp32 logits [T, vocab]."""
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA attention of a chunk: q [T, Hq, D] at positions start.., k/v [S, Hkv, D] for positions 0..S-1."""
    t, s = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if start == 0 and s == t:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif start + t == s and q.device.type == "cuda":  # flash, lower-right causal: no [T, S] mask in memory
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, s), enable_gqa=True)
    else:
        mask = torch.arange(s, device=q.device)[None, :] <= torch.arange(start, start + t, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # [T, Hq, D]


class Decoder:
    """Runs a Llama against a KVStore: chunked prefill, per-token decode, greedy generation.

    A step that fails part way (a full store, a bad mode) leaves the sequence with some layers
    ahead of others: free it. The store's length of a sequence is its next position."""

    def __init__(self, model: Llama, store: KVStore, graphs: bool = True) -> None:
        if model.args.spec != store.config.model:
            raise ValueError(f"store geometry {store.config.model} does not match the model's {model.args.spec}")
        self.model = model
        self.store = store
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        if self.device.type != store.device.type:
            raise ValueError(f"model on {self.device} but store on {store.device}; put both on one device type")
        self.graphs = graphs  # on CUDA, decode dense/topk through captured steps (False: always eager)
        self._graphs: dict[tuple[int, str, int], object] = {}  # (seq, mode, budget) -> GraphDecoder (CUDA)

    def length(self, seq: int) -> int:
        """Tokens the sequence holds (its next position)."""
        return self.store.table(seq, 0).num_tokens

    def _tokens(self, token_ids: TokenIds) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)  # [T]
        vocab = self.model.args.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}), got range [{int(ids.min())}, {int(ids.max())}]")
        return ids

    @torch.no_grad()
    def forward_chunk(self, seq: int, token_ids: TokenIds, all_logits: bool = False) -> torch.Tensor:
        """Append one chunk to the sequence; fp32 logits [T, vocab] for its positions ([1, vocab]: the last)."""
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("forward_chunk needs at least one token, got none")
        x = self._prefill_hidden(seq, ids, ids.numel())
        return self.model.logits(x if all_logits else x[-1:])

    @torch.no_grad()  # not inference_mode: tensors the store allocates here must stay writable after
    def _prefill_hidden(self, seq: int, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        """Layer-wise prefill of ids [T] after the sequence's tokens; returns the last layer's hidden [T, dim].

        Per layer: the layer's K/V of the whole prompt stay on the device (the earlier tokens read from
        the store once, up front), queries and the MLP run chunk_tokens at a time with causal SDPA over
        the K/V so far, then the prompt's K/V are appended to the store (placed by tier). K/V are
        rounded to fp16 before anyone attends to them: exactly what decode later reads back."""
        a, start, t = self.model.args, self.length(seq), ids.numel()
        self._record_tokens(seq, ids)
        cos, sin = self.model.rope(torch.arange(start, start + t, device=self.device), self.dtype)  # [T, D]
        x = self.model.embed_tokens(ids)  # [T, dim]
        for i, layer in enumerate(self.model.layers):
            keys = torch.empty((start + t, a.num_kv_heads, a.head_dim), dtype=self.dtype, device=self.device)
            values = torch.empty_like(keys)  # [S, Hkv, D] for positions 0..start+T-1
            if start:
                keys[:start], values[:start] = self.store.read(seq, i)
            for lo in range(0, t, chunk_tokens):
                hi = min(t, lo + chunk_tokens)
                q, k, v = layer.qkv(x[lo:hi], cos[lo:hi], sin[lo:hi])
                keys[start + lo: start + hi], values[start + lo: start + hi] = k.half(), v.half()
                attn = chunk_attention(q, keys[: start + hi], values[: start + hi], start + lo)
                x[lo:hi] = layer.finish(x[lo:hi], attn)
            for lo in range(start, start + t, APPEND_TOKENS):  # bounded staging in the store's append
                hi = min(start + t, lo + APPEND_TOKENS)
                self.store.append(seq, i, keys[lo:hi].half(), values[lo:hi].half())
        return x

    def prefill_logits(self, seq: int, token_ids: TokenIds, chunk_tokens: int = 512,
                       all_logits: bool = True) -> Iterator[torch.Tensor]:
        """Prefill (layer-wise, chunk_tokens queries at a time), then yield each chunk's logits [t, vocab]
        (or [1, vocab], its last)."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token, got none")
        x = self._prefill_hidden(seq, ids, chunk_tokens)
        for begin in range(0, ids.numel(), chunk_tokens):
            h = x[begin: begin + chunk_tokens]
            with torch.no_grad():
                yield self.model.logits(h if all_logits else h[-1:])

    def prefill(self, seq: int, token_ids: TokenIds, chunk_tokens: int = 512) -> torch.Tensor:
        """Prefill the prompt; returns the logits [vocab] that predict the next token."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token, got none")
        with torch.no_grad():
            return self.model.logits(self._prefill_hidden(seq, ids, chunk_tokens)[-1:])[0]

    def prefill_shared(self, token_ids: TokenIds, chunk_tokens: int = 512) -> tuple[int, torch.Tensor, int]:
        """A new sequence for the prompt that starts on the longest prefix the store already holds (by
        token-id hash chain: store.match_prefix) and prefills only the rest (at least the last token, whose
        logits are returned). Returns (sequence, next-token logits [vocab], tokens reused)."""
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token, got none")
        match = self.store.match_prefix(ids[:-1].tolist())
        seq = self.store.create_sequence(prefix=match)
        try:
            return seq, self.prefill(seq, ids[match.num_tokens:], chunk_tokens), match.num_tokens
        except BaseException:
            self.free(seq)
            raise

    @torch.no_grad()  # not inference_mode: tensors the store allocates here must stay writable after
    def decode_step(self, seq: int, token_id: int, mode: str = "dense", budget: int = 4096) -> torch.Tensor:
        """Append one token and attend through the store; returns fp32 logits [vocab].

        On CUDA, dense and topk run the captured step (engine_adapter/graph_decode.py: every layer's
        append, select and attend in one graph replay) whenever every block is on the GPU; otherwise,
        and on CPU, the eager path below (store.append + store.attend per layer, same contract)."""
        graph, recorded = self._graph_decoder(seq, mode, budget), False
        if graph is not None and graph.ready():
            if not (isinstance(token_id, int) and 0 <= token_id < self.model.args.vocab_size):
                raise ValueError(f"token id must be an int in [0, {self.model.args.vocab_size}), got {token_id!r}")
            self._record_tokens(seq, [token_id])
            try:
                return graph(token_id).clone()
            except StepNotReady:  # nothing of this token's K/V happened: the eager path below runs it
                recorded = True
        ids = self._tokens([token_id])
        if not recorded:
            self._record_tokens(seq, ids)
        pos = self.length(seq)
        cos, sin = self.model.rope(torch.tensor([pos], device=self.device), self.dtype)
        x = self.model.embed_tokens(ids)  # [1, dim]
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(x, cos, sin)
            self.store.append(seq, i, k.half(), v.half())
            attn = self.store.attend(seq, i, q[0].half(), mode=mode, budget=budget)  # [Hq, D] fp16
            x = layer.finish(x, attn[None])
        return self.model.logits(x)[0]

    def _graph_decoder(self, seq: int, mode: str, budget: int):
        """The cached GraphDecoder of (seq, mode, budget) on CUDA, rebuilt when its capacity runs out."""
        if not self.graphs or self.device.type != "cuda" or mode not in STEP_MODES:
            return None
        from engine_adapter.graph_decode import GraphDecoder

        key = (seq, mode, budget)
        graph = self._graphs.get(key)
        if graph is not None and graph.ready():
            return graph
        tables = [self.store.table(seq, i) for i in range(self.model.args.num_layers)]
        if any(t.num_cold or t.num_dropped for t in tables):
            return None  # this token goes the eager way
        self._graphs[key] = graph = GraphDecoder(self.model, self.store, seq, mode, budget)  # new, or more capacity
        return graph

    def generate(self, seq: int, prompt_ids: TokenIds, max_new_tokens: int, mode: str = "dense", budget: int = 4096,
                 chunk_tokens: int = 512, eos_id: int | None = None) -> list[int]:
        """Greedy: prefill the prompt, then decode up to max_new_tokens (stopping after eos_id)."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        logits = self.prefill(seq, prompt_ids, chunk_tokens)
        return self.continue_greedy(seq, logits, max_new_tokens, mode, budget, eos_id)

    def continue_greedy(self, seq: int, logits: torch.Tensor, max_new_tokens: int, mode: str = "dense",
                        budget: int = 4096, eos_id: int | None = None) -> list[int]:
        """Greedy tokens from next-token logits [vocab] of an already prefilled sequence."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        out = [int(logits.argmax())]
        while len(out) < max_new_tokens and out[-1] != eos_id:
            out.append(int(self.decode_step(seq, out[-1], mode, budget).argmax()))
        return out

    def fork(self, seq: int) -> int:
        """A new sequence on seq's K/V (store.fork: full blocks shared, the partial tail copied), so several
        decode modes or questions share one prefill."""
        return self.store.fork(seq)

    def _record_tokens(self, seq: int, ids: TokenIds) -> None:
        """Token ids go to the store (content keys for prefix reuse, saved contexts) whenever it knows the
        sequence's ids from position 0 (not for K/V written without ids, e.g. a random fill)."""
        if self.store.tracks_tokens(seq):
            self.store.extend_tokens(seq, ids)

    def free(self, seq: int) -> None:
        self.store.free(seq)
        for key in [k for k in self._graphs if k[0] == seq]:
            del self._graphs[key]

"""A compact Llama-family model (gpt-fast style): the math only.

RMSNorm, RoPE, GQA attention projections, the SwiGLU MLP and chunk attention, with
parameter names that mirror Hugging Face's so an HF state dict loads after stripping
prefixes (see engine_adapter.weights). engine_adapter/decoder.py runs it against a KVStore.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from kvstore.config import ModelSpec


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

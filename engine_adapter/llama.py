"""A compact Llama-family model (gpt-fast style): the math only.

RMSNorm, RoPE, GQA attention projections, the SwiGLU MLP and chunk attention, with
parameter names that mirror Hugging Face's so an HF state dict loads after stripping
prefixes (see engine_adapter.weights). engine_adapter/decoder.py runs it against a KVStore.

On CUDA the per-token math runs as the fused Triton kernels of engine_adapter/fused_ops.py
(residual add + RMSNorm, RoPE of q and k, SiLU(gate) * up: one launch each), and q/k/v and
gate/up each as one matmul over weights that are row slices of one tensor (no second copy;
parameter names stay HF's). Elsewhere it runs the kernels' torch references: CPU results are
plain torch's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from engine_adapter.fused_ops import add_rmsnorm, add_rmsnorm_ref, rope, rotate_ref, silu_mul
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


def use_kernels(fused: bool | None, x: torch.Tensor) -> bool:
    """fused None (the default): the Triton kernels on CUDA, the torch references elsewhere; True or False
    forces one side (True on the CPU runs the kernels under TRITON_INTERPRET=1, for tests)."""
    return x.is_cuda if fused is None else fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused: bool | None = None  # see use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add(x, None)[1]

    def add(self, x: torch.Tensor, delta: torch.Tensor | None,
            residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm), each [T, dim], in one launch on the kernel path (HF LlamaRMSNorm's rounding
        order); the sum goes into residual_out when given (x itself: an in-place residual stream)."""
        kernel = use_kernels(self.fused, x) and x.dtype == self.weight.dtype  # else torch's type promotion
        norm = add_rmsnorm if kernel else add_rmsnorm_ref
        return norm(x, delta, self.weight, self.eps, residual_out)


def merge_rows(*linears: nn.Linear) -> torch.Tensor:
    """One [sum of out_features, in_features] tensor whose consecutive row slices become the linears' weights:
    one matmul computes all of them, while the parameters, their names and state-dict loading stay as they
    were (no second copy of the weights)."""
    with torch.no_grad():
        merged = torch.cat([linear.weight.detach() for linear in linears])
    row = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = merged[row: row + rows]
        row += rows
    return merged


def is_merged(merged: torch.Tensor, *linears: nn.Linear) -> bool:
    """True while the linears' weights are consecutive row slices of `merged` (a deepcopy or a reassigned
    weight unties them; the projections then run one by one)."""
    ptr, row_bytes = merged.data_ptr(), merged.stride(0) * merged.element_size()
    for linear in linears:
        w = linear.weight
        if w.data_ptr() != ptr or w.dtype != merged.dtype or w.device != merged.device or w.stride() != merged.stride():
            return False
        ptr += w.shape[0] * row_bytes
    return True


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
        self.fused: bool | None = None  # see use_kernels
        self._merge_projections()

    def _merge_projections(self) -> None:
        self.qkv_weight = merge_rows(self.q_proj, self.k_proj, self.v_proj)  # [q_dim + 2 kv_dim, dim]
        self.gate_up_weight = merge_rows(self.gate_proj, self.up_proj)  # [2 hidden_dim, dim]

    def _apply(self, fn, recurse: bool = True) -> Layer:  # .to(), .half(), .to_empty() move each weight apart
        super()._apply(fn, recurse)
        if not (is_merged(self.qkv_weight, self.q_proj, self.k_proj, self.v_proj)
                and is_merged(self.gate_up_weight, self.gate_proj, self.up_proj)):
            self._merge_projections()
        return self

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            delta: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x [T, dim] -> q [T, Hq, D], k [T, Hkv, D] (both rotated), v [T, Hkv, D].

        delta [T, dim]: the previous layer's MLP output not yet added to x (finish_deferred); it is added
        into x in place, in the norm's launch."""
        a = self.args
        h = self.input_layernorm.add(x, delta, None if delta is None else x)[1]
        if not use_kernels(self.fused, x):
            q = self.q_proj(h).view(-1, a.num_q_heads, a.head_dim)
            k = self.k_proj(h).view(-1, a.num_kv_heads, a.head_dim)
            v = self.v_proj(h).view(-1, a.num_kv_heads, a.head_dim)
            return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin), v
        if is_merged(self.qkv_weight, self.q_proj, self.k_proj, self.v_proj):
            q_dim, kv_dim = a.num_q_heads * a.head_dim, a.num_kv_heads * a.head_dim
            q, k, v = F.linear(h, self.qkv_weight).split([q_dim, kv_dim, kv_dim], dim=-1)  # column slices
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q, k = q.view(-1, a.num_q_heads, a.head_dim), k.view(-1, a.num_kv_heads, a.head_dim)
        if cos.dtype == q.dtype:
            q, k = rope(q, k, cos, sin)
        else:  # torch's type promotion (e.g. fp32 tables for an fp16 model)
            q, k = rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)
        return q, k, v.view(-1, a.num_kv_heads, a.head_dim).contiguous()  # a copy only when T > 1

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + output projection of attn [T, Hq, D], then the SwiGLU MLP."""
        x, delta = self.finish_deferred(x, attn)
        return x + delta

    def finish_deferred(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """finish without its last residual add: (x + o_proj(attn), the MLP's output), each [T, dim]; the next
        layer's qkv (or logits) adds the second in its norm's launch."""
        x, h = self.post_attention_layernorm.add(x, self.o_proj(attn.reshape(x.shape[0], -1).to(x.dtype)))
        if not use_kernels(self.fused, x):
            return x, self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        if is_merged(self.gate_up_weight, self.gate_proj, self.up_proj):
            gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)  # column slices
        else:
            gate, up = self.gate_proj(h), self.up_proj(h)
        return x, self.down_proj(silu_mul(gate, up))


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

    def use_kernels(self, fused: bool | None) -> Llama:
        """The fused Triton kernels (True), the torch references (False), or by device (None, the default)."""
        for module in self.modules():
            if isinstance(module, (Layer, RMSNorm)):
                module.fused = fused
        return self

    def logits(self, h: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden [T, dim] (plus the last layer's deferred MLP output delta) -> fp32 logits [T, vocab]."""
        h = self.norm.add(h, delta)[1]
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

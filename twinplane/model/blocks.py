"""The decoder's building blocks that families share: RMSNorm, rotary embedding, attention with its projections,
the SwiGLU MLP. A family (twinplane/model/families/) picks and configures them; `Transformer` stacks them.

Module and parameter names follow Hugging Face (`self_attn.q_proj`, `mlp.gate_proj`), so checkpoints load without
renaming.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.attention import AttentionMetadata, attention

if TYPE_CHECKING:
    from twinplane.model.config import ModelConfig
    from twinplane.model.moe import RoutingState


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 then cast back before the scale, as HF does (keeps bf16 numerics identical).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, T, hd] (cos/sin [B, 1, T, rotary_dim]), HF's rotate-half layout; with
    partial rotary (rotary_dim < hd) the first rotary_dim dims of each head rotate and the rest pass through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :rd]
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., rd:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm on q and k before rope
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> q [B, T, H, hd], k and v [B, T, H_kv, hd]. (The rollout engine's CPU copy computes the
        three in one GEMM: twinplane.rollout.prepacked.PrepackedAttention.)"""
        hd = self.cfg.head_dim
        return tuple(p(x).unflatten(-1, (-1, hd)) for p in (self.q_proj, self.k_proj, self.v_proj))

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> q [B, H, T, hd] and k [B, H_kv, T, hd] with rope applied, v [B, H_kv, T, hd]. (The
        engine's CPU copy ropes q and k in one pass: twinplane.rollout.prepacked.PrepackedAttention.)"""
        q, k, v = self.project(x)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return rope(q, cos, sin), rope(k, cos, sin), v

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        B, T, _ = x.shape
        y = attention(*self.qkv(x, cos, sin), meta, self.layer)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d: int, f: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x, routing: RoutingState | None = None):
        # (the rollout engine's CPU copy computes gate and up in one GEMM: twinplane.rollout.prepacked.PrepackedMLP)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def dense_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class GateUpMLP(nn.Module):
    """The SwiGLU MLP with gate and up in one weight, `gate_up_proj` [2 f, d] (gate first), as GLM and Phi-3
    publish it: one parameter, so checkpoints, LoRA targets and the engine's GEMM all see the fused projection."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x, routing: RoutingState | None = None):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


def gate_up_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    return GateUpMLP(cfg.hidden_size, cfg.intermediate_size)

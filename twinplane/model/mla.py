"""Multi-head latent attention (DeepSeek-V2/V3, Liu et al. 2024), serving both planes.

Per token: q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x) without `q_lora_rank`), split per head into a part without
position (qk_nope_head_dim) and a roped part (head_dim, transformers' qk_rope_head_dim); kv_a_proj_with_mqa(x) gives
a latent c (kv_lora_rank, normed) and one roped key shared by every head; kv_b_proj(c) gives each head's k_nope and
v (v_head_dim). Scores are scaled by qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the
config's rope scaling has `mscale_all_dim` (transformers' `yarn_apply_mscale`).

- training (dense and packed layouts): the decompressed form, as transformers computes it; values are padded with
  zeros to the q/k width (one head size for every attention kernel) and the padding sliced off after.
- the rollout engine (paged layout): the absorbed form. What the KV pool holds per token is the compressed
  [c, roped key] (kv_lora_rank + head_dim values, one "KV head", `ModelConfig.kv_layout`); kv_b_proj's key half is
  folded into the query (q_nope W_uk: a query of the latent's width) and its value half applied to the attention
  output, so attention runs as multi-query attention over the latent. The values are the keys' latent part: the
  pool is read as both (the output's rope columns are dropped). Both forms give the same scores up to rounding.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.attention import AttentionMetadata, attention
from twinplane.model.blocks import RMSNorm, rope
from twinplane.model.layer import DecoderLayer
from twinplane.model.rope import yarn_mscale

if TYPE_CHECKING:
    from twinplane.model.config import ModelConfig

LATENT_NORM_EPS = 1e-6  # transformers builds the q and kv latents' norms with their default eps, not rms_norm_eps


def softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("mscale_all_dim"):
        scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope pairs (x0, x1), (x2, x3), ... laid out as rotate-half's halves [x0, x2, ..; x1, x3, ..]: rope
    in the rotate-half layout then gives transformers' `apply_rotary_pos_emb_interleave` exactly."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        d, H, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        self.nope, self.rot, self.v_dim = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        qk = self.nope + self.rot
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, r + self.rot, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(r, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(r, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=cfg.o_bias)
        self.scale = softmax_scale(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.cfg.q_lora_rank else self.q_proj(x)
        q_nope, q_rot = q.unflatten(-1, (-1, self.nope + self.rot)).transpose(1, 2).split([self.nope, self.rot], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.rot], -1)
        latent, k_rot = self.kv_a_layernorm(latent)[:, None], k_rot[:, None]  # [B, 1, T, r], [B, 1, T, rot]
        if self.cfg.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = rope(q_rot, cos, sin), rope(k_rot, cos, sin)
        if meta.paged is not None:
            y = self.absorbed(q_nope, q_rot, latent, k_rot, meta)
        else:
            y = self.decompressed(q_nope, q_rot, latent, k_rot, meta)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def decompressed(self, q_nope, q_rot, latent, k_rot, meta: AttentionMetadata) -> torch.Tensor:
        """Per-head keys and values from the latent -> [B, H, T, v_head_dim]."""
        H = q_nope.shape[1]
        k_nope, v = self.kv_b_proj(latent[:, 0]).unflatten(-1, (H, -1)).transpose(1, 2).split(
            [self.nope, self.v_dim], -1)
        q = torch.cat((q_nope, q_rot), -1)
        k = torch.cat((k_nope, k_rot.expand(-1, H, -1, -1)), -1)
        width = max(q.shape[-1], self.v_dim)  # one head size for q, k and v: pad with zeros
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
        # the kernels scale by width^-0.5; the model's scale goes into q
        y = attention(q * (self.scale * math.sqrt(width)), k, v, meta, self.layer)
        return y[..., :self.v_dim]

    def absorbed(self, q_nope, q_rot, latent, k_rot, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the compressed pool (one KV head [latent, roped key]) -> [B, H, T, v_head_dim]."""
        H, r = q_nope.shape[1], self.cfg.kv_lora_rank
        w = self.kv_b_proj.weight.unflatten(0, (H, -1))  # [H, nope + v, r]
        q = torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w[:, :self.nope]), q_rot), -1)  # [B, H, T, r + rot]
        kv = torch.cat((latent, k_rot), -1)  # [B, 1, T, r + rot]: keys, and (their first r columns) values
        y = attention(q * (self.scale * math.sqrt(q.shape[-1])), kv, kv, meta, self.layer)  # [B, H, T, r + rot]
        return torch.einsum("bhtr,hvr->bhtv", y[..., :r], w[:, self.nope:])


def latent_layer(cfg: ModelConfig, layer: int, mlp) -> nn.Module:
    """The pre-norm decoder layer with latent attention (its block is Llama's)."""
    block = DecoderLayer(cfg, layer, mlp)
    block.self_attn = LatentAttention(cfg, layer)
    return block

"""OLMo-2: post-norm layers (an RMSNorm on the attention's and on the MLP's output, before each residual add; none on
their input) and an RMSNorm on q and on k over the whole projection (every head at once), before rope. OLMo-2's
RMSNorm scales by its weight before casting back to the input's dtype (Llama's casts first).
"""

from __future__ import annotations

import torch
from torch import nn

from twinplane.model.blocks import Attention, RMSNorm, dense_mlp
from twinplane.model.family import DROPOUT, Family
from twinplane.model.layer import DecoderLayer


class Olmo2RMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Olmo2Attention(Attention):
    """q_norm / k_norm over all heads of the projection (Qwen3's are per head), applied before the head split."""

    def __init__(self, cfg, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = Olmo2RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        return tuple(t.unflatten(-1, (-1, self.cfg.head_dim)) for t in (q, k, v))


class Olmo2Layer(DecoderLayer):
    attention = Olmo2Attention

    def __init__(self, cfg, layer: int, mlp=dense_mlp):
        nn.Module.__init__(self)  # (no input norm: the norms sit on the outputs)
        self.self_attn = self.attention(cfg, layer)
        self.mlp = mlp(cfg, layer)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def block(self, x, cos, sin, meta, routing=None):
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x, routing))


def read(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))  # on q/k/v and o alike
    return dict(qkv_bias=bias, o_bias=bias, rms_norm_eps=hf.get("rms_norm_eps", 1e-5))


FAMILY = Family("olmo2", "Olmo2ForCausalLM", read, write=lambda cfg: dict(attention_bias=cfg.qkv_bias),
                decoder_layer=Olmo2Layer, norm=Olmo2RMSNorm, unsupported=DROPOUT)

"""GLM-4-9B-chat-hf (`glm`): Llama's pre-norm layer with GLM's rope: interleaved (pairs of adjacent dims rotate
together, not the two halves of the head) and partial (the first `partial_rotary_factor` of each head, 0.5 unless
the config says otherwise; the rest passes through). Biases on q/k/v only (`attention_bias`, on by default), gate
and up fused in `gate_up_proj`. GLM-4-0414 (`glm4`, twinplane.model.families.glm4) adds two norms per layer."""

from __future__ import annotations

import torch

from twinplane.model.blocks import Attention, gate_up_mlp
from twinplane.model.family import DROPOUT, Family
from twinplane.model.layer import DecoderLayer
from twinplane.model.rope import read_partial_rotary


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM's rope of x [B, heads, T, hd] from the rotate-half cos/sin [B, 1, T, rotary_dim] the model makes: dims
    (2i, 2i+1) of the first rotary_dim rotate by frequency i, the rest pass through (transformers'
    `apply_rotary_pos_emb` of modeling_glm4, op for op)."""
    rd = cos.shape[-1]
    cos, sin = (t[..., :rd // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
    rot = x[..., :rd]
    rotated = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((rot * cos + rotated * sin, x[..., rd:]), dim=-1)


class GlmAttention(Attention):
    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (t.transpose(1, 2) for t in self.project(x))
        return rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin), v


class GlmLayer(DecoderLayer):
    attention = GlmAttention


def read(hf: dict) -> dict:
    return dict(qkv_bias=bool(hf.get("attention_bias", True)), o_bias=False,
                partial_rotary_factor=read_partial_rotary(hf, default=0.5))


def write(cfg) -> dict:
    return dict(attention_bias=cfg.qkv_bias, partial_rotary_factor=cfg.partial_rotary_factor)


FAMILY = Family("glm", "GlmForCausalLM", read, write, mlp=gate_up_mlp, decoder_layer=GlmLayer, unsupported=DROPOUT)

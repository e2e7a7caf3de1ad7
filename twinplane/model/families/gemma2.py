"""Gemma 2: sliding-window and global layers alternating (`layer_types`, else every other layer from the first
slides), tanh soft-capping of the attention scores (`attn_logit_softcapping`) and of the final logits
(`final_logit_softcapping`), scores scaled by 1/sqrt(query_pre_attn_scalar), embeddings times sqrt(hidden_size),
RMSNorms that scale by (1 + weight) in fp32, four of them per layer (around attention and around the GELU-tanh MLP).

The per-layer windows, scale and soft-cap reach attention through `AttentionMetadata.for_layer`
(`ModelConfig.layer_attention`); soft-capped layers take the portable attention path on both planes, except the
engine's Triton paged decode, which caps scores itself."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.blocks import MLP, Attention
from twinplane.model.family import DROPOUT, Family, Option
from twinplane.model.layer import DecoderLayer

ACTIVATION = "gelu_pytorch_tanh"
BIDIRECTIONAL = {"use_bidirectional_attention": Option(lambda v: not v, "bidirectional (non-causal) attention")}


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: weights stored as an offset from 1, the scale applied in fp32 before casting back (Llama's
    casts first)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaMLP(MLP):
    def forward(self, x, routing=None):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def gemma_mlp(cfg, layer: int) -> nn.Module:
    return GemmaMLP(cfg.hidden_size, cfg.intermediate_size)


class GemmaDecoderLayer(DecoderLayer):
    """Norms before and after both attention and the MLP; the residual adds the post-norm's output."""

    attention = Attention

    def __init__(self, cfg, layer: int, mlp: Callable[..., nn.Module] = gemma_mlp):
        nn.Module.__init__(self)
        self.self_attn = self.attention(cfg, layer)
        self.mlp = mlp(cfg, layer)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def block(self, x, cos, sin, meta, routing=None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), routing))


def read_common(hf: dict, pattern: int, softcaps: tuple[float | None, float | None]) -> dict:
    """What Gemma 2 and 3 read alike, with transformers' defaults for absent keys: `pattern` (every pattern-th
    layer global, the others sliding) where `layer_types` is absent; `softcaps` (attention, final logits)."""
    act = hf.get("hidden_activation", ACTIVATION)
    if act != ACTIVATION:
        raise ValueError(f"hidden_activation {act!r} is not supported ({hf['model_type']} is implemented with "
                         f"{ACTIVATION})")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n)]
    window = hf.get("sliding_window", 4096)
    if "sliding_attention" in types and not window:
        raise ValueError(f"{hf['model_type']}: layer_types has sliding_attention layers but sliding_window is "
                         f"{window!r}")
    bias = bool(hf.get("attention_bias", False))
    return dict(
        qkv_bias=bias, o_bias=bias, head_dim=hf.get("head_dim") or 256, tie_word_embeddings=hf.get(
            "tie_word_embeddings", True), sliding_window=window or None, layer_types=list(types),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=hf.get("attn_logit_softcapping", softcaps[0]),
        final_logit_softcapping=hf.get("final_logit_softcapping", softcaps[1]))


def write(cfg) -> dict:
    return dict(hidden_activation=ACTIVATION, hidden_act=ACTIVATION, attention_bias=cfg.qkv_bias,
                sliding_window=cfg.sliding_window, layer_types=cfg.layer_types,
                query_pre_attn_scalar=cfg.query_pre_attn_scalar, attn_logit_softcapping=cfg.attn_logit_softcapping,
                final_logit_softcapping=cfg.final_logit_softcapping)


FAMILY = Family("gemma2", "Gemma2ForCausalLM", lambda hf: read_common(hf, 2, (50.0, 30.0)), write, mlp=gemma_mlp,
                decoder_layer=GemmaDecoderLayer, unsupported=DROPOUT | BIDIRECTIONAL, activation_key=None,
                norm=GemmaRMSNorm, scale_embeddings=True)

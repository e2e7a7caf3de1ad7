"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of linear attention and attention. Most layers mix tokens with Gated
DeltaNet (twinplane.model.gated_deltanet: a causal convolution, then the gated delta rule, whose state the rollout
engine keeps per sequence); the others (`layer_types` "full_attention", else every `full_attention_interval`-th)
attend with an output gate: q_proj makes each head's query and a gate, the output times sigmoid(gate), with
q/k norms and partial rotary (`partial_rotary_factor`, 0.25 unless set). Every RMSNorm scales by (1 + weight) in
fp32 (Gemma's form), the gated norm inside DeltaNet aside. The MLP is Qwen2-MoE's: routed experts and a shared
expert behind a sigmoid gate (dense layers per `mlp_only_layers` / `decoder_sparse_step`). The multi-token-prediction
weights (`mtp.*`) published checkpoints carry are not part of the model and are skipped on load, as transformers
does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from twinplane.model import moe
from twinplane.model.attention import AttentionMetadata, attention
from twinplane.model.blocks import Attention, rope
from twinplane.model.families.gemma2 import GemmaRMSNorm
from twinplane.model.family import DROPOUT, Family, Ignored
from twinplane.model.gated_deltanet import GatedDeltaNet
from twinplane.model.layer import DecoderLayer
from twinplane.model.rope import read_partial_rotary

KINDS = ("linear_attention", "full_attention")


class GatedAttention(Attention):
    """Attention whose q_proj also makes a per-head output gate ([q | gate] per head), q/k normed by (1 + w)."""

    def __init__(self, cfg, layer: int):
        nn.Module.__init__(self)
        self.layer, self.cfg = layer, cfg
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.qkv_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=cfg.o_bias)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q, gate = self.q_proj(x).unflatten(-1, (-1, 2 * hd)).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).unflatten(-1, (-1, hd))).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (-1, hd)).transpose(1, 2)
        y = attention(rope(q, cos, sin), rope(k, cos, sin), v, meta, self.layer)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1)))


class HybridLayer(DecoderLayer):
    """Pre-norm block whose token mixer is Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`)."""

    linear: type[nn.Module] = GatedDeltaNet

    def __init__(self, cfg, layer: int, mlp: Callable[..., nn.Module] = moe.sparse_mlp_shared):
        nn.Module.__init__(self)
        if layer in cfg.linear_layers:
            self.linear_attn = self.linear(cfg, layer)
        else:
            self.self_attn = GatedAttention(cfg, layer)
        self.mlp = mlp(cfg, layer)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def block(self, x, cos, sin, meta, routing=None):
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x = x + mixer(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x), routing)


def layer_kinds(hf: dict) -> list[str]:
    """transformers' `layer_types`, or its default: every `full_attention_interval`-th layer (4) attends."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["full_attention" if (i + 1) % (hf.get("full_attention_interval") or 4) == 0
                                      else "linear_attention" for i in range(n)]
    if len(kinds) != n or not set(kinds) <= set(KINDS):
        raise ValueError(f"{hf.get('model_type')}: layer_types must name {n} layers, each one of {KINDS}, got "
                         f"{kinds!r}")
    return kinds


def read_hybrid(hf: dict) -> dict:
    """What Qwen3-Next and Qwen3.5 share: the layer kinds, DeltaNet's sizes, the gated attention's options."""
    bias = bool(hf.get("attention_bias", False))
    kinds = layer_kinds(hf)
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, partial_rotary_factor=read_partial_rotary(hf, 0.25),
                head_dim=hf.get("head_dim") or 256,
                linear_layers=[i for i, k in enumerate(kinds) if k == "linear_attention"],
                linear_num_key_heads=hf.get("linear_num_key_heads", 16),
                linear_num_value_heads=hf.get("linear_num_value_heads", 32),
                linear_key_head_dim=hf.get("linear_key_head_dim", 128),
                linear_value_head_dim=hf.get("linear_value_head_dim", 128),
                linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4))


def write_hybrid(cfg) -> dict:
    return dict(attention_bias=cfg.qkv_bias, partial_rotary_factor=cfg.partial_rotary_factor,
                layer_types=["linear_attention" if i in cfg.linear_layers else "full_attention"
                             for i in range(cfg.num_layers)],
                linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
                linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
                linear_conv_kernel_dim=cfg.linear_conv_kernel_dim)


def read(hf: dict) -> dict:
    return read_hybrid(hf) | moe.read_moe(hf) | dict(
        num_experts=hf.get("num_experts", 512), moe_intermediate_size=hf.get("moe_intermediate_size", 512),
        num_experts_per_tok=hf.get("num_experts_per_tok", 10), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 512))


def write(cfg) -> dict:
    return write_hybrid(cfg) | dict(**moe.write_moe(cfg),
                                    shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)


# Published checkpoints carry a multi-token-prediction head as `mtp.*`, which transformers' model skips too.
MTP = Ignored(lambda cfg, name: name.startswith("mtp."),
              lambda cfg: "multi-token prediction: a checkpoint's mtp.* tensors are skipped on load (the MTP head "
                          "is not trained or saved)")


FAMILY = Family("qwen3_next", "Qwen3NextForCausalLM", read, write, mlp=moe.sparse_mlp_shared,
                decoder_layer=HybridLayer, unsupported=DROPOUT, norm=GemmaRMSNorm,
                from_checkpoint=moe.expert_from_checkpoint, to_checkpoint=moe.expert_to_checkpoint, ignored=MTP)

"""The decoder's modules as the rollout engine runs them on the "triton" side of the kernel seam.

`swap(model)` changes the classes of the engine's own copy of the model in place (parameters, names and state
dict stay: weight syncs and LoRA adapters work as before), as twinplane.rollout.packed does for the CPU GEMMs. Each
variant runs its kernels on the paged (engine) path without autograd, and the torch forward otherwise. Per layer
the decode runs: RMSNorm; the q/k/v GEMMs; rope + KV write; paged attention; o_proj; residual add + RMSNorm; the
gate/up GEMMs; SiLU * up; down_proj; residual add.
"""

from __future__ import annotations

import torch
from torch import nn

from twinplane.model.transformer import MLP, Attention, DecoderLayer, RMSNorm
from twinplane.rollout.kernels.activation import silu_mul
from twinplane.rollout.kernels.norm import rms_norm
from twinplane.rollout.kernels.rope import rope_write
from twinplane.rollout.paged_attention import paged_attention


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps)


class TritonMLP(MLP):
    def forward(self, x, routing=None):
        if torch.is_grad_enabled():
            return super().forward(x, routing)
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class TritonAttention(Attention):
    def forward(self, x, cos, sin, meta):
        p = meta.paged
        if p is None or torch.is_grad_enabled():
            return super().forward(x, cos, sin, meta)
        B, T, _ = x.shape  # the paged row: B == 1
        q, k, v = self.project(x)  # [1, T, H, hd], [1, T, H_kv, hd] x 2
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_write(q[0], k[0], v[0], cos[0, 0], sin[0, 0], p.k_cache[self.layer], p.v_cache[self.layer],
                          p.slot_mapping)  # [T, H, hd], [T, H_kv, hd]; k and v are in the pool now
        y = paged_attention(*(t.transpose(0, 1)[None] for t in (q, k, v[0])), meta, self.layer, write=False)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class TritonDecoderLayer(DecoderLayer):
    def block(self, x, cos, sin, meta, routing=None):
        if torch.is_grad_enabled():
            return super().block(x, cos, sin, meta, routing)
        norm = self.post_attention_layernorm
        h, x = rms_norm(self.self_attn(self.input_layernorm(x), cos, sin, meta), norm.weight, norm.eps, residual=x)
        return x + self.mlp(h, routing)


SWAPS: dict[type[nn.Module], type[nn.Module]] = {RMSNorm: TritonRMSNorm, MLP: TritonMLP, Attention: TritonAttention,
                                                  DecoderLayer: TritonDecoderLayer}


def swap(model: nn.Module) -> int:
    """Make `model`'s plain modules their Triton variants, in place; returns how many changed."""
    count = 0
    for m in model.modules():
        cls = SWAPS.get(type(m))
        if cls is not None:
            m.__class__ = cls
            count += 1
    return count

"""The decoder's modules as the rollout engine runs them on the "triton" side of the kernel seam.

`swap_in_triton_layers(model)` changes the classes of the engine's own copy of the model in place (parameters, names
and state dict stay: weight syncs and LoRA adapters work as before), as twinplane.rollout.prepacked does for the CPU
GEMMs. q/k/v and gate/up become one stacked weight each (`stack`), the per-projection parameters views into it, so a
weight load in place lands in the stack. Each variant runs its kernels on the paged (engine) path without
autograd, and the torch forward otherwise. Per layer the decode runs: RMSNorm; the q/k/v GEMM; rope + KV write;
paged attention; o_proj; residual add + RMSNorm; the gate/up GEMM; SiLU * up; down_proj with the residual add in
its GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.blocks import MLP, Attention, RMSNorm
from twinplane.model.layer import DecoderLayer
from twinplane.rollout.kernels.activation import silu_mul
from twinplane.rollout.kernels.norm import rms_norm
from twinplane.rollout.kernels.rope import rope_write
from twinplane.rollout.paged_attention import paged_attention


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps)


def stack(module: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight [sum of out features, in] (and bias) for `module`'s linears `names`, each linear's parameters
    made views into it; None, changing nothing, where one is not a plain nn.Linear (a LoRA-adapted one keeps its
    own GEMMs) or only some have a bias."""
    linears = [getattr(module, n) for n in names]
    if any(type(m) is not nn.Linear for m in linears) or len({m.bias is None for m in linears}) > 1:
        return None
    w = torch.cat([m.weight.detach() for m in linears])
    b = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(w[start:end], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[start:end], requires_grad=False)
        start = end
    return w, b


class TritonMLP(MLP):
    stacked: tuple[torch.Tensor, torch.Tensor | None] | None = None  # gate/up (`stack`)

    def forward(self, x, routing=None):
        if torch.is_grad_enabled():
            return super().forward(x, routing)
        return self.down_proj(self.gated(x))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up, gate and up from one GEMM's output where they are stacked."""
        if self.stacked is None:
            return silu_mul(self.gate_proj(x), self.up_proj(x))
        return silu_mul(*F.linear(x, *self.stacked).chunk(2, dim=-1))  # (views of the GEMM's output)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + forward(x), the add done by the down projection's GEMM into `residual` (in place: beta = 1),
        one kernel and one pass over the residual stream fewer; a down projection with a bias or adapters adds
        after it."""
        down = self.down_proj
        if type(down) is not nn.Linear or down.bias is not None or not residual.is_contiguous():
            return residual + self(x)
        h = self.gated(x)
        rows = residual.view(-1, residual.shape[-1])
        return rows.addmm_(h.reshape(-1, h.shape[-1]), down.weight.t()).view_as(residual)


class TritonAttention(Attention):
    stacked: tuple[torch.Tensor, torch.Tensor | None] | None = None  # q/k/v (`stack`)

    def forward(self, x, cos, sin, meta):
        p = meta.paged
        if p is None or torch.is_grad_enabled():
            return super().forward(x, cos, sin, meta)
        B, T, _ = x.shape  # the paged row: B == 1
        if self.stacked is None:
            q, k, v = self.project(x)  # [1, T, H, hd], [1, T, H_kv, hd] x 2
        else:  # views of one GEMM's output
            hd, c = self.cfg.head_dim, self.cfg
            q, k, v = (t.unflatten(-1, (-1, hd)) for t in F.linear(x, *self.stacked).split(
                [c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], dim=-1))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_write(q[0], k[0], v[0], cos[0, 0], sin[0, 0], *p.pools(self.layer),
                          p.slot_mapping)  # [T, H, hd], [T, H_kv, hd]; k and v are in the pool now
        y = paged_attention(*(t.transpose(0, 1)[None] for t in (q, k, v[0])), meta, self.layer, write=False)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class TritonDecoderLayer(DecoderLayer):
    def block(self, x, cos, sin, meta, routing=None):
        if torch.is_grad_enabled():
            return super().block(x, cos, sin, meta, routing)
        norm = self.post_attention_layernorm
        h, x = rms_norm(self.self_attn(self.input_layernorm(x), cos, sin, meta), norm.weight, norm.eps, residual=x)
        # (x is the fused norm's own sum: nothing else holds it, so the MLP may add into it)
        return self.mlp.add_to(x, h) if isinstance(self.mlp, TritonMLP) else x + self.mlp(h, routing)


SWAPS: dict[type[nn.Module], type[nn.Module]] = {RMSNorm: TritonRMSNorm, MLP: TritonMLP, Attention: TritonAttention,
                                                  DecoderLayer: TritonDecoderLayer}


def swap_in_triton_layers(model: nn.Module) -> int:
    """Make `model`'s plain modules their Triton variants, in place; returns how many changed."""
    count = 0
    for m in model.modules():
        cls = SWAPS.get(type(m))
        if cls is TritonAttention and m.cfg.rotary_dim != m.cfg.head_dim:
            continue  # (rope_write ropes whole heads: partial rotary stays on the portable path)
        if cls is not None:
            m.__class__ = cls
            count += 1
            if cls is TritonAttention:
                m.stacked = stack(m, ("q_proj", "k_proj", "v_proj"))
            elif cls is TritonMLP:
                m.stacked = stack(m, ("gate_proj", "up_proj"))
    return count

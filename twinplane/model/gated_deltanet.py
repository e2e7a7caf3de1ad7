"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next (transformers' Qwen3NextGatedDeltaNet, same
parameter names): q, k, v, the output gate z, the write strength b and the decay input a projected from the layer's
input; q/k/v through a causal depthwise convolution (with SiLU), mixed by the gated delta rule
(twinplane.model.deltanet), then an RMSNorm gated by SiLU(z) per head and the output projection.

Where a sequence's tokens come from is the `AttentionMetadata`'s business, as for attention:
- dense [B, T]: rows mixed whole; padding zeroed first, as transformers does, so that it never enters the state
  (left padding leaves it zero, right padding comes after every real token);
- packed (varlen): every sequence starts from a zero state and a zero convolution history; a sequence that
  continues another one (`prefix`, a shared prompt) starts from that one's final state instead;
- paged (the rollout engine): each sequence's convolution history and delta-rule state live in the engine's state
  pool (`meta.paged.states`, twinplane.rollout.recurrent_state) and carry over between steps; one-token decodes run
  the recurrent form, prefill chunks the chunked one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model import deltanet

if TYPE_CHECKING:
    from twinplane.model.attention import AttentionMetadata
    from twinplane.model.config import ModelConfig


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times SiLU of the gate in fp32 (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.index = layer, cfg.linear_layers.index(layer)  # index: the engine's state pool's layer
        self.heads_k, self.heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key, value = self.heads_k * self.dk, self.heads * self.dv
        self.conv_dim, self.taps = 2 * key + value, cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.taps, groups=self.conv_dim, bias=False,
                                padding=self.taps - 1)
        self.projections(cfg.hidden_size, key, value)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads).uniform_(1, 16).log())
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value, cfg.hidden_size, bias=False)

    def projections(self, d: int, key: int, value: int) -> None:
        self.in_proj_qkvz = nn.Linear(d, 2 * key + 2 * value, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * self.heads, bias=False)

    def project(self, x: torch.Tensor):
        """x [B, T, d] -> the convolution's input [B, T, C] (q, k, v flattened), z [B, T, H, dv], beta and the
        log decay g [B, T, H]. The projections are grouped per key head (its q, k, then its value heads' v and z;
        its value heads' b, then a), as the checkpoints are."""
        B, T, _ = x.shape
        r = self.heads // self.heads_k
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (self.heads_k, -1))
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = self.in_proj_ba(x).unflatten(-1, (self.heads_k, -1)).split([r, r], -1)
        mixed = torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), -1)
        return mixed, z.reshape(B, T, self.heads, self.dv), *self.gates(b.reshape(B, T, -1), a.reshape(B, T, -1))

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) and the log decay g = -exp(A_log) softplus(a + dt_bias), in fp32 (A may overflow in
        fp16)."""
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        B, T, _ = x.shape
        if meta.paged is None and not meta.varlen and meta.cache.get("valid") is not None:
            x = (x * meta.cache["valid"][..., None]).to(x.dtype)  # padding never enters the state
        mixed, z, beta, g = self.project(x)
        if meta.paged is not None:
            y = self.paged(mixed[0], g[0], beta[0], meta)[None]
        elif meta.varlen:
            y = self.packed(mixed[0], g[0], beta[0], meta)[None]
        else:
            conv = F.silu(F.conv1d(mixed.transpose(1, 2).to(self.conv1d.weight.dtype), self.conv1d.weight,
                                   padding=self.taps - 1, groups=self.conv_dim)[..., :T]).to(mixed.dtype)
            y, _ = deltanet.chunked(*self.split(conv.transpose(1, 2)), g, beta)
        y = self.norm(y, z)
        return self.out_proj(y.flatten(2))

    def split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [..., T, C] -> q, k [..., T, H_k, dk], v [..., T, H, dv]."""
        key = self.heads_k * self.dk
        q, k, v = conv.split([key, key, self.heads * self.dv], -1)
        return q.unflatten(-1, (-1, self.dk)), k.unflatten(-1, (-1, self.dk)), v.unflatten(-1, (-1, self.dv))

    def segments(self, mixed, g, beta, starts: list[int], lens: list[int], conv0: torch.Tensor | None,
                 state0: torch.Tensor | None, recurrent: bool = False):
        """Segments of the row (token starts and lengths) each from its own convolution history conv0
        [S, C, taps - 1] and state state0 [S, H, dk, dv] (None: zeros) -> their outputs [sum(lens), H, dv] in row
        order of the segments, and each one's history and state after its last token. Batched as [S, max(lens)],
        right-padded with neutral tokens (zero input, beta = g = 0: the state passes through unchanged)."""
        S, L, dev = len(lens), max(lens), mixed.device
        if L == 1:
            index, valid = torch.tensor(starts, device=dev)[:, None], None
        else:
            offsets = torch.arange(L, device=dev)
            index = torch.tensor(starts, device=dev)[:, None] + offsets
            valid = offsets < torch.tensor(lens, device=dev)[:, None]  # [S, L]
            index = torch.where(valid, index, 0)
        xs, gs, bs = mixed[index], g[index], beta[index]  # [S, L, ...]
        if valid is not None:
            xs, gs, bs = (t * valid.view(S, L, *[1] * (t.ndim - 2)).to(t.dtype) for t in (xs, gs, bs))
        if conv0 is None:
            conv0 = xs.new_zeros(S, self.conv_dim, self.taps - 1)
        history = torch.cat((conv0.to(xs.dtype), xs.transpose(1, 2)), -1)  # [S, C, taps - 1 + L]
        w = self.conv1d.weight
        conv = F.silu(F.conv1d(history.to(w.dtype), w, groups=self.conv_dim)).to(xs.dtype)  # [S, C, L]
        keep = torch.tensor(lens, device=dev)[:, None] + torch.arange(self.taps - 1, device=dev)  # last taps - 1
        conv1 = history.gather(2, keep[:, None].expand(-1, self.conv_dim, -1))
        rule = deltanet.recurrent if recurrent else deltanet.chunked
        y, state1 = rule(*self.split(conv.transpose(1, 2)), gs, bs, state0)  # [S, L, H, dv]
        return (y.flatten(0, 1) if valid is None else y[valid]), conv1, state1

    def packed(self, mixed, g, beta, meta: AttentionMetadata) -> torch.Tensor:
        """Packed sequences, each from zero state, or from the final state of the one it continues (`prefix`)."""
        cu = meta.offsets()
        starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        parent = meta.prefix or [-1] * len(lens)
        roots = [s for s, p in enumerate(parent) if p < 0]
        children = [s for s, p in enumerate(parent) if p >= 0]
        y = mixed.new_empty(mixed.shape[0], self.heads, self.dv)
        y_roots, conv1, state1 = self.segments(mixed, g, beta, [starts[s] for s in roots], [lens[s] for s in roots],
                                               None, None)
        y[self._rows(cu, roots, y.device)] = y_roots
        if children:
            at = torch.tensor([roots.index(parent[s]) for s in children], device=y.device)
            y_children, _, _ = self.segments(mixed, g, beta, [starts[s] for s in children],
                                             [lens[s] for s in children], conv1[at], state1[at])
            y[self._rows(cu, children, y.device)] = y_children
        return y

    @staticmethod
    def _rows(cu: list[int], segments: list[int], device) -> torch.Tensor | slice:
        if segments == list(range(len(cu) - 1)):
            return slice(None)
        return torch.cat([torch.arange(cu[s], cu[s + 1], device=device) for s in segments])

    def paged(self, mixed, g, beta, meta: AttentionMetadata) -> torch.Tensor:
        """The engine's row: the leading one-token decodes by the recurrent form, the prefill chunks by the chunked
        one, each from and back to its sequence's slot of the state pool."""
        paged = meta.paged
        pool = paged.states
        convs, states, slots = pool.conv[self.index], pool.ssm[self.index], pool.slots
        lens, d = paged.query_lens, paged.num_decodes
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        y = mixed.new_empty(mixed.shape[0], self.heads, self.dv)
        for first, last, recurrent in ((0, d, True), (d, len(lens), False)):
            if first == last:
                continue
            at = slots[first:last]
            out, conv1, state1 = self.segments(mixed, g, beta, starts[first:last], lens[first:last],
                                               convs.index_select(0, at), states.index_select(0, at), recurrent)
            convs.index_copy_(0, at, conv1.to(convs.dtype))
            states.index_copy_(0, at, state1)
            y[starts[first]:starts[last - 1] + lens[last - 1]] = out
        return y


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: the same mixer with its projections apart and unpermuted (`in_proj_qkv` making q,
    k and v as the convolution takes them, `in_proj_z`, `in_proj_b`, `in_proj_a`)."""

    def projections(self, d: int, key: int, value: int) -> None:
        self.in_proj_qkv = nn.Linear(d, 2 * key + value, bias=False)
        self.in_proj_z = nn.Linear(d, value, bias=False)
        self.in_proj_b = nn.Linear(d, self.heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.heads, bias=False)

    def project(self, x: torch.Tensor):
        z = self.in_proj_z(x).unflatten(-1, (self.heads, self.dv))
        return self.in_proj_qkv(x), z, *self.gates(self.in_proj_b(x), self.in_proj_a(x))

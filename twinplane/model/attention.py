"""The attention seam shared by both planes: callers describe their tokens, the model never looks at a batch layout.

The trainer (padded or packed batches) and the rollout engine (KV cache) each build an `AttentionMetadata` for a
forward and pass it to `Transformer(..., meta=...)`; every decoder layer hands its q/k/v and the metadata to
`attention()`, which dispatches on the layout:
- dense: tokens [B, T] with an optional boolean mask [B, 1, T, S] (None = plain causal, the fused SDPA kernel);
- varlen (packed): one row [1, T] holding several sequences back to back, delimited by `cu_seqlens`; each token
  attends causally within its own sequence only. Portable path: SDPA with a block-diagonal causal mask.
Backends for a layout are chosen by the platform module (`meta.backend`); every fast path keeps the portable one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [B, T] rope position of every token of the forward
    mask: torch.Tensor | None = None  # dense layout: [B, 1, T, S] bool (True = may attend); None = causal
    cu_seqlens: torch.Tensor | None = None  # varlen layout (B == 1): [S + 1] int32 sequence starts in the row
    max_seqlen: int = 0  # varlen: longest sequence (what fused varlen kernels size their tiles by)
    window: int | None = None  # sliding-window size (Mistral/Qwen2 configs), None = full causal
    backend: str = "sdpa"  # which kernel runs this layout (decided in twinplane.platform)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @classmethod
    def packed(cls, lengths: Sequence[int], device: torch.device | str = "cpu", window: int | None = None,
               backend: str = "sdpa") -> AttentionMetadata:
        """Metadata for sequences of `lengths` packed into one row: positions restart at 0 for each sequence."""
        lens = torch.as_tensor(list(lengths), dtype=torch.int32)
        if len(lens) == 0 or bool((lens <= 0).any()):
            raise ValueError(f"packed sequence lengths must be positive, got {list(lengths)}")
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        starts = torch.repeat_interleave(cu[:-1].long(), lens.long())
        positions = torch.arange(int(cu[-1])) - starts  # [T]
        return cls(positions[None].to(device), cu_seqlens=cu.to(device), max_seqlen=int(lens.max()), window=window,
                   backend=backend)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, H_kv, S, D] (GQA when H_kv < H) -> [B, H, T, D]."""
    gqa = q.shape[1] != k.shape[1]
    if meta.varlen:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=varlen_mask(meta), enable_gqa=gqa)
    if meta.mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask, enable_gqa=gqa)


def varlen_mask(meta: AttentionMetadata) -> torch.Tensor:
    """Block-diagonal causal mask [1, 1, T, T] from `cu_seqlens` (the portable varlen path)."""
    cu = meta.cu_seqlens.long()
    T = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])  # [T]
    pos = torch.arange(T, device=cu.device)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if meta.window is not None:
        mask &= (pos[:, None] - pos[None, :]) < meta.window
    return mask[None, None]


def build_mask(q_pos, k_pos, k_valid, self_index, window: int | None) -> torch.Tensor:
    """Boolean mask [B, 1, T, S] for padded rows: a query sees valid keys at positions <= its own (within the
    sliding window).

    Each query also sees its own key (`self_index[t]` is its column), so a padding row never has an empty
    row of keys; an all-masked row would make SDPA return NaN, which would leak into the real rows' grads.
    """
    q, k = q_pos[:, :, None], k_pos[:, None, :]  # [B, T, 1], [B, 1, S]
    mask = k_valid[:, None, :] & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    cols = torch.arange(k_pos.shape[1], device=k_pos.device)
    mask |= cols[None, None, :] == self_index[None, :, None]
    return mask[:, None]

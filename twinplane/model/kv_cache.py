"""KV cache for incremental decoding: one preallocated buffer per layer, all rows written in lock-step."""

from __future__ import annotations

import torch


class KVCache:
    """Keys/values [L, B, H_kv, T_max, D]. Rows share a write position because the engine left-pads prompts;
    per-row validity and positions live beside the buffer so the model can build each row's mask."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # key is a real token
        self.positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # rope position of each key
        self.length = 0  # columns written so far

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append_meta(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Record positions/validity [B, T] of the tokens about to be written (called once per forward)."""
        t = positions.shape[1]
        if self.length + t > self.max_len:
            raise RuntimeError(f"KV cache overflow: {self.length + t} > {self.max_len}")
        self.positions[:, self.length:self.length + t] = positions
        self.valid[:, self.length:self.length + t] = valid

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, H_kv, T, D] for `layer` at the current position; return all keys/values so far."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, t: int) -> None:
        self.length += t

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (compaction when sequences finish), so finished rows cost nothing more."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)
        self.valid = self.valid.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)

    def repeat_interleave(self, n: int) -> None:
        """Expand each row n times: prefill a prompt once, then decode n samples from it."""
        self.k = self.k.repeat_interleave(n, dim=1)
        self.v = self.v.repeat_interleave(n, dim=1)
        self.valid = self.valid.repeat_interleave(n, dim=0)
        self.positions = self.positions.repeat_interleave(n, dim=0)

"""The rollout plane's KV cache: one pool of fixed-size blocks per layer, allocated once from a byte budget.

Layout [L, N, block_size, H_kv, D] for keys and for values (latent attention: one pool of [L, N, block_size, 1,
kv_lora_rank + rope dims], read as both, `ModelConfig.kv_layout`): a block is `block_size` consecutive token slots of
one sequence; slot s of the flattened pool is block s // block_size, offset s % block_size. This is the layout
flash-attn's paged kernels read. Which block belongs to whom is twinplane.rollout.block_manager's business.
"""

from __future__ import annotations

import torch

from twinplane.model import ModelConfig
from twinplane.model.memory import kv_bytes_per_token


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys + values of `block_size` tokens across all layers."""
    return int(kv_bytes_per_token(cfg, dtype.itemsize)) * block_size


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        pools, heads, dim = cfg.kv_layout
        shape = (cfg.num_layers, num_blocks, block_size, heads, dim)
        # Zeroed: slots that were never written are read (masked) by the portable path, and must not be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        # latent attention: one pool, the values are the keys' latent part (twinplane.model.mla)
        self.v = torch.zeros(shape, dtype=dtype, device=device) if pools == 2 else self.k

    @property
    def pools(self) -> tuple[torch.Tensor, ...]:
        return (self.k,) if self.v is self.k else (self.k, self.v)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in self.pools)

    def zero_(self) -> None:
        for pool in self.pools:
            pool.zero_()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> dst in every layer."""
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        for pool in self.pools:  # index_select/index_copy_: ~10x faster than advanced indexing on CPU
            pool.index_copy_(1, dst, pool.index_select(1, src))

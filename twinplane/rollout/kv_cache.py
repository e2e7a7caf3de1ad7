"""The rollout plane's KV cache: one pool of fixed-size blocks per attention layer, allocated once from a byte
budget.

Layout [L_kv, N, block_size, H_kv, D] for keys and for values (latent attention: one pool of [L_kv, N, block_size,
1, kv_lora_rank + rope dims], read as both, `ModelConfig.kv_layout`): a block is `block_size` consecutive token slots
of one sequence; slot s of the flattened pool is block s // block_size, offset s % block_size. This is the layout
flash-attn's paged kernels read. L_kv counts the layers that attend: a hybrid's linear-attention layers keep a
per-sequence state instead (twinplane.rollout.recurrent_state), and `index` maps decoder layers to pool layers.
Which block belongs to whom is twinplane.rollout.block_manager's business.
"""

from __future__ import annotations

import torch

from twinplane.errors import InputError
from twinplane.model import ModelConfig
from twinplane.model.memory import kv_bytes_per_token
from twinplane.platform import runtime


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys + values of `block_size` tokens across the attention layers."""
    return int(kv_bytes_per_token(cfg, dtype.itemsize)) * block_size


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        pools, heads, dim = cfg.kv_layout
        attending = cfg.attention_layers
        # decoder layer -> its pool layer (None: every layer attends, the same index)
        self.index = None if len(attending) == cfg.num_layers else tuple(
            attending.index(i) if i in attending else -1 for i in range(cfg.num_layers))
        shape = (len(attending), num_blocks, block_size, heads, dim)
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


def pool_blocks(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, block_size: int, reserved: int,
                kv_cache_bytes: int, gpu_memory_utilization: float, tokens: int, held: int = 0,
                states: int = 0) -> int:
    """Blocks of `block_size` tokens the KV budget holds beside `reserved` ones and `states` bytes of recurrent
    states (a hybrid's linear-attention layers, `memory.state_bytes_per_sequence` x the sequences at once; `held`:
    bytes of the engine's kept pool and states, `runtime.kv_cache_budget`); an InputError when that is less than
    one sequence of `tokens` tokens needs, which no preemption can help. Every `generate` checks its longest
    sequence here, and `twinplane train` the config's before loading anything (`preflight.check_kv_budget`)."""
    per_block = bytes_per_block(cfg, block_size, dtype)
    budget = runtime.kv_cache_budget(device, kv_cache_bytes, gpu_memory_utilization, held)
    usable, need = (budget - states) // per_block - reserved, -(-tokens // block_size)
    if usable < need:
        key = "rollout.kv_cache_gb" if kv_cache_bytes or device.type == "cpu" else \
            "rollout.gpu_memory_utilization (or set rollout.kv_cache_gb)"
        beside = f" beside {states / 2**30:.4g} GiB of recurrent states" if states else ""
        raise InputError(f"KV cache: a budget of {budget / 2**30:.4g} GiB holds {max(usable, 0)} blocks of "
                         f"{block_size} tokens ({per_block} bytes each){beside}; one sequence of {tokens} tokens "
                         f"needs {need}: raise {key}{' or lower rollout.max_num_seqs' if states else ''}")
    return usable

"""The rollout engine's per-sequence recurrent states, for models with linear-attention layers (Qwen3-Next's Gated
DeltaNet): what the KV cache is to attention layers, one fixed-size state per sequence instead of k/v per token.

Pools [L_linear, N, ...]: each linear layer's convolution history (the last `taps - 1` inputs, in the model's dtype)
and delta-rule state ([H, d_k, d_v], fp32 as the rule computes it), slot s of every pool holding one sequence's.
A sequence takes a zeroed slot when it starts from its first token (admitted, or recomputed after a preemption:
its blocks and its slot are released together, and its tokens are prefilled again), keeps it across prefill chunks
and decodes, and gives it back when its blocks are released (finished, preempted, requeued). The n samples of a
prompt share its slot after the fork, as they share its blocks; the first write of a shared slot copies it
(copy-on-write), so every sample goes on from the prompt's state. The pools grow (doubling) when every slot is
taken; the layers read them through `PagedKV.states` at each forward.
"""

from __future__ import annotations

from collections import deque

import torch

from twinplane.model import ModelConfig
from twinplane.rollout.block_manager import BlockManager
from twinplane.rollout.sequence import Sequence


class RecurrentStates:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, slots: int = 8):
        L = len(cfg.linear_layers)
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self.conv = torch.zeros(L, slots, channels, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(L, slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                               cfg.linear_value_head_dim, dtype=torch.float32, device=device)
        self.reset()

    def reset(self) -> None:
        """Every slot free (a new `generate` call)."""
        self.ref = [0] * self.num_slots
        self.free: deque[int] = deque(range(self.num_slots))
        self.slots: torch.Tensor | None = None  # the scheduled sequences' slots, in the forward's order

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def _take(self) -> int:
        if not self.free:  # grow: twice the slots, the states held kept where they are
            n = self.num_slots
            self.conv = torch.cat((self.conv, torch.zeros_like(self.conv)), 1)
            self.ssm = torch.cat((self.ssm, torch.zeros_like(self.ssm)), 1)
            self.ref += [0] * n
            self.free.extend(range(n, 2 * n))
        slot = self.free.popleft()
        self.ref[slot] = 1
        return slot

    def _drop(self, slot: int) -> None:
        self.ref[slot] -= 1
        if self.ref[slot] == 0:
            self.free.append(slot)

    def prepare(self, seqs: list[Sequence], fresh: list[bool]) -> None:
        """Give each of this forward's sequences a slot it holds alone: a zeroed one where it starts from its first
        token (`fresh`), a copy where its slot is shared (the samples of one prompt); then `slots` says which."""
        zero, copies = [], []
        for seq, new in zip(seqs, fresh, strict=True):
            slot = seq.state_slot
            if new or slot is None:
                if slot is not None:
                    self._drop(slot)
                seq.state_slot = self._take()
                zero.append(seq.state_slot)
            elif self.ref[slot] > 1:
                self._drop(slot)
                seq.state_slot = self._take()
                copies.append((slot, seq.state_slot))
        dev = self.conv.device
        if zero:
            at = torch.tensor(zero, device=dev)
            self.conv.index_fill_(1, at, 0)
            self.ssm.index_fill_(1, at, 0)
        if copies:
            src, dst = (torch.tensor(x, device=dev) for x in zip(*copies, strict=True))
            for pool in (self.conv, self.ssm):
                pool.index_copy_(1, dst, pool.index_select(1, src))
        self.slots = torch.tensor([s.state_slot for s in seqs], device=dev)

    def share(self, seq: Sequence, times: int) -> None:
        if seq.state_slot is not None:
            self.ref[seq.state_slot] += times

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self._drop(seq.state_slot)
            seq.state_slot = None


class StateBlocks(BlockManager):
    """The block manager of a model with recurrent states: a sequence's slot is shared and released with its
    blocks (the scheduler's preemptions, the fork of a prompt's samples, a sequence's end)."""

    def __init__(self, num_blocks: int, block_size: int, states: RecurrentStates):
        super().__init__(num_blocks, block_size)
        self.states = states

    def share(self, seq: Sequence, times: int) -> None:
        super().share(seq, times)
        self.states.share(seq, times)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.states.release(seq)

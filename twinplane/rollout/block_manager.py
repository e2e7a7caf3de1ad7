"""Block accounting for the paged KV cache: a free list and reference counts, no tensors.

Sequences own lists of block ids (their block tables). The n samples of a prompt share every block of the
prefilled prompt (reference count n); a sample about to write into a shared, partly filled last block first gets
a private copy of it (copy-on-write), so a shared block is never altered. Full blocks are never written again.
"""

from __future__ import annotations

from collections import deque

from twinplane.rollout.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def _shared_tail(self, seq: Sequence) -> bool:
        """The next write lands in a partly filled block that other sequences also hold."""
        return seq.num_computed % self.block_size != 0 and self.ref[seq.block_table[-1]] > 1

    def has_slot(self, seq: Sequence) -> bool:
        """The next token's slot is in a block `seq` already holds alone: appending it needs no allocation. (Asked of
        every running sequence in every step, hence `_shared_tail` spelled out.)"""
        n, table = seq.num_computed, seq.block_table
        return n < len(table) * self.block_size and (n % self.block_size == 0 or self.ref[table[-1]] == 1)

    def room(self, seq: Sequence) -> int:
        """Tokens `seq` can append to the pool with the blocks free now."""
        slack = len(seq.block_table) * self.block_size - seq.num_computed
        if self._shared_tail(seq):  # the copy takes a block and gives back the same free offsets
            return max(self.num_free * self.block_size - (self.block_size - slack), 0)
        return self.num_free * self.block_size + slack

    def allocate(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_tokens` more k/v of `seq` (call only when `room(seq) >= num_tokens`). Returns the
        (source, destination) block copies the pool must make first (copy-on-write)."""
        copies = []
        if self._shared_tail(seq):
            src, dst = seq.block_table[-1], self.free.popleft()
            self.ref[src] -= 1
            self.ref[dst] = 1
            seq.block_table[-1] = dst
            copies.append((src, dst))
        need = -(-(seq.num_computed + num_tokens) // self.block_size) - len(seq.block_table)
        for _ in range(need):
            b = self.free.popleft()
            self.ref[b] = 1
            seq.block_table.append(b)
        return copies

    def share(self, seq: Sequence, times: int) -> None:
        """`times` more sequences now hold `seq`'s blocks (the fork of a prefilled prompt)."""
        for b in seq.block_table:
            self.ref[b] += times

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; blocks nobody holds return to the pool."""
        for b in seq.block_table:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        seq.block_table = []
        seq.num_computed = 0

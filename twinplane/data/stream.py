"""Training prompts in seeded shuffled epochs, with a cursor a checkpoint can save and restore.

Each epoch's order is a function of (seed, epoch) alone, so the whole cursor is three integers: nothing about
the order is stored, and restoring (seed, epoch, position) continues exactly where the uninterrupted run would.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class PromptStream(Generic[T]):
    """Items in seeded shuffled epochs; every item appears once per epoch, and batches cross epoch boundaries."""

    def __init__(self, items: Sequence[T], seed: int):
        if not items:
            raise ValueError("PromptStream needs at least one item")
        self.items, self.seed = list(items), seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def __len__(self) -> int:
        return len(self.items)

    def _shuffle(self) -> list[int]:
        # Same mixing as the original arithmetic-task stream, so existing seeded runs keep their prompt order.
        order = list(range(len(self.items)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, k: int) -> list[T]:
        """The next `k` items; when an epoch runs out the next one starts, reshuffled, mid-batch."""
        if k < 0:
            raise ValueError(f"batch size must be >= 0, got {k}")
        out = []
        while len(out) < k:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.items[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The cursor: items consumed in the current epoch, the epoch, the shuffle seed, and the dataset size
        (kept only to catch a resume against a different dataset)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a cursor from `state_dict()`; the saved seed replaces this stream's, so the order continues."""
        missing = [k for k in ("epoch", "position", "seed") if k not in state]
        if missing:
            raise ValueError(f"prompt stream state lacks {', '.join(missing)} (got keys: {', '.join(state)})")
        epoch, position, seed = state["epoch"], state["position"], state["seed"]
        for name, v in (("epoch", epoch), ("position", position), ("seed", seed)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"prompt stream state {name} must be an integer, got {v!r}")
        if epoch < 0 or position < 0:
            raise ValueError(f"prompt stream state has a negative cursor (epoch={epoch}, position={position})")
        size = state.get("size")
        if size is not None and size != len(self.items):
            raise ValueError(f"prompt stream state was saved for {size} prompts but the dataset has "
                             f"{len(self.items)}; resume with the same data files and options")
        if position > len(self.items):
            raise ValueError(f"prompt stream state position {position} is beyond the dataset size {len(self.items)}")
        self.seed, self.epoch, self.position = seed, epoch, position
        self._order = self._shuffle()

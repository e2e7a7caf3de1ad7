"""Reward functions: (completions, reference answers) -> one float per completion, computed by a verifier.

Rewards never come from the policy's own outputs or labels: the reference answer is the task's ground truth.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

RewardFn = Callable[[Sequence[str], Sequence[str]], list[float]]

_INT = re.compile(r"[+-]?\d+")


def exact_int(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 when the whole completion (whitespace stripped) is an integer equal to the answer, else 0.0."""
    out = []
    for c, a in zip(completions, answers, strict=True):
        c = c.strip()
        out.append(1.0 if _INT.fullmatch(c) and int(c) == int(a) else 0.0)
    return out


REWARDS: dict[str, RewardFn] = {"exact_int": exact_int}


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r} (available: {', '.join(REWARDS)})")
    return REWARDS[name]

"""The embedded demo task: integer addition, with an imperfect teacher for the supervised warm start.

Problems are `a+b=` with 0 <= a, b < 10**digits; the answer is the decimal sum. All pairs are enumerated,
shuffled with the seed, and split: the first `heldout_size` are never used for training (neither warm start
nor RL), the rest are the training split. The warm-start teacher writes the sum digit by digit and drops each
carry with probability `carry_error`, so imitation alone learns to (mostly) forget carries; RL with an
exact-match verifier on training prompts has to fix that, and the held-out accuracy measures whether it did.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ALPHABET = "0123456789+="


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def teacher_answer(a: int, b: int, rng: random.Random, carry_error: float) -> str:
    """Schoolbook addition that forgets each carry with probability `carry_error`."""
    digits, carry = [], 0
    while a or b or carry:
        s = a % 10 + b % 10 + carry
        digits.append(s % 10)
        carry = s // 10
        if carry and rng.random() < carry_error:
            carry = 0
        a, b = a // 10, b // 10
    return "".join(map(str, reversed(digits))) or "0"


class ArithmeticTask:
    def __init__(self, digits: int, heldout_size: int, seed: int):
        self.digits = digits
        n = 10**digits
        pairs = [(a, b) for a in range(n) for b in range(n)]
        random.Random(seed).shuffle(pairs)
        if heldout_size >= len(pairs):
            raise ValueError(f"task.heldout_size={heldout_size} leaves no training problems ({len(pairs)} in all)")
        self.heldout_pairs, self.train_pairs = pairs[:heldout_size], pairs[heldout_size:]

    def prompt(self, a: int, b: int) -> str:
        d = self.digits
        return f"{a:0{d}d}+{b:0{d}d}="

    def problem(self, a: int, b: int) -> Problem:
        return Problem(self.prompt(a, b), f"{a + b:0{self.digits + 1}d}")

    def heldout(self) -> list[Problem]:
        return [self.problem(a, b) for a, b in self.heldout_pairs]

    def train_problems(self) -> list[Problem]:
        return [self.problem(a, b) for a, b in self.train_pairs]

    def carry_free(self, size: int, seed: int) -> list[Problem]:
        """Up to `size` training problems whose sum has no carry: the teacher answers them exactly, so a model that
        has learned to imitate it gets them right (the warm start's progress check)."""
        def no_carry(a: int, b: int) -> bool:
            return all(a // 10**i % 10 + b // 10**i % 10 < 10 for i in range(self.digits))
        pairs = [p for p in self.train_pairs if no_carry(*p)]
        return [self.problem(a, b) for a, b in random.Random(seed).sample(pairs, min(size, len(pairs)))]

    def teacher_data(self, size: int, carry_error: float, seed: int) -> list[tuple[str, str]]:
        """`size` (prompt, teacher answer) pairs drawn from the training split."""
        rng = random.Random(seed)
        out = []
        for _ in range(size):
            a, b = rng.choice(self.train_pairs)
            out.append((self.prompt(a, b), teacher_answer(a, b, rng, carry_error).zfill(self.digits + 1)))
        return out


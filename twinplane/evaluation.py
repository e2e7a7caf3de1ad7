"""Held-out evaluation through the rollout engine (greedy by default)."""

from __future__ import annotations

from collections.abc import Sequence

from twinplane.rewards import RewardFn
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.tasks import Problem
from twinplane.tokenizer import Tokenizer


def evaluate(engine: RolloutEngine, tokenizer: Tokenizer, problems: Sequence[Problem], reward_fn: RewardFn,
             max_new_tokens: int) -> dict[str, float]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    samples = engine.generate([tokenizer.encode(p.prompt) for p in problems], sp)
    rewards = reward_fn(tokenizer.batch_decode([s.token_ids for s in samples]), [p.answer for p in problems])
    return {
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "response_length": sum(len(s.token_ids) for s in samples) / len(samples),
        "truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }

"""Tokenised prompts: what the controller and the evaluator hand to the rollout plane."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from twinplane.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # token ids fed to the engine
    answer: str  # reference answer for the verifier
    text: str  # the formatted prompt (for reward models and logs)


def encode_prompts(items: Sequence, format_fn: Callable[[object], str], tokenizer: Tokenizer,
                   max_prompt_tokens: int) -> tuple[list[Prompt], int]:
    """Format and tokenise records (anything with `.answer`); prompts longer than `max_prompt_tokens` are
    dropped and counted, never truncated (a truncated question has a different answer)."""
    out, dropped = [], 0
    for item in items:
        text = format_fn(item)
        ids = tokenizer.encode(text)
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        out.append(Prompt(ids, item.answer, text))
    return out, dropped

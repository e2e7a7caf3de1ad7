"""Tokenised prompts: what the controller and the evaluator hand to the rollout plane."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from twinplane.data.formatting import filter_by_length
from twinplane.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # token ids fed to the engine
    answer: str  # reference answer for the verifier
    text: str  # the formatted prompt (for reward models and logs)


def encode_prompts(items: Sequence, format_fn: Callable[[object], str], tokenizer: Tokenizer,
                   max_prompt_tokens: int) -> tuple[list[Prompt], int]:
    """Format and tokenise records (anything with `.answer`); prompts longer than `max_prompt_tokens` are
    dropped and counted (`filter_by_length`), never truncated."""
    texts = [format_fn(item) for item in items]
    ids = [tokenizer.encode(t) for t in texts]
    kept, dropped = filter_by_length(ids, max_prompt_tokens)
    return [Prompt(ids[i], items[i].answer, texts[i]) for i in kept], dropped

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
    row: dict | None = None  # the data row (prompt, answer, system, meta fields): an agent's task

    @property
    def task(self) -> dict:
        """What an agent's episode gets: the data row, or the prompt's text and answer."""
        return dict(self.row) if self.row is not None else {"prompt": self.text, "answer": self.answer}


def encode_prompts(items: Sequence, format_fn: Callable[[object], str], tokenizer: Tokenizer,
                   max_prompt_tokens: int) -> tuple[list[Prompt], int]:
    """Format and tokenise records (anything with `.answer`); prompts longer than `max_prompt_tokens` are
    dropped and counted (`filter_by_length`), never truncated."""
    texts = [format_fn(item) for item in items]
    ids = [tokenizer.encode(t) for t in texts]
    kept, dropped = filter_by_length(ids, max_prompt_tokens)
    return [Prompt(ids[i], items[i].answer, texts[i], task_row(items[i])) for i in kept], dropped


def task_row(record) -> dict:
    """A record as an agent's task: its prompt (a string, or the chat's messages) and answer, its system prompt
    when it has one, and its meta fields."""
    row = {"prompt": record.prompt, "answer": record.answer}
    if getattr(record, "system", None) is not None:
        row["system"] = record.system
    return row | dict(getattr(record, "meta", None) or {})

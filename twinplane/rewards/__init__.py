"""Verifiable rewards: (completions, reference answers) -> one float per completion.

- `score(name, completions, answers, **options)`: direct, in this process (tests, quick checks);
- `RewardRunner`: what a training run uses; bad samples score 0 and are counted, and slow or untrusted
  functions run in a killable worker process;
- names: gsm8k, math, exact_match, exact_int, code (unit tests in the sandbox, `code.py`), or a user
  function `module:function` / `path/to/file.py:function` (per-sample `f(completion, answer, **options) ->
  float`, or batched `f(completions, answers, **options) -> list[float]` with `batched=True`).
`twinplane.rewards.reward_model.RewardModel` adds a learned reward from a local classifier checkpoint.
"""

from twinplane.rewards.registry import RewardFn, get_reward, load_user_fn, resolve, score, to_reward
from twinplane.rewards.runner import RewardRunner, Scorer
from twinplane.rewards.verifiers import VERIFIERS, exact_int, format_ok, last_boxed

REWARDS = VERIFIERS  # name -> per-sample built-in verifier

__all__ = ["REWARDS", "RewardFn", "RewardRunner", "Scorer", "exact_int", "format_ok", "get_reward", "last_boxed",
           "load_user_fn", "resolve", "score", "to_reward"]

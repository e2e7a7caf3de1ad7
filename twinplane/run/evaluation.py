"""Evaluation through the rollout plane: greedy accuracy, and pass@k / mean@k for sampled decoding."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

from twinplane.data.prompts import Prompt
from twinplane.rewards import Scorer
from twinplane.rollout import SamplingParams
from twinplane.tokenizer import Tokenizer


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [k for k in (2**i for i in range(n.bit_length())) if k <= n]
    return ks if ks[-1] == n else ks + [n]


def evaluate(rollout, tokenizer: Tokenizer, prompts: Sequence[Prompt], scorer: Scorer, max_new_tokens: int,
             n: int = 1, temperature: float = 0.0, seed: int = 0) -> dict[str, float]:
    """Greedy accuracy always; with n > 1 also `n` samples at `temperature` for pass@k and mean@k.

    A sample counts as correct when the verifier scores it >= 1 (format or reward-model bonuses never count).
    `rollout` is anything with `generate(prompt_ids, SamplingParams)` (the engine, or the multi-turn driver).
    """
    out = _run(rollout, tokenizer, prompts, scorer, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    result = {"accuracy": sum(sum(c) for c in out["correct"]) / len(prompts),
              "response_length": out["length"], "truncated": out["truncated"], "reward_errors": out["errors"]}
    if n > 1:
        sp = SamplingParams(temperature=temperature or 1.0, max_new_tokens=max_new_tokens, n=n, seed=seed)
        s = _run(rollout, tokenizer, prompts, scorer, sp)
        for k in k_values(n):
            result[f"pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in s["correct"]) / len(prompts)
        result[f"mean@{n}"] = sum(sum(c) / n for c in s["correct"]) / len(prompts)
        result["sampled_response_length"] = s["length"]
        result["sampled_truncated"] = s["truncated"]
    return result


def _run(rollout, tokenizer, prompts, scorer, sp: SamplingParams) -> dict:
    samples = rollout.generate([p.ids for p in prompts], sp)
    completions = tokenizer.batch_decode([s.token_ids for s in samples])
    _, metrics = scorer(completions, [prompts[s.request_index].answer for s in samples],
                        [prompts[s.request_index].text for s in samples])
    correct = [[False] * sp.n for _ in prompts]
    for j, (s, r) in enumerate(zip(samples, scorer.last_verifier, strict=True)):
        correct[s.request_index][j % sp.n] = r >= 1.0
    return {"correct": correct, "length": sum(len(s.token_ids) for s in samples) / len(samples),
            "truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "errors": metrics.get("reward/errors", 0.0)}

"""pass@k against brute-force enumeration; the evaluator's counting on a scripted rollout."""

from itertools import combinations

import pytest

from twinplane.data.prompts import Prompt
from twinplane.rollout import Sample
from twinplane.run.evaluation import evaluate, k_values, pass_at_k


@pytest.mark.parametrize("n, c", [(5, 0), (5, 1), (6, 3), (8, 8), (10, 2)])
def test_pass_at_k_equals_brute_force(n, c):
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_k_values():
    assert k_values(1) == [1] and k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6]


class ScriptedRollout:
    """Answers prompt i with "i" when greedy; with sampling, sample j of prompt i says "i" only for j < i."""

    def generate(self, prompts, sp):
        out = []
        for i, _ in enumerate(prompts):
            for j in range(sp.n):
                right = sp.temperature == 0 or j < i
                tokens = [ord(c) for c in (str(i) if right else "x")]
                out.append(Sample(i, [0], tokens, [0.0] * len(tokens), "stop", 0))
        return out


class CharTok:
    def batch_decode(self, batch):
        return ["".join(map(chr, ids)) for ids in batch]


def test_evaluate_counts():
    prompts = [Prompt([0], str(i), f"q{i}") for i in range(4)]

    class Scorer:
        def __call__(self, completions, answers, texts):
            self.last_verifier = [float(c == a) for c, a in zip(completions, answers, strict=True)]
            return [v + 0.5 for v in self.last_verifier], {"reward/errors": 0.0}  # a bonus must not count

    r = evaluate(ScriptedRollout(), CharTok(), prompts, Scorer(), max_new_tokens=4, n=4, temperature=1.0)
    assert r["accuracy"] == 1.0 and r["truncated"] == 0.0
    # prompt i has i correct of 4 samples
    assert r["mean@4"] == pytest.approx(sum(i / 4 for i in range(4)) / 4)
    assert r["pass@1"] == pytest.approx(r["mean@4"])
    assert r["pass@4"] == pytest.approx(3 / 4)
    assert r["pass@2"] == pytest.approx(sum(pass_at_k(4, i, 2) for i in range(4)) / 4)

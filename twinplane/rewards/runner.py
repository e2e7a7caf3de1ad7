"""RewardRunner: score a batch of completions so that no reward function can stop or hang the RL run.

A sample whose function raises, returns None/NaN/inf/a non-number, crashes its process or runs past
`timeout_s` scores 0 and counts in `reward/errors` (timeouts also in `reward/timeouts`); the rest of the
batch keeps its real scores. Cheap built-ins (gsm8k, exact_match, exact_int) run in this process under a
try/except. User functions and `math` (sympy can run unboundedly) run in a worker process, because only a
process can be killed: the worker scores one sample at a time and streams each result back, so when a
sample hangs the runner kills the worker, scores that sample 0, starts a new worker and resumes after it.
`code` runs model-written programs, so they go to the sandbox (`code.py`), called from this process.

The worker (see `worker.py`) is a fresh interpreter that imports the reward code only (not torch): starting one
costs a fraction of a second, once per run and again after each timeout or crash.

`step_timeout_s` bounds a whole call (one RL step's scoring): when it passes, every sample without a result
scores 0 and counts in `reward/timeouts` and `reward/deadline`, and the worker is replaced once, not once per
sample, so a function that always hangs costs about one deadline per step, not `timeout_s` per sample.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Sequence
from typing import Protocol

from twinplane.rewards.code import CodeScorer, code_metrics
from twinplane.rewards.judge import FAILED as JUDGE_FAILED
from twinplane.rewards.judge import JudgeSettings
from twinplane.rewards.registry import absolute_spec, is_user_spec, precheck_user_spec, resolve
from twinplane.rewards.verifiers import CHEAP, VERIFIERS, format_ok
from twinplane.rewards.worker import Result, Worker, score_one

log = logging.getLogger(__name__)


class Scorer(Protocol):
    """What the controller and evaluation need of a scorer (a `RewardRunner`): (completions, answers, prompts) ->
    (rewards, metrics), and the verifier's own scores of that call (no format or reward-model bonus), which decide
    correctness."""

    last_verifier: list[float]

    def __call__(self, completions: Sequence[str], answers: Sequence[str],
                 prompts: Sequence[str] | None = None) -> tuple[list[float], dict[str, float]]: ...


class RewardRunner:
    """`rewards, metrics = runner(completions, answers, prompts)`: one reward per completion, never raising for
    a bad sample. reward = verifier + format_weight * format_ok + reward_model_weight * reward model score;
    a sample whose verifier failed scores 0 outright.

    name: gsm8k | math | exact_match | exact_int | code | module:function | path/to/file.py:function.
    options: keywords for the function (e.g. {"mode": "strict"}); `batched: True` calls a user function on the
        whole lists (also when the function has `batched = True`).
    timeout_s: how long one sample may take (per-sample functions), or the whole call (batched ones).
    reward_model: a local sequence-classification checkpoint folder, scored on prompt + completion.
    sandbox, partial: for `code` (unit tests run in `twinplane.sandbox`; partial = fraction of tests passed).
        A failing program is a real 0, not an error: its kind is counted in reward/code_* (see `code_metrics`).

    metrics: reward/errors (samples scored 0 because their reward failed, timeouts included), reward/timeouts
    (worker-run rewards only), reward/format (mean format_ok, gsm8k/math only), reward/model (mean model score),
    reward/judge_failures (with a judge: samples whose judgement failed, see `judge.py`).
    `last_verifier` keeps the latest call's verifier scores alone, for accuracy that bonuses cannot inflate.

    Config errors (unknown name, unimportable function, options it does not take) raise ValueError here, at
    construction. Not thread-safe. `close()` (or `with`) stops the worker; it is also stopped at exit.
    """

    def __init__(self, name: str, options: dict | None = None, timeout_s: float = 10.0, format_weight: float = 0.0,
                 reward_model: str | None = None, reward_model_weight: float = 1.0, step_timeout_s: float = 0.0,
                 sandbox: str = "bwrap", partial: bool = False, judge: JudgeSettings | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.step_timeout_s = float(step_timeout_s)  # 0 = no deadline for a whole call
        self.name, self.options = absolute_spec(name), dict(options or {})
        self.judge = judge
        if judge is not None:  # (the worker builds the client: a function that takes `judge` gets it)
            self.options["judge"] = judge.to_dict()
        self.timeout_s, self.format_weight = float(timeout_s), float(self.options.pop("format_weight", format_weight))
        self.reward_model_weight = reward_model_weight
        self.has_format = format_ok(self.name, "") is not None
        self.last_error: str | None = None  # first failure message of the latest call, for logs
        self.last_verifier: list[float] = []  # the latest call's verifier scores alone (no format, no model)
        self.owned: list = []  # what `close` also stops: functions to call
        self._closed = False
        self._worker: Worker | None = None
        self._code: CodeScorer | None = None
        if self.name == "code":  # untrusted programs: isolated by the sandbox, so scored from this process
            kwargs = {"partial": partial, "timeout_s": self.timeout_s, **self.options}
            try:
                self._code = CodeScorer(sandbox, **kwargs)
            except TypeError as e:
                raise ValueError(f"reward 'code': options {sorted(self.options)} do not fit ({e})") from None
        elif self.name in CHEAP:
            self._fn, _, self._kwargs = resolve(self.name, self.options)
        else:
            if is_user_spec(self.name):
                precheck_user_spec(self.name)
            elif self.name not in VERIFIERS:
                resolve(self.name, self.options)  # raises the unknown-name error here, not in the worker
            self._worker = Worker(self.name, self.options)
            self._worker.start()
            self._finalizer = weakref.finalize(self, self._worker.close)
        self.reward_model = None
        if reward_model is not None:
            from twinplane.rewards.reward_model import RewardModel  # torch model: only when asked for

            self.reward_model = RewardModel(reward_model)

    def __call__(self, completions: Sequence[str], answers: Sequence[str],
                 prompts: Sequence[str] | None = None) -> tuple[list[float], dict[str, float]]:
        n = len(completions)
        if len(answers) != n or (prompts is not None and len(prompts) != n):
            raise ValueError(f"{n} completions, {len(answers)} answers, {len(prompts or [])} prompts")
        completions, answers = [str(c) for c in completions], [str(a) for a in answers]
        if self._closed:
            raise RuntimeError("RewardRunner is closed")
        code_metrics_ = {}
        if self._code is not None:
            scored = self._code(completions, answers)
            results, timeouts, code_metrics_ = [(r.reward, None) for r in scored], 0, code_metrics(scored)
        elif self._worker is None:
            results = [score_one(self._fn, c, a, self._kwargs) for c, a in zip(completions, answers, strict=True)]
            timeouts = cut = 0
        else:
            try:
                results, timeouts, cut = self._score_in_worker(completions, answers,
                                                               [str(p) for p in prompts or [""] * n])
            except BaseException:  # e.g. Ctrl-C mid-batch: its unread results must not leak into the next call
                self._worker.kill()
                raise
        metrics = {"reward/errors": 0.0, **code_metrics_}
        if self.judge is not None:
            results, metrics["reward/judge_failures"] = self._failed_judgements(results)
        values = [v for v, _ in results]
        self.last_verifier = [0.0 if v is None else v for v in values]
        if self._worker is not None:
            metrics["reward/timeouts"] = float(timeouts)
            if self.step_timeout_s > 0:
                metrics["reward/deadline"] = float(cut)
        fmt = [format_ok(self.name, c) or 0.0 for c in completions]
        if self.has_format:
            metrics["reward/format"] = sum(fmt) / max(n, 1)
        if self.reward_model is not None:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)] if prompts is not None else completions
            rm = self.reward_model(texts)
            good = [s for s in rm if math.isfinite(s)]
            metrics["reward/model"] = sum(good) / max(len(good), 1)
            for i, s in enumerate(rm):
                if values[i] is None:
                    continue
                if math.isfinite(s):
                    values[i] += self.reward_model_weight * s
                else:
                    values[i], results[i] = None, (None, f"reward model score {s}")
        rewards = [0.0 if v is None else v + self.format_weight * f for v, f in zip(values, fmt, strict=True)]
        failed = [(i, why) for i, (v, why) in enumerate(results) if v is None]
        metrics["reward/errors"] = float(len(failed))
        self.last_error = f"sample {failed[0][0]}: {failed[0][1]}" if failed else None
        if failed:
            log.warning("reward %r: %d of %d samples scored 0 (e.g. %s)", self.name, len(failed), n, self.last_error)
        return rewards, metrics

    def _failed_judgements(self, results: list[Result]) -> tuple[list[Result], float]:
        """The results with each failed judgement scored `reward.judge_failure_score` when set (else it stays a
        failed sample), and how many judgements failed."""
        failed = {i for i, (v, why) in enumerate(results) if v is None and (why or "").startswith(JUDGE_FAILED)}
        score = self.judge.failure_score
        if failed and score is not None:
            log.warning("reward %r: %d of %d judgements failed, scored %g (reward.judge_failure_score; e.g. %s)",
                        self.name, len(failed), len(results), score, results[min(failed)][1])
            results = [(score, None) if i in failed else r for i, r in enumerate(results)]
        return results, float(len(failed))

    def _score_in_worker(self, completions: list[str], answers: list[str],
                         prompts: list[str]) -> tuple[list[Result], int, int]:
        """-> ([(reward | None, error | None)] per sample, timeouts, samples cut by the step deadline). Resumes
        after a hung sample; at the deadline, stops scoring and replaces the worker once."""
        n, w = len(completions), self._worker
        results: list[Result] = [(None, "not scored")] * n
        timeouts, start = 0, 0
        deadline = time.monotonic() + self.step_timeout_s if self.step_timeout_s > 0 else math.inf

        def wait() -> tuple[bool, bool]:
            """(a message is ready, the step deadline passed first)."""
            left = deadline - time.monotonic()
            if left <= 0:
                return False, True
            ready = w.conn.poll(min(self.timeout_s, left))
            return ready, not ready and time.monotonic() >= deadline

        def cut(first: int) -> tuple[list[Result], int, int]:
            w.kill()
            late = [i for i in range(first, n) if results[i][1] == "not scored"]
            for i in late:
                results[i] = (None, f"scoring deadline reward.step_timeout_s={self.step_timeout_s:g} s passed")
            return results, timeouts + len(late), len(late)

        while start < n:
            if time.monotonic() >= deadline:
                return cut(start)
            if not w.alive:
                w.start()
            try:
                w.conn.send((completions[start:], answers[start:], prompts[start:]))
            except OSError:  # died taking the batch (e.g. out of memory): blame one sample, so we always progress
                results[start] = (None, f"worker process died (exit code {w.exit_code()})")
                w.kill()
                start += 1
                continue
            if w.batched:
                ready, late = wait()
                if late:
                    return cut(0)
                if not ready:
                    w.kill()
                    return [(None, f"timed out after {self.timeout_s:g} s")] * n, n, 0
                try:
                    return w.conn.recv(), 0, 0
                except (EOFError, OSError):
                    why = f"worker process died (exit code {w.exit_code()})"
                    w.kill()
                    return [(None, why)] * n, 0, 0
            done = start  # samples [start, done) have results
            while done < n:
                ready, late = wait()
                if late:
                    return cut(done)
                if not ready:
                    results[done] = (None, f"timed out after {self.timeout_s:g} s")
                    timeouts += 1
                    w.kill()
                    done += 1
                    break
                try:
                    i, value, error = w.conn.recv()
                except (EOFError, OSError):
                    results[done] = (None, f"worker process died (exit code {w.exit_code()})")
                    w.kill()
                    done += 1
                    break
                results[start + i] = (value, error)
                done = start + i + 1
            start = done
        return results, timeouts, 0

    def close(self) -> None:
        """Stop the worker process (idempotent); the runner cannot be called afterwards."""
        self._closed = True
        if self._worker is not None:
            self._finalizer()
        while self.owned:  # (e.g. the server of a local judge model)
            self.owned.pop()()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

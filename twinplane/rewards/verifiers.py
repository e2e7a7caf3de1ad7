"""Built-in verifiers: (completion, reference answer) -> reward for one sample, computed against ground truth.

Rewards never come from the policy's own outputs or labels: the reference answer is the task's ground truth.
Each verifier scores one sample so the runner can stream results out of its worker one at a time (a verifier
that hangs on one sample then costs only that sample); `registry.batched` turns them into list functions.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

# A number as GSM8K writes it: optional sign and `$` ("-$2", "$-2"), thousands commas ("1,000") or plain
# digits, optional decimals. A sign must not follow a word character or `)`, so "2000-2010" ends in 2010.
_NUM = r"(?:(?<![\w)])-)?(?:\$\s?-?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?:(?<![\w)])-)?\$?\.\d+"
_NUMBER = re.compile(_NUM)
_HASHES = re.compile(r"####\s*(" + _NUM + ")")
_INT = re.compile(r"[+-]?\d+")
_BOXED = re.compile(r"\\boxed\s*\{")
GSM8K_MODES = ("flexible", "strict")


def to_decimal(text: str) -> Decimal | None:
    """"$1,000." -> 1000; commas, `$`, spaces and a trailing `.` are dropped. None when not a number."""
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


def gsm8k_completion_answer(completion: str, mode: str = "flexible") -> Decimal | None:
    """strict: the number after the first `####` (lm-eval's strict-match); flexible: the last number."""
    if mode == "strict":
        m = _HASHES.search(completion)
        return to_decimal(m.group(1)) if m else None
    if mode == "flexible":
        found = _NUMBER.findall(completion)
        return to_decimal(found[-1]) if found else None
    raise ValueError(f"gsm8k mode must be one of {GSM8K_MODES}, got {mode!r}")


def gsm8k_reference(answer: str) -> Decimal:
    """The reference number: after the last `####` of a GSM8K worked solution, or the bare number itself."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    d = to_decimal(answer)
    if d is None:
        raise ValueError(f"gsm8k reference answer is not a number: {answer.strip()[:60]!r}")
    return d


def gsm8k(completion: str, answer: str, mode: str = "flexible") -> float:
    """1.0 when the completion's answer equals the reference numerically ("3.50" == "3.5"), else 0.0."""
    got = gsm8k_completion_answer(completion, mode)
    return 1.0 if got is not None and got == gsm8k_reference(answer) else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last top-level `\\boxed{...}` (nested and escaped braces handled); None when there is
    none or it never closes (a truncated completion has no answer)."""
    last, pos = None, 0
    while (m := _BOXED.search(text, pos)) is not None:
        depth, i, start = 1, m.end(), m.end()
        while i < len(text) and depth:
            ch = text[i]
            if ch == "\\":
                i += 2  # \{ and \} are literal braces, not grouping
                continue
            depth += ch == "{"
            depth -= ch == "}"
            i += 1
        if depth:
            break
        last, pos = text[start:i - 1], i
    return last


def _math_verify_timeout() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may use; elsewhere the caller (the
    # runner's worker process) has to enforce the limit.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equivalent(completion: str, answer: str) -> float:
    """1.0 when the last `\\boxed{}` of the completion is mathematically equivalent to the reference (a bare
    expression, or a solution whose last `\\boxed{}` is taken), per math-verify: 1/2, 0.5 and \\frac{1}{2} agree.
    Answers math-verify cannot parse on either side fall back to whitespace-insensitive string equality."""
    from math_verify import parse, verify  # imported here: only the worker process pays for sympy

    pred = last_boxed(completion)
    if pred is None:
        return 0.0
    gold = last_boxed(answer) if "\\boxed" in answer else answer
    if gold is None:
        raise ValueError(f"math reference has an unclosed \\boxed: {answer.strip()[:60]!r}")
    t = _math_verify_timeout()
    gold_p = parse("\\boxed{" + gold + "}", parsing_timeout=t)
    pred_p = parse("\\boxed{" + pred + "}", parsing_timeout=t)
    if not gold_p or not pred_p:
        return float("".join(gold.split()) == "".join(pred.split()))
    return 1.0 if verify(gold_p, pred_p, timeout_seconds=t) else 0.0


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion equals the answer once surrounding whitespace is stripped."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def exact_int_sample(completion: str, answer: str) -> float:
    """1.0 when the whole completion (whitespace stripped) is an integer equal to the answer, else 0.0."""
    c = completion.strip()
    return 1.0 if _INT.fullmatch(c) and int(c) == int(answer) else 0.0


def exact_int(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """The arithmetic demo's reward, batched (kept under this name for `run.py` and the TRL benchmark)."""
    return [exact_int_sample(c, a) for c, a in zip(completions, answers, strict=True)]


def format_ok(name: str, completion: str) -> float | None:
    """1.0/0.0: does the completion carry the answer format the verifier `name` reads? None when `name` has no
    format (exact_match, exact_int, user functions), so no format reward applies."""
    if name == "gsm8k":
        return 1.0 if _HASHES.search(completion) else 0.0
    if name == "math":
        return 1.0 if last_boxed(completion) is not None else 0.0
    return None


# name -> per-sample verifier. CHEAP ones are pure regex/string work and run in the caller's process;
# the rest (math: sympy can take unbounded time) run in the runner's worker process.
VERIFIERS = {"gsm8k": gsm8k, "math": math_equivalent, "exact_match": exact_match, "exact_int": exact_int_sample}
CHEAP = frozenset({"gsm8k", "exact_match", "exact_int"})

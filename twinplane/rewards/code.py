"""The `code` reward: run a completion's program against the task's unit tests in the sandbox.

The answer field carries the tests (a dict, or its JSON) in one of three forms:
- HumanEval: {"prompt", "test", "entry_point"} -> the program, then `test`, then `check(entry_point)`;
- MBPP: {"test_list": [...], "test_setup_code": "..."} -> each assert is one test;
- stdin/stdout: {"inputs": [...], "outputs": [...]} -> the program reads each input on stdin; its stdout must
  equal the output after whitespace normalisation (both split on whitespace).
The program is the last fenced ```python block of the completion, or the whole completion; when the task has
an entry point that the program does not define, the prompt is prepended (HumanEval completions continue it).

Reward: 1.0 when every test passes, else 0.0; with `partial=True`, the fraction passed. One sandbox call per
program (start-up is paid once, not per test): `code_driver.py` forks a child per test inside it. Programs run
concurrently on a thread pool (each thread waits on its own sandbox process).

Trust: the sandbox bounds what a program can do to the machine. Tests that run in the program's own process
(HumanEval, MBPP) can be subverted by code that inspects them; that is inherent to such tests. Exiting early,
crashing or printing "passed" never scores, and stdin/stdout expected outputs never enter the sandbox.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from twinplane.sandbox import Limits, Sandbox, get_sandbox

DRIVER = (Path(__file__).with_name("code_driver.py")).read_text(encoding="utf-8")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
FAILURES = ("crash", "timeout", "memory", "output_limit", "error")  # counted per sample in metrics


@dataclass(frozen=True)
class CodeTests:
    kind: str  # humaneval | mbpp | stdio
    tests: tuple[str, ...]  # test sources (humaneval, mbpp) or stdin inputs (stdio)
    outputs: tuple[str, ...] = ()  # expected stdout per input (stdio)
    setup: str = ""  # code run before the program (MBPP's test_setup_code)
    prompt: str = ""  # prepended when the program does not define entry_point
    entry_point: str | None = None


@dataclass
class CodeResult:
    reward: float
    passed: int
    total: int
    status: str  # ok (every test ran to a verdict) | crash | timeout | memory | output_limit | error


def parse_tests(answer: str | dict) -> CodeTests:
    """A code task's answer (dict or JSON text) -> CodeTests; ValueError naming what is wrong."""
    spec = answer
    if isinstance(answer, str):
        try:
            spec = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"code answer is not JSON ({e.msg})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"code answer must be an object, got {type(spec).__name__}")
    if "test" in spec and "entry_point" in spec:
        ep = spec["entry_point"]
        if not isinstance(ep, str) or not ep.isidentifier() or not isinstance(spec["test"], str):
            raise ValueError("code answer: HumanEval form needs a string test and an identifier entry_point")
        return CodeTests("humaneval", (f"{spec['test']}\ncheck({ep})\n",), prompt=str(spec.get("prompt") or ""),
                         entry_point=ep)
    if "test_list" in spec:
        tests = spec["test_list"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("code answer: test_list must be a non-empty list of strings")
        return CodeTests("mbpp", tuple(tests), setup=str(spec.get("test_setup_code") or ""),
                         prompt=str(spec.get("prompt") or ""), entry_point=spec.get("entry_point"))
    if "inputs" in spec and "outputs" in spec:
        ins, outs = spec["inputs"], spec["outputs"]
        if not (isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs) and ins
                and all(isinstance(x, str) for x in ins + outs)):
            raise ValueError("code answer: inputs and outputs must be non-empty lists of strings of equal length")
        return CodeTests("stdio", tuple(ins), tuple(outs))
    raise ValueError(f"code answer has none of the forms {{test, entry_point}}, {{test_list}}, {{inputs, outputs}} "
                     f"(keys: {', '.join(map(str, spec))})")


def extract_program(completion: str) -> str:
    """The last fenced Python block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def defines(program: str, name: str) -> bool:
    """Whether the program defines `name` at top level (a def, class or assignment)."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", program, re.MULTILINE) is not None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def build_program(completion: str, tests: CodeTests) -> str:
    program = extract_program(completion)
    if tests.entry_point and tests.prompt and not defines(program, tests.entry_point):
        program = tests.prompt + program
    return program


def normalise(text: str) -> list[str]:
    return text.split()


class CodeScorer:
    """`results = scorer(completions, answers)`: one `CodeResult` per completion, never raising for a sample.

    sandbox: backend name or instance; timeout_s: wall clock for one program (all its tests); test_timeout_s:
    one test; memory_mb, cpu_s: per process; workers: programs in flight (default: CPU count)."""

    def __init__(self, sandbox: str | Sandbox = "bwrap", partial: bool = False, timeout_s: float = 10.0,
                 test_timeout_s: float = 4.0, memory_mb: int = 1024, cpu_s: int = 4, workers: int | None = None):
        self.sandbox = get_sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        self.partial = partial
        self.test_timeout_s = test_timeout_s
        self.limits = Limits(wall_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, output_bytes=1 << 20, file_mb=16,
                             processes=32)
        self.workers = workers or os.cpu_count() or 1

    def __call__(self, completions: Sequence[str], answers: Sequence[str | dict]) -> list[CodeResult]:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        if not completions:
            return []
        with ThreadPoolExecutor(min(self.workers, len(completions))) as pool:
            return list(pool.map(self.score_one, completions, answers))

    def score_one(self, completion: str, answer: str | dict) -> CodeResult:
        try:
            tests = parse_tests(answer)
        except ValueError:
            return CodeResult(0.0, 0, 0, "error")
        program = build_program(str(completion), tests)
        caps = [2 * len(o.encode()) + 1024 for o in tests.outputs] or [0] * len(tests.tests)
        task = {"kind": tests.kind, "program": program, "setup": tests.setup, "tests": list(tests.tests),
                "caps": caps, "test_timeout_s": self.test_timeout_s}
        nonce = secrets.token_hex(16)
        r = self.sandbox.run({"driver.py": DRIVER, "task.json": json.dumps(task)},
                             [self.sandbox.python, "-I", "-S", "driver.py"], stdin=nonce.encode(), limits=self.limits)
        n = len(tests.tests)
        verdicts = _read_report(r.stdout, nonce) if r.success else None
        if verdicts is None or len(verdicts) != n:
            return CodeResult(0.0, 0, n, r.status if r.status != "ok" else "error")
        passed = 0
        for i, (status, out) in enumerate(verdicts):
            if status == "ran":  # stdin/stdout: compared here, outside the sandbox
                status = "pass" if out is not None and normalise(out) == normalise(tests.outputs[i]) else "fail"
                verdicts[i] = [status, None]
            passed += status == "pass"
        bad = [s for s, _ in verdicts if s in FAILURES]
        reward = passed / n if self.partial else float(passed == n)
        return CodeResult(reward, passed, n, bad[0] if bad else "ok")


def _read_report(stdout: bytes, nonce: str) -> list | None:
    """The driver's last line, `nonce <json>`; anything else (a program's own printing) is not a report."""
    lines = stdout.decode("utf-8", errors="replace").rstrip("\n").rsplit("\n", 1)
    head, _, body = lines[-1].partition(" ")
    if head != nonce:
        return None
    try:
        verdicts = json.loads(body)
    except json.JSONDecodeError:
        return None
    return verdicts if isinstance(verdicts, list) else None


def code_metrics(results: Sequence[CodeResult]) -> dict[str, float]:
    """reward/code_pass_rate (tests passed / tests run, over the batch) and per failure kind the number of
    samples it ended: reward/code_{crash,timeout,memory,output_limit,error}."""
    counts = Counter(r.status for r in results)
    total = sum(r.total for r in results)
    out = {"reward/code_pass_rate": sum(r.passed for r in results) / total if total else 0.0}
    out.update({f"reward/code_{k}": float(counts.get(k, 0)) for k in FAILURES})
    return out


def unit_tests_pass(completions: Sequence[str], answers: Sequence[str], partial: bool = False,
                    sandbox: str = "bwrap", timeout_s: float = 10.0, test_timeout_s: float = 4.0, memory_mb: int = 1024,
                    workers: int | None = None) -> list[float]:
    """Batched reward function for `score("code", ...)`: 1.0 when every test passes (or the fraction passed)."""
    scorer = CodeScorer(sandbox, partial, timeout_s, test_timeout_s, memory_mb, workers=workers)
    return [r.reward for r in scorer(completions, answers)]


unit_tests_pass.batched = True

"""Tools a model can call during a multi-turn rollout: a safe calculator and a sandboxed Python runner.

A tool is anything with a `name`, a `parameter` (the key of the JSON argument that holds its string input, e.g.
`{"expression": "2+3"}`) and `__call__(arguments: str) -> ToolResult`. Tools never raise on bad input: a
failure is a `ToolResult(error=True)` whose text goes back to the model, which is what lets RL teach it to
recover. `multi_turn.py` parses calls and decides what the model sees; this file only executes them.
"""

from __future__ import annotations

import ast
import math
import operator
import signal
from dataclasses import dataclass
from typing import Protocol

from twinplane.sandbox import Limits, Sandbox, get_sandbox


@dataclass
class ToolResult:
    output: str  # what the model sees (an error message when error is True)
    error: bool = False


class Tool(Protocol):
    name: str
    parameter: str  # JSON argument key holding the input string

    def __call__(self, arguments: str) -> ToolResult: ...


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail: the first lines of output and the end of a traceback both matter."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text) - max_chars} chars truncated]...\n"
    keep = max(max_chars - len(marker), 0)
    return text[:keep // 2] + marker + text[len(text) - (keep - keep // 2):]


# ---------------------------------------------------------------------------------------------- calculator

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


class Calculator:
    """Arithmetic on int/float literals with + - * / // % ** and parentheses, evaluated by walking the `ast`
    (never `eval`): names, calls, attributes, subscripts, comparisons... are rejected at the node. Integer
    results are capped at `max_bits` and a power is refused *before* computing it when its result would be
    larger, so `9**9**9` costs nothing. Floats print with 12 significant digits ("0.3", "2" for 6/3)."""

    name = "calculator"
    parameter = "expression"

    def __init__(self, max_chars: int = 200, max_bits: int = 4000):
        self.max_chars, self.max_bits = max_chars, max_bits

    def __call__(self, arguments: str) -> ToolResult:
        expr = arguments.strip()
        if len(expr) > self.max_chars:
            return ToolResult(f"error: expression longer than {self.max_chars} characters", True)
        try:
            value = self._eval(ast.parse(expr, mode="eval").body)
        except CalculatorError as e:
            return ToolResult(f"error: {e}", True)
        except ZeroDivisionError:
            return ToolResult("error: division by zero", True)
        except (SyntaxError, ValueError):
            return ToolResult("error: not an arithmetic expression", True)
        except (OverflowError, RecursionError, MemoryError):
            return ToolResult("error: result too large", True)
        if isinstance(value, float):
            if not math.isfinite(value):
                return ToolResult("error: result is not finite", True)
            return ToolResult(f"{value:.12g}")
        return ToolResult(str(value))

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):  # bool, complex, str, None, bytes: not arithmetic
                raise CalculatorError(f"unsupported literal {node.value!r}")
            return self._check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_pow(left, right)
            result = _BINOPS[type(node.op)](left, right)
            if isinstance(result, complex):  # (-8) ** 0.5
                raise CalculatorError("complex result")
            return self._check(result)
        raise CalculatorError(f"unsupported syntax: {type(node).__name__}")

    def _check(self, value: int | float) -> int | float:
        if isinstance(value, int) and value.bit_length() > self.max_bits:
            raise CalculatorError("result too large")
        return value

    def _check_pow(self, base: int | float, exp: int | float) -> None:
        """Refuse integer powers whose result has more than max_bits bits (a lower bound on its size), so a
        huge exponent is rejected without computing anything."""
        if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
            if (abs(base).bit_length() - 1) * exp > self.max_bits:
                raise CalculatorError("result too large")


# ---------------------------------------------------------------------------------------------- python

_SIGNALS = {signal.SIGXCPU: "CPU time limit exceeded", signal.SIGKILL: "CPU time limit exceeded",
            signal.SIGXFSZ: "file size limit exceeded"}


class PythonTool:
    """Runs a snippet with `python -I` in a sandbox (`twinplane.sandbox`; `bwrap` by default: its own user,
    PID and network namespaces, a fresh tmpfs work dir, read-only interpreter and allowed packages), with
    per-call limits on wall time, CPU, memory, file size, processes and output. The model sees stdout then
    stderr, truncated to `max_output_chars` (head and tail), and an `error:` line when the run failed.

    sandbox: a backend name (`bwrap` | `unsafe-local`) or a `Sandbox`; the name is checked here, so a tool
    that cannot run isolated fails when it is built, not at the first call."""

    name = "python"
    parameter = "code"

    def __init__(self, timeout_s: float = 5, cpu_s: int = 5, memory_mb: int = 512, max_output_chars: int = 2000,
                 max_file_mb: int = 16, max_processes: int = 32, max_code_chars: int = 20_000,
                 sandbox: str | Sandbox = "bwrap"):
        self.sandbox = get_sandbox(sandbox) if isinstance(sandbox, str) else sandbox
        self.limits = Limits(wall_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, file_mb=max_file_mb,
                             processes=max_processes, output_bytes=max(4 * max_output_chars, 1 << 16))
        self.max_output_chars, self.max_code_chars = max_output_chars, max_code_chars

    def __call__(self, arguments: str) -> ToolResult:
        if len(arguments) > self.max_code_chars:
            return ToolResult(f"error: code longer than {self.max_code_chars} characters", True)
        r = self.sandbox.run({"main.py": arguments}, [self.sandbox.python, "-I", "-u", "main.py"],
                             limits=self.limits)
        text = (r.stdout + r.stderr).decode("utf-8", errors="replace")
        text = truncate_middle(text.rstrip(), self.max_output_chars)  # no trailing newline before the wrapper
        if r.status == "timeout" and r.signal is None:
            why = f"wall-clock limit of {self.limits.wall_s:g}s exceeded"
        elif r.status == "output_limit" and r.signal is None:
            why = "output limit exceeded"
        elif r.signal is not None:
            why = _SIGNALS.get(r.signal, f"killed by signal {r.signal}")
        elif r.exit_code != 0:
            why = f"exit code {r.exit_code}"
        else:
            return ToolResult(text)
        return ToolResult(f"error: {why}\n{text}".rstrip(), True)


TOOLS: dict[str, type] = {"calculator": Calculator, "python": PythonTool}


def build_tools(names: list[str], sandbox: str = "bwrap") -> dict[str, Tool]:
    """Instantiate built-in tools with their default limits, keyed by the name the model calls them by.
    Raises `SandboxUnavailable` when `python` is asked for and `sandbox` cannot start here."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; available: {sorted(TOOLS)}")
    return {n: PythonTool(sandbox=sandbox) if n == "python" else TOOLS[n]() for n in names}

"""Tools a model can call during a multi-turn rollout: a safe calculator and a resource-limited Python runner.

A tool is anything with a `name`, a `parameter` (the key of the JSON argument that holds its string input, e.g.
`{"expression": "2+3"}`) and `__call__(arguments: str) -> ToolResult`. Tools never raise on bad input: a
failure is a `ToolResult(error=True)` whose text goes back to the model, which is what lets RL teach it to
recover. `multi_turn.py` parses calls and decides what the model sees; this file only executes them.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


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

# Runs inside the child before the model's code. Limits are set here rather than in a `preexec_fn`: the
# parent is a multi-threaded trainer/engine process, where CPython documents preexec_fn as deadlock-prone and
# where it also forces a full fork() instead of vfork. Nothing untrusted has run yet, so the effect is the same.
_PREAMBLE = r"""
import resource, socket, sys
def _cap(res, soft, extra=0):
    hard = resource.getrlimit(res)[1]
    fit = lambda v: v if hard == resource.RLIM_INFINITY else min(v, hard)
    resource.setrlimit(res, (fit(soft), fit(soft + extra)))
_cap(resource.RLIMIT_CPU, {cpu}, 1)  # SIGXCPU at the soft limit, SIGKILL a second later
_cap(resource.RLIMIT_AS, {mem})
_cap(resource.RLIMIT_FSIZE, {fsize})
_cap(resource.RLIMIT_NPROC, {nproc})
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the python tool")
class _NoSocket(socket.socket):  # a subclass, not a function, so `ssl` and friends still import
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None and family != socket.AF_UNIX:  # local pipes (asyncio's socketpair) still work
            _no_network()
        super().__init__(family, type, proto, fileno)
socket.socket = _NoSocket
socket.create_connection = socket.create_server = _no_network
socket.getaddrinfo = socket.gethostbyname = socket.gethostbyname_ex = _no_network
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    _code = compile(f.read(), "main.py", "exec")
try:
    exec(_code, {{"__name__": "__main__", "__builtins__": __builtins__}})
except SystemExit:
    raise
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # drop this preamble's frame
    sys.exit(1)
"""

_SIGNALS = {signal.SIGXCPU: "CPU time limit exceeded", signal.SIGKILL: "killed", signal.SIGXFSZ: "output too large"}


class PythonTool:
    """Runs a snippet with `sys.executable -I` in a fresh temporary directory (its cwd and HOME), as its own
    session, with RLIMIT_CPU / RLIMIT_AS / RLIMIT_FSIZE / RLIMIT_NPROC, a wall-clock timeout that kills the
    whole process group, an environment built from scratch (no proxies, no PYTHON* variables, one BLAS/OpenMP
    thread) and stdout+stderr merged into an unnamed temp file whose size RLIMIT_FSIZE bounds (so an output
    flood cannot grow the parent's memory). Output is truncated to `max_output_chars` (head and tail).

    Network blocking is best effort: the child replaces `socket.socket` and the resolver/connect helpers with
    ones that raise, which stops ordinary library code but not a determined program (`_socket`, ctypes).
    RLIMIT_NPROC counts all of the user's processes and threads and is ignored for root. Real isolation (no
    network namespace, read-only filesystem, seccomp) is the container's job."""

    name = "python"
    parameter = "code"

    def __init__(self, timeout_s: float = 5, cpu_s: int = 5, memory_mb: int = 512, max_output_chars: int = 2000,
                 max_file_mb: int = 16, max_processes: int = 32, max_code_chars: int = 20_000):
        self.timeout_s, self.cpu_s, self.memory_mb = timeout_s, cpu_s, memory_mb
        self.max_output_chars, self.max_file_mb = max_output_chars, max_file_mb
        self.max_processes, self.max_code_chars = max_processes, max_code_chars

    def __call__(self, arguments: str) -> ToolResult:
        if len(arguments) > self.max_code_chars:
            return ToolResult(f"error: code longer than {self.max_code_chars} characters", True)
        preamble = _PREAMBLE.format(cpu=self.cpu_s, mem=self.memory_mb << 20, fsize=self.max_file_mb << 20,
                                    nproc=self.max_processes)
        with tempfile.TemporaryDirectory(prefix="twinplane-py-") as tmp, tempfile.TemporaryFile() as out:
            Path(tmp, "main.py").write_text(arguments, encoding="utf-8")
            env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            proc = subprocess.Popen([sys.executable, "-I", "-u", "-c", preamble], cwd=tmp, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            timed_out = not _wait_unreaped(proc.pid, self.timeout_s)
            _kill_group(proc.pid)  # the snippet's background children too; the pid is still ours (unreaped)
            proc.wait()
            out.seek(0)
            text = out.read((self.max_file_mb << 20) + 1).decode("utf-8", errors="replace")
        text = truncate_middle(text.rstrip(), self.max_output_chars)  # no trailing newline before the wrapper
        if timed_out:
            return ToolResult(f"error: wall-clock limit of {self.timeout_s}s exceeded\n{text}".rstrip(), True)
        if proc.returncode < 0:
            why = _SIGNALS.get(-proc.returncode, f"killed by signal {-proc.returncode}")
            return ToolResult(f"error: {why}\n{text}".rstrip(), True)
        if proc.returncode != 0:
            return ToolResult(f"error: exit code {proc.returncode}\n{text}".rstrip(), True)
        return ToolResult(text)


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to timeout_s for `pid` to exit without reaping it (WNOWAIT): while it is a zombie its pid, which
    is also its process-group id, cannot be reused, so killing the group afterwards cannot hit a stranger."""
    deadline = time.monotonic() + timeout_s
    try:
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
    except ChildProcessError:  # someone else reaped it (a waitpid(-1) elsewhere in the process)
        pass
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


TOOLS: dict[str, type] = {"calculator": Calculator, "python": PythonTool}


def build_tools(names: list[str]) -> dict[str, Tool]:
    """Instantiate built-in tools with their default limits, keyed by the name the model calls them by."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; available: {sorted(TOOLS)}")
    return {n: TOOLS[n]() for n in names}

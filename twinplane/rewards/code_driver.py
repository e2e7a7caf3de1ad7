"""Runs INSIDE the sandbox, once per program: every test of one program in its own forked child.

Not imported by twinplane; `code.py` ships this file's source into the sandbox next to `task.json`.
Protocol: `task.json` = {"kind", "program", "setup", "tests", "caps", "test_timeout_s"}; the driver reads it and
deletes it (so a program cannot read other tests), marks itself non-dumpable (so no child can open its
`/proc/<pid>/fd` or ptrace it), runs each test in a fork, then reads a one-time nonce from stdin (which
children never inherit) and prints `nonce <json>` as the last line: per test [status, output | null].

Per-test status: pass | fail (an assertion, or stdin/stdout: see output) | crash (another exception, exit or
signal) | timeout | memory | output_limit. The comparison of stdin/stdout outputs happens outside the sandbox:
expected outputs never enter it. Stdlib only, and only cheap imports: it runs once per scored program.
"""

import json
import os
import select
import sys

PASS = b"P"
MAX_FD = 1 << 16
EFBIG = 27  # "File too large" (the errno module is not worth its import here)


def child(kind: str, program: str, setup: str, test: str, index: int, report: int) -> None:
    """In the forked child: redirect stdio, run setup + program (+ the test), report, and _exit."""
    devnull = os.open(os.devnull, os.O_RDWR)
    if kind == "stdio":
        with open(f"in{index}", "w", encoding="utf-8") as f:
            f.write(test)
        os.dup2(os.open(f"in{index}", os.O_RDONLY), 0)
        os.dup2(os.open(f"out{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
    else:
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    if kind == "stdio":  # stdio programs report through their output file only
        os.closerange(3, MAX_FD)
    else:
        os.closerange(3, report)
        os.closerange(report + 1, MAX_FD)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
    code = 0
    try:
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(setup + "\n" + program, "solution.py", "exec"), scope)
        if kind != "stdio":
            exec(compile(test, "test.py", "exec"), scope)
            os.write(report, PASS)  # only reached when every assertion held
    except SystemExit as e:
        code = 0 if kind == "stdio" and e.code in (None, 0) else 2  # tests that never ran do not pass
    except AssertionError:
        code = 1
    except MemoryError:
        code = 3
    except OSError as e:
        code = 4 if e.errno == EFBIG else 2  # Python ignores SIGXFSZ: the file-size limit surfaces as EFBIG
    except BaseException:
        code = 2
    try:
        sys.stdout.flush()
    except BaseException:
        code = code or 4  # e.g. the file-size limit
    os._exit(code)


def run_test(kind: str, program: str, setup: str, test: str, index: int, timeout_s: float, cap: int) -> list:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child(kind, program, setup, test, index, w)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    done = select.select([pidfd], [], [], timeout_s)[0]
    if not done:
        os.kill(pid, 9)
    status = os.waitpid(pid, 0)[1]
    os.close(pidfd)
    passed = select.select([r], [], [], 0)[0] and os.read(r, 1) == PASS
    os.close(r)
    if not done:
        return ["timeout", None]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return ["output_limit" if sig == 25 else "timeout" if sig in (9, 24) else "crash", None]  # XFSZ, XCPU
    code = os.WEXITSTATUS(status)
    if kind == "stdio":
        if code == 4:
            return ["output_limit", None]
        if code:
            return [{1: "crash", 3: "memory"}.get(code, "crash"), None]
        with open(f"out{index}", "rb") as f:
            out = f.read(cap + 1)
        if len(out) > cap:
            return ["output_limit", None]
        return ["ran", out.decode("utf-8", errors="replace")]
    if passed and code == 0:
        return ["pass", None]
    return [{1: "fail", 3: "memory", 4: "output_limit"}.get(code, "crash"), None]


def main() -> None:
    with open("task.json", encoding="utf-8") as f:
        task = json.load(f)
    os.unlink("task.json")
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    except Exception:
        pass
    kind, program, setup = task["kind"], task["program"], task["setup"]
    results = [run_test(kind, program, setup, test, i, task["test_timeout_s"], cap)
               for i, (test, cap) in enumerate(zip(task["tests"], task["caps"], strict=True))]
    nonce = sys.stdin.read().strip()
    sys.stdout.write(f"\n{nonce} {json.dumps(results)}\n")


if __name__ == "__main__":
    main()

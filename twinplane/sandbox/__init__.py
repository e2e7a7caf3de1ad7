"""Where model-written code runs: one seam, `run(files, argv, stdin, limits) -> ExecResult`, two backends.

- `bwrap` (default on Linux): namespaces, a private tmpfs, read-only interpreter, no network; see `bwrap.py`.
- `unsafe-local`: process limits only; runs only when chosen by name, and warns once.

`get_sandbox(name)` checks, once per process and backend, that the backend can start here, and raises
`SandboxUnavailable` with a one-line remedy when it can't: callers turn that into exit code 2 at startup.
"""

from __future__ import annotations

from functools import cache
from typing import Protocol

from twinplane.sandbox.base import DEFAULT_LIMITS, ExecResult, Limits, SandboxUnavailable
from twinplane.sandbox.bwrap import HOW_TO_ENABLE, BwrapSandbox, probe
from twinplane.sandbox.local import LocalSandbox

BACKENDS = ("bwrap", "unsafe-local")


class Sandbox(Protocol):
    name: str
    python: str  # the interpreter's path inside the sandbox

    def run(self, files: dict[str, str | bytes], argv: list[str], stdin: bytes | None = None,
            limits: Limits = DEFAULT_LIMITS) -> ExecResult: ...


@cache
def get_sandbox(name: str = "bwrap") -> Sandbox:
    """The backend `name`, after checking it works here (cached: the check runs once per process)."""
    if name == "unsafe-local":
        return LocalSandbox()
    if name != "bwrap":
        raise ValueError(f"unknown sandbox {name!r} (available: {', '.join(BACKENDS)})")
    sandbox = BwrapSandbox()
    why = probe(sandbox)
    if why:
        raise SandboxUnavailable(f"{why}; {HOW_TO_ENABLE}")
    return sandbox


__all__ = ["BACKENDS", "ExecResult", "Limits", "Sandbox", "SandboxUnavailable", "get_sandbox"]

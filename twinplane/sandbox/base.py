"""The one seam for running untrusted programs: `Sandbox.run(files, argv, stdin, limits) -> ExecResult`.

Backends (`bwrap.py`, `local.py`) differ only in how they start the process; waiting, output capture with a
cap, and the verdict are shared here. A program runs in a fresh work dir holding `files`, which is its cwd;
`argv[0]` may be `sandbox.python`, the interpreter path valid inside the sandbox.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass


class SandboxUnavailable(RuntimeError):
    """No isolating backend can start here; the message says how to enable one (one line)."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall clock for the whole call; the namespace (or process group) is then killed
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    output_bytes: int = 1 << 20  # stdout and stderr each; more ends the call with status output_limit
    file_mb: int = 16  # largest file a program may write (RLIMIT_FSIZE); the bwrap work dir holds 4x this
    processes: int = 32  # processes and threads (RLIMIT_NPROC; binds for root too under bwrap's user namespace)


DEFAULT_LIMITS = Limits()


@dataclass
class ExecResult:
    stdout: bytes
    stderr: bytes
    exit_code: int | None  # None when the program was killed by a signal (timeout, limits)
    status: str  # ok (exited by itself, any exit code) | timeout | memory | output_limit | error
    wall_s: float
    signal: int | None = None  # the signal that ended it (a CPU or file-size limit...), None when we stopped it

    @property
    def success(self) -> bool:
        return self.status == "ok" and self.exit_code == 0


# What a signal death means. SIGKILL after the CPU soft limit is the kernel's hard-limit kill.
_SIGNAL_STATUS = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "output_limit", signal.SIGKILL: "timeout"}


def memfd(data: bytes, name: str = "f") -> int:
    """A file descriptor holding `data` at offset 0 (nothing on disk; no pipe-buffer deadlock for big data)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def collect(proc: subprocess.Popen, limits: Limits, start: float, kill, high_codes_are_signals: bool = False
            ) -> ExecResult:
    """Read stdout/stderr (capped) until the process exits or the wall clock runs out, then `kill()` whatever
    is left and reap. One selector loop over both pipes and a pidfd: no threads, no polling sleeps.
    high_codes_are_signals: exit code 128+N means "killed by signal N" (bwrap reports its child's death so)."""
    out, err = bytearray(), bytearray()
    bufs = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    deadline, verdict, exited = start + limits.wall_s, None, False
    try:
        while bufs and verdict is None:
            left = deadline - time.monotonic()
            if left <= 0:
                verdict = "timeout"
                break
            for key, _ in sel.select(left):
                if key.fd == pidfd:
                    exited = True  # drain what is already in the pipes, but don't wait for grandchildren
                    sel.unregister(pidfd)
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    del bufs[key.fd]
                    continue
                buf = bufs[key.fd]
                buf += chunk
                if len(buf) > limits.output_bytes:
                    del buf[limits.output_bytes:]
                    verdict = "output_limit"
            if exited and not _readable(sel, pidfd):
                break
    finally:
        sel.close()
        os.close(pidfd)
        kill()  # the whole namespace / process group: nothing outlives the call
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    wall = time.monotonic() - start
    code = proc.returncode
    sig = -code if code < 0 else code - 128 if high_codes_are_signals and 128 < code < 160 else None
    exit_code = None if sig is not None else code
    if verdict is not None:  # we ended it (wall clock, output cap): the signal is ours, not a limit's
        sig = None
    elif sig is not None:
        verdict = _SIGNAL_STATUS.get(sig, "error")
    elif code != 0 and b"MemoryError" in err[-4096:]:
        verdict = "memory"
    else:
        verdict = "ok"
    return ExecResult(bytes(out), bytes(err), exit_code, verdict, wall, sig)


def _readable(sel: selectors.BaseSelector, pidfd: int) -> bool:
    """After exit, keep reading only while a pipe has data right now (a background child may hold it open)."""
    return any(key.fd != pidfd for key, _ in sel.select(0))

"""The `unsafe-local` backend: process limits only, as the trainer's own user. NOT isolation.

The program runs in a fresh temporary directory (cwd and HOME) as its own session, with an environment built
from scratch and RLIMIT_CPU / AS / FSIZE / NPROC set by a small launcher before it `exec`s the program (rlimits
are not set in a `preexec_fn`, which CPython documents as deadlock-prone in a multi-threaded trainer). The
process group is killed when the call ends. It can still read and write whatever the trainer's user can,
open network connections, see other processes and escape the group with `setsid`; root ignores RLIMIT_NPROC.
Use it only where no user namespace is available and the code is trusted; it warns once per process.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twinplane.sandbox.base import DEFAULT_LIMITS, ExecResult, Limits, collect, memfd

log = logging.getLogger(__name__)

_LAUNCHER = r"""
import os, resource, sys
def set_limit(res, soft, hard):
    top = resource.getrlimit(res)[1]
    fit = lambda v: v if top == resource.RLIM_INFINITY else min(v, top)
    resource.setrlimit(res, (fit(soft), fit(hard)))
cpu, mem, fsize, nproc = map(int, sys.argv[1:5])
set_limit(resource.RLIMIT_CPU, cpu, cpu + 1)
set_limit(resource.RLIMIT_AS, mem, mem)
set_limit(resource.RLIMIT_FSIZE, fsize, fsize)
set_limit(resource.RLIMIT_NPROC, nproc, nproc)
os.execv(sys.argv[5], sys.argv[5:])
"""


class LocalSandbox:
    name = "unsafe-local"
    _warned = False  # class-level: the warning is about the process, not an instance

    def __init__(self) -> None:
        self.python = os.path.realpath(sys.executable)
        if not LocalSandbox._warned:
            LocalSandbox._warned = True
            log.warning("sandbox=unsafe-local: model-written code runs WITHOUT isolation, as this user, with "
                        "process limits only (it can read your files, use the network and signal this process)")

    def run(self, files: dict[str, str | bytes], argv: list[str], stdin: bytes | None = None,
            limits: Limits = DEFAULT_LIMITS) -> ExecResult:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="twinplane-sbx-") as tmp:
            for name, data in files.items():
                if "/" in name or name in ("", ".", ".."):
                    raise ValueError(f"sandbox file name {name!r}: must be a plain name in the work dir")
                Path(tmp, name).write_bytes(data.encode() if isinstance(data, str) else data)
            env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
            stdin_fd = memfd(stdin or b"", "stdin")
            cmd = [self.python, "-I", "-S", "-c", _LAUNCHER, str(limits.cpu_s), str(limits.memory_mb << 20),
                   str(limits.file_mb << 20), str(limits.processes), *argv]
            try:
                proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=stdin_fd, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
            except OSError as e:
                return ExecResult(b"", f"failed to start: {e}".encode(), None, "error", 0.0)
            finally:
                os.close(stdin_fd)

            def kill() -> None:
                try:  # the group id is the (unreaped, so not reusable) pid of the leader
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

            return collect(proc, limits, start, kill)

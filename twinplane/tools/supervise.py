"""Restart loop for preemptible runs: `python -m twinplane.tools.supervise [--max-restarts K] -- twinplane train ...`.

Spot instances, preemptible Slurm partitions and flaky nodes kill long runs; rather than each launcher script
growing its own retry loop, this runs the training command as a child and relaunches it with `--resume auto`
(newest complete checkpoint in the run dir) until it finishes, fails in a way a retry cannot fix, or runs out of
restarts.

Exit-code contract of `twinplane train` (what this loop relies on):
    0     finished.                                       -> return 0
    2     configuration / bad-input error.                -> never retried (the same input fails the same way)
    75    preempted: SIGTERM/SIGINT received, emergency checkpoint written (EX_TEMPFAIL).  -> retried
    other nonzero code, or death by a signal: a crash.   -> retried (resumes from the last periodic checkpoint)
The supervisor returns the last child's code, a death by signal N reported as 128+N as shells do.

Restarts wait `backoff_s`, then twice that, four times, ... capped at `max_backoff_s`, so a run that dies at once
(a bad node, a full disk) does not spin; a child that ran at least `healthy_after_s` resets the wait, since its
failure is a fresh event, not the same fault repeating. `max_restarts` counts all restarts of the job.

Stopping the job: SIGTERM or SIGINT (and SIGHUP, unless ignored as under nohup) sent to the supervisor is
forwarded to the child as SIGTERM, on which it writes its emergency checkpoint; the supervisor then returns the
child's code without restarting, because the whole job is being stopped. A second signal is forwarded again, and
the child then exits at once. The child runs in its own session so that Ctrl-C on a terminal reaches it once,
through the supervisor, rather than twice (directly and forwarded), which it would take for "exit at once".
Launchers that signal every process of the job themselves (systemd, Slurm) still deliver twice; the child should
treat signals arriving within about a second of each other as one request.

A stop is never lost, whenever it comes. SIGTERM and SIGINT are handled even when inherited as ignored (as
`twinplane train` handles them), so `kill -INT` stops a job started with `&` in a script. It is forwarded as SIGTERM
because a child still starting up cannot lose that one: CPython sets no handler for it, so the child dies of it (the
supervisor returns 143), whereas a SIGINT in an interpreter's first milliseconds can end it with 1 ("Fatal Python
error" while it initialises) or be swallowed (CPython reports and drops a KeyboardInterrupt that hits some of its
start-up steps: site's .pth files, a script's import-path check, import-lock callbacks). Once the child's handlers
are in place, its code is returned (75 from `twinplane train`). A stop that arrives before any child runs ends the
supervisor with 128+N, nothing started and nothing to save, except in the supervisor's own first milliseconds,
before any of its code runs, where CPython behaves as just said.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.1  # how often the wait loop looks for forwarded signals; also the delay before noticing an exit


def _log(msg: str) -> None:
    """Default log sink: stderr, flushed, so lines interleave in order with the child's own output."""
    print(msg, file=sys.stderr, flush=True)


def resume_auto(cmd: list[str]) -> list[str]:
    """`cmd` with `--resume auto`: an explicit `--resume PATH` is replaced too, so that a crash after the first
    restart resumes from the newest checkpoint, not from the one the job was first started with."""
    out = list(cmd)
    for i, arg in enumerate(out):
        if arg == "--resume":
            if i + 1 < len(out):
                out[i + 1] = "auto"
            else:
                out.append("auto")
            return out
        if arg.startswith("--resume="):
            out[i] = "--resume=auto"
            return out
    return [*out, "--resume", "auto"]


def exit_code(returncode: int) -> int:
    """Shell convention: a child killed by signal N (Popen reports -N) becomes 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """How one run ended, for the log line."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (crashed)"
    reason = {EXIT_OK: "finished", EXIT_CONFIG: "configuration error", EXIT_PREEMPTED: "preempted"}
    return f"exited with {returncode} ({reason.get(returncode, 'crashed')})"


class _BackoffInterrupted(Exception):
    """Raised by the signal handler to cut a backoff wait short: a stopped job should not sleep for minutes."""


class _StopRequests:
    """Signals received by the supervisor. The handler only records them (and breaks a backoff wait); the wait
    loop forwards them, so launching, forwarding and reaping all happen on one thread in one order."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.in_backoff = False
        self._previous: dict[int, object] = {}

    def __call__(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self.in_backoff:
            self.in_backoff = False
            raise _BackoffInterrupted

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():  # Python only lets the main thread set handlers
            for sig in STOP_SIGNALS:
                if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN:  # respect nohup
                    self._previous[sig] = signal.signal(sig, self)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def backoff(self, delay: float, sleep: Callable[[float], object]) -> None:
        """Sleep `delay` unless a stop arrives first (before the wait, or during it through the handler)."""
        try:
            self.in_backoff = True
            if not self.received:
                sleep(delay)
            self.in_backoff = False
        except _BackoffInterrupted:
            pass

    def wait(self, proc: subprocess.Popen, log: Callable[[str], object]) -> int:
        """Wait for the child, forwarding every stop signal received since it was launched (one that arrived
        while it was being launched included) as SIGTERM: the child checkpoints on it, and cannot lose it."""
        forwarded = 0
        while True:
            pending = self.received[forwarded:]  # (counted from this copy: one arriving meanwhile waits its turn)
            forwarded += len(pending)
            for sig in pending:
                log(f"supervise: received {signal.Signals(sig).name}; asking the child to stop (SIGTERM) and "
                    "waiting for it to exit (a second signal stops it at once)")
                proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass


def supervise(cmd: list[str], max_restarts: int, backoff_s: float = 5.0, max_backoff_s: float = 300.0,
              healthy_after_s: float = 600.0, sleep: Callable[[float], object] = time.sleep,
              log: Callable[[str], object] = _log, received: tuple[int, ...] = ()) -> int:
    """Run `cmd` (stdio inherited) until it finishes, exits 2, or fails after `max_restarts` restarts; returns
    the exit code to report (see the module docstring for the contract). `sleep` and `log` are injectable so
    tests check the backoff without waiting; `received`: stop signals that arrived before this was called."""
    if max_restarts < 0 or backoff_s < 0 or max_backoff_s < 0:
        raise ValueError("max_restarts, backoff_s and max_backoff_s must be >= 0")
    runs, run, quick_failures, argv = max_restarts + 1, 0, 0, list(cmd)
    with _StopRequests() as stops:
        stops.received[:0] = received
        if stops.received:  # before anything started: nothing to forward it to or save
            log(f"supervise: received {signal.Signals(stops.received[0]).name} before starting; not starting")
            return 128 + stops.received[0]
        while True:
            run += 1
            started = time.monotonic()
            try:
                proc = subprocess.Popen(argv, start_new_session=True)
            except OSError as e:
                log(f"supervise: cannot run {argv[0]!r}: {e}")
                return 127
            returncode = stops.wait(proc, log)
            ran_s, code = time.monotonic() - started, exit_code(returncode)
            if returncode == EXIT_OK:
                return EXIT_OK
            if stops.received:
                log(f"supervise: run {run}/{runs} {describe(returncode)} after a stop signal; not restarting")
                return code
            if returncode == EXIT_CONFIG:
                log(f"supervise: run {run}/{runs} {describe(returncode)}; configuration error: not restarting")
                return code
            if run == runs:
                log(f"supervise: run {run}/{runs} {describe(returncode)}; gave up after {max_restarts} restarts")
                return code
            quick_failures = 1 if ran_s >= healthy_after_s else quick_failures + 1
            delay = min(backoff_s * 2 ** (quick_failures - 1), max_backoff_s)
            log(f"supervise: run {run}/{runs} {describe(returncode)}; restarting with --resume auto in {delay:.1f}s")
            stops.backoff(delay, sleep)
            if stops.received:
                log(f"supervise: received {signal.Signals(stops.received[0]).name} while waiting; not restarting")
                return code
            argv = resume_auto(cmd)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:  # a Ctrl-C before the handlers are in place: no child started, nothing to save
        return 128 + signal.SIGINT


def _main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="python -m twinplane.tools.supervise", usage="%(prog)s [options] -- COMMAND ...",
        description="Run a training command, restarting it with --resume auto after preemptions and crashes "
                    "(exit 75 or any failure other than 2), with exponential backoff.")
    parser.add_argument("--max-restarts", type=int, default=10, help="restarts allowed in all (default 10)")
    parser.add_argument("--backoff", type=float, default=5.0, help="seconds before the first restart (default 5)")
    parser.add_argument("--max-backoff", type=float, default=300.0, help="cap on the doubling wait (default 300)")
    parser.add_argument("--healthy-after", type=float, default=600.0,
                        help="a run at least this many seconds long resets the wait to --backoff (default 600)")
    ns = parser.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        parser.error("no command: put it after --, e.g. -- twinplane train config.yaml")
    if ns.max_restarts < 0 or ns.backoff < 0 or ns.max_backoff < 0:
        parser.error("--max-restarts, --backoff and --max-backoff must be >= 0")
    return supervise(cmd, ns.max_restarts, ns.backoff, ns.max_backoff, ns.healthy_after)


if __name__ == "__main__":
    sys.exit(main())

"""The reward worker: a child Python process that loads one reward function and scores batches on request.

Only a process can be stopped when a function never returns, so untrusted or slow verifiers run here.
It is a fresh interpreter started with `subprocess` (not `multiprocessing`): nothing is forked from a process
that has run torch, and the trainer's `__main__` is never re-imported (spawn/forkserver would re-run an
unguarded training script). It runs in its own session, so a kill also reaches whatever the function started.
Messages are pickled over a socket pair with `multiprocessing.connection.Connection` framing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from twinplane.rewards.judge import FAILED, Judge, JudgeSettings, failed_judgement
from twinplane.rewards.registry import extra_arguments, resolve, to_reward

STARTUP_TIMEOUT_S = 120.0  # a fresh interpreter imports the reward code (not torch); slow filesystems need time
Result = tuple[float | None, str | None]  # (reward, None) or (None, why the sample failed)
_ENTRY = "import sys; from twinplane.rewards.worker import serve; serve(int(sys.argv[1]))"


def _why(e: BaseException) -> str:
    """The one-line error of a failed sample; a failed judgement's starts with `judge.FAILED` (the runner may score
    it `reward.judge_failure_score`)."""
    return ((FAILED if failed_judgement(e) else "") + " ".join(f"{type(e).__name__}: {e}".split()))[:300]


def score_one(fn, completion: str, answer: str, kwargs: dict) -> Result:
    """The per-sample guard, the same in the trainer's process and in the worker."""
    try:
        return to_reward(fn(completion, answer, **kwargs)), None
    except BaseException as e:  # SystemExit from user code is a sample failure, not a worker exit
        if isinstance(e, KeyboardInterrupt):
            raise
        return None, _why(e)


def _checked(value: object) -> Result:
    try:
        return to_reward(value), None
    except ValueError as e:
        return None, _why(e)


def _watch_parent(ppid: int) -> None:
    # A trainer killed outright leaves this process re-parented; one stuck in a user function would live on.
    while os.getppid() == ppid:
        time.sleep(1.0)
    os._exit(1)


def serve(fd: int) -> None:
    """Worker main loop: receive (name, options, sys.path), load the function once, then answer each
    (completions, answers, prompts) message: one (index, reward, error) message per sample as it is scored, or one
    list of results for a batched function. None or a closed socket ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it then closes us
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    name, options, sys_path = conn.recv()
    sys.path[:] = sys_path
    try:
        fn, batched, kwargs = resolve(name, options)
    except BaseException as e:
        conn.send(("error", str(e) if isinstance(e, ValueError) else f"reward {name!r}: {_why(e)}"))
        return
    if name == "math":  # import sympy and build the LaTeX parser now, not inside the first sample's time limit
        score_one(fn, "\\boxed{1}", "1", kwargs)
    extra = extra_arguments(fn, batched)
    judge = None
    if "judge" in extra:
        if not options.get("judge"):
            conn.send(("error", f"reward {name!r} takes a judge: set reward.judge (a URL or a model folder)"))
            return
        judge = kwargs["judge"] = Judge(JudgeSettings(**options["judge"]))
    conn.send(("ready", batched))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        completions, answers, prompts = msg
        if judge is not None:
            judge.new_step()  # (answers are cached within one scoring call: one step)
        if not batched:
            for i, (c, a, p) in enumerate(zip(completions, answers, prompts, strict=True)):
                conn.send((i, *score_one(fn, c, a, kwargs | ({"prompt": p} if "prompt" in extra else {}))))
            continue
        try:
            out = list(fn(completions, answers, **kwargs, **({"prompts": prompts} if "prompts" in extra else {})))
            if len(out) != len(completions):
                raise ValueError(f"returned {len(out)} values for {len(completions)} samples")
            results = [_checked(v) for v in out]
        except BaseException as e:
            results = [(None, _why(e))] * len(completions)
        conn.send(results)


class Worker:
    """Handle on one worker process: `start()` (again after `kill()`), `conn` to talk to it, `close()`."""

    def __init__(self, name: str, options: dict):
        self.name, self.options = name, options
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.batched = False

    def start(self) -> None:
        """Start the process and wait until it has loaded the function; a function that cannot be loaded is a
        config error (ValueError naming it)."""
        ours, theirs = socket.socketpair()
        # The child sees this interpreter's sys.path (tests and scripts extend it at run time).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-c", _ENTRY, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=env, start_new_session=True)
        self.conn = Connection(ours.detach())
        try:
            self.conn.send((self.name, self.options, list(sys.path)))
            if not self.conn.poll(STARTUP_TIMEOUT_S):
                raise ValueError(f"reward {self.name!r}: worker did not load it within {STARTUP_TIMEOUT_S:.0f} s")
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            code = self.exit_code()
            self.kill()
            raise RuntimeError(f"reward {self.name!r}: worker exited while starting (exit code {code})") from None
        except ValueError:
            self.kill()
            raise
        if kind == "error":
            self.kill()
            raise ValueError(payload)
        self.batched = payload

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        try:
            return self.proc.wait(1) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the worker's whole session (it and anything it started), then reap it."""
        if self.proc is None:
            return
        try:  # the session's group outlives the worker while anything it started runs, so kill it regardless
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if self.proc.poll() is None:
                self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self.proc = self.conn = None

    def close(self) -> None:
        """Ask the worker to exit; kill it if it has not within a second."""
        if self.proc is None:
            return
        try:
            self.conn.send(None)
            self.proc.wait(1)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

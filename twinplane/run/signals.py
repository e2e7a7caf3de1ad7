"""Stop requests (SIGTERM, SIGINT) from the first second of a run to the last.

The handler only records a request; each phase looks at it where stopping is safe (between loading steps,
warm-start steps and RL steps) and leaves through `Preempted` after saving what can be saved. A second
request exits at once with 128+signal, without a traceback (a checkpoint it interrupts has no manifest, so
`--resume auto` never picks it). Two deliveries less than a second apart are one request: launchers such as
Slurm and systemd signal every process of a job, and a supervisor forwards the same request again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from twinplane.errors import Preempted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_S = 1.0


class StopRequests:
    def __init__(self, log=None):
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.count, self.first, self.signum = 0, 0.0, None
        self._previous: dict = {}

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.count and now - self.first < DUPLICATE_S:
            return
        self.count += 1
        if self.count > 1:
            os._exit(128 + signum)
        self.first, self.signum = now, signum
        self.log(f"received {signal.Signals(signum).name}: stopping after the current step (a second signal exits "
                 "at once)")

    @property
    def requested(self) -> bool:
        return self.count > 0

    def check(self, where: str) -> None:
        """Leave now (exit 75) if a stop was requested; `where` says what a resume will redo."""
        if self.count:
            raise Preempted(f"stopped during {where}; resume with --resume auto")

    def install(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous = {sig: signal.signal(sig, self) for sig in SIGNALS}
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopRequests:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


class Faults:
    """TWINPLANE_FAULT="phase@step[xN],..." sends this process N (default 1) SIGTERMs when `phase` starts at
    `step`: deterministic preemption points for tests. Phases: load (model loading, step 0), warmstart (at
    warm-start step K), eval (a validation at step K, 0 = before RL), rollout, reward, train, weight_sync,
    checkpoint, ... (RL step K), final (saving final/). "kill:WORKER@phase@step" instead kills a cluster worker
    (e.g. kill:rollout engine 0@rollout@2). With TWINPLANE_FAULT_ONCE=FILE a fault fires only if FILE does not
    exist yet (and creates it), so a relaunched run is not preempted again at the same point.
    TWINPLANE_FAULT_SIGNAL=INT sends SIGINT (Ctrl-C) instead."""

    def __init__(self, spec: str | None):
        self.points, self.kills, self.step, self.planes = {}, {}, 0, None
        for p in filter(None, (spec or "").split(",")):
            if p.startswith("kill:"):
                worker, phase, at = p[5:].split("@")
                self.kills[(phase, at)] = worker
                continue
            where, _, count = p.partition("x")
            self.points[tuple(where.split("@"))] = int(count or 1)
        self.once = os.environ.get("TWINPLANE_FAULT_ONCE")
        self.signal = getattr(signal, "SIG" + os.environ.get("TWINPLANE_FAULT_SIGNAL", "TERM"))  # TERM | INT

    def __call__(self, phase: str, step: int | None = None) -> None:
        at = str(self.step if step is None else step)
        worker = self.kills.get((phase, at))
        if worker is not None and self.planes is not None:
            self.planes.kill(worker)
        count = self.points.get((phase, at), 0)
        if count and self.once:
            if os.path.exists(self.once):
                return
            Path(self.once).touch()
        for i in range(count):
            if i:
                time.sleep(1.1)  # a separate request, not a duplicate delivery of the first
            os.kill(os.getpid(), self.signal)

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
        self.log(f"received {signal.Signals(signum).name}: finishing this phase, then saving and exiting "
                 "(a second signal exits at once)")

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

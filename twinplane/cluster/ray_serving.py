"""The Ray engines behind the agents' server: each session's calls go to one engine actor, whose own `EngineLoop`
batches them with every other call it holds (continuous batching, as in one process).

The driver's `RemoteEngineLoops` stands where a local `EngineLoop` stands (`submit`, `held`, `open`/`shut`), so
the server and the agents' sessions are the same code on Ray. An engine actor serves on threads (its
`max_concurrency` leaves room above `agent.concurrency` for the driver's other calls), each call waiting for its
samples while the actor's loop steps. A streaming request gets its tokens when its call ends.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.stats import EngineStats
from twinplane.serving.engine_loop import NotServing, TokenCallback


class _Engines:
    """What the server and the agents read of "the engine": its weight version and its counters."""

    def __init__(self, planes):
        self.planes = planes

    @property
    def weight_version(self) -> int:
        return self.planes.weight_version

    def pop_stats(self) -> EngineStats:
        stats = EngineStats()
        for s in self.planes._wait([(e, e.serve_stats.remote()) for e in self.planes.engines], "rollout"):
            stats += s
        return stats


class RemoteEngineLoops:
    """`submit(prompt_ids, sampling, seed, on_tokens, key)` -> a Future of the samples, from the engine actor that
    `key` (a session's id) maps to, else the one with the fewest calls in flight."""

    def __init__(self, planes, max_model_len: int):
        self.planes, self.max_model_len = planes, max_model_len
        self.engine = _Engines(planes)
        planes._wait([(e, e.serve_open.remote(max_model_len)) for e in planes.engines], "rollout")
        self.in_flight = [0] * len(planes.engines)
        self.cond = threading.Condition()
        self.serving = True

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, seed: int,
               on_tokens: TokenCallback | None = None, key: str | None = None) -> Future:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"the prompt's {len(prompt_ids)} tokens plus max_tokens={sampling.max_new_tokens} pass "
                             f"the model's context of {self.max_model_len} tokens")
        with self.cond:
            if not self.serving:
                raise NotServing("the engines are not serving now")
            n = len(self.in_flight)
            i = zlib.crc32(key.encode()) % n if key is not None else min(range(n), key=self.in_flight.__getitem__)
            self.in_flight[i] += 1
        out: Future = Future()
        ref = self.planes.engines[i].serve.remote(list(prompt_ids), sampling, seed)

        def done(f) -> None:
            with self.cond:
                self.in_flight[i] -= 1
                self.cond.notify_all()
            try:
                samples = f.result()
            except Exception as e:  # the worker's failure fails this call, not the server
                out.set_exception(RuntimeError(f"{self.planes.engine_names[i]}: {type(e).__name__}"))
                return
            for j, s in enumerate(samples if on_tokens is not None else ()):
                on_tokens(j, s.token_ids, s.logprobs)
            out.set_result(samples)

        ref.future().add_done_callback(done)
        return out

    @contextmanager
    def held(self) -> Iterator[None]:
        """Every engine lent out (weight sync, validation, checkpoint): calls in flight finish, new ones wait."""
        engines = self.planes.engines
        self.planes._wait([(e, e.serve_hold.remote()) for e in engines], "rollout")
        try:
            yield
        finally:
            self.planes._wait([(e, e.serve_release.remote()) for e in engines], "rollout")

    def open(self) -> None:
        with self.cond:
            self.serving = True

    def shut(self) -> None:
        """Refuse new calls and wait for those in flight."""
        with self.cond:
            self.serving = False
            self.cond.wait_for(lambda: not any(self.in_flight))

    def close(self) -> None:
        self.shut()

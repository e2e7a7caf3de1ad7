"""The engine behind a server: one thread runs engine steps; requests from any thread join the batch at the next
step (continuous batching), each with its own sampling, and come back as futures.

An HTTP server's requests arrive one by one, from many clients at once. Serving them one `generate` call at a time
would leave the engine mostly idle; instead every request is a sequence added to ONE scheduler that the loop
steps as long as anything is waiting or running, so concurrent requests share every forward, as in an RL
rollout. Streaming requests get their new tokens after each step.

The loop owns the engine while it has work. A training run uses the same engine between rollouts (validation,
weight syncs): it calls `idle()` first, which waits until nothing is in flight; nothing may be submitted until
the rollout phase starts again. An asynchronous run's episodes go on calling the policy all the time: `held()`
lets the calls in flight finish, keeps new ones waiting (not refused) and lends the engine out meanwhile.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from twinplane.rollout.engine import RolloutEngine
from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.scheduler import Scheduler
from twinplane.rollout.sequence import Sample, sample_seed
from twinplane.rollout.sequence import Sequence as Seq

# on_tokens(sample_index, new token ids, their log-probs): called from the loop's thread after each step
TokenCallback = Callable[[int, list[int], list[float]], None]


@dataclass
class _Request:
    n: int
    future: Future
    on_tokens: TokenCallback | None
    done: dict[int, Sample] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # streamed: tokens sent per sample index


class NotServing(RuntimeError):
    """The engine is another's for now (a training run between its rollouts): the server answers 503."""


class EngineLoop:
    """`submit(prompt_ids, sampling, seed)` -> a Future of the request's `sampling.n` samples."""

    def __init__(self, engine: RolloutEngine, max_model_len: int):
        """`max_model_len`: prompt plus new tokens of one request at most (sizes the KV pool)."""
        self.engine, self.max_model_len = engine, max_model_len
        self.requests: dict[int, _Request] = {}
        self.streaming = 0  # requests in flight that stream their tokens
        self.incoming: list[tuple[Seq, _Request]] = []
        self.ids = itertools.count()
        self.cond = threading.Condition()
        self.sched: Scheduler | None = None
        self.closed = False
        self.serving = True  # `shut`: submits are refused until `open`
        self.holds = 0  # `held`: submits wait until released
        self.busy = False  # the loop's thread has taken requests and is stepping
        self.thread = threading.Thread(target=self._run, name="twinplane-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, seed: int,
               on_tokens: TokenCallback | None = None, key: str | None = None) -> Future:
        """Queue one request (its samples seeded from `seed`, one stream each); raises ValueError for a prompt
        that is empty or leaves no room for `sampling.max_new_tokens`. (`key`: which engine, where there are
        several: `cluster.ray_serving`.)"""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"the prompt's {len(prompt_ids)} tokens plus max_tokens={sampling.max_new_tokens} pass "
                             f"the model's context of {self.max_model_len} tokens")
        rid = next(self.ids)
        req = _Request(sampling.n, Future(), on_tokens)
        stops = frozenset(t for t in [self.engine.eos_token_id, *sampling.stop_token_ids] if t is not None)
        seq = Seq(list(prompt_ids), rid, sampling, [sample_seed(seed, 0, j) for j in range(sampling.n)], stops)
        with self.cond:
            if self.closed or not self.serving:
                raise NotServing("the engine is not serving now")
            self.incoming.append((seq, req))
            self.cond.notify_all()
        return req.future

    def idle(self) -> None:
        """Wait until no request is queued or running (the engine is then free for other calls)."""
        with self.cond:
            self.cond.wait_for(lambda: not self.requests and not self.incoming and not self.busy)

    def shut(self) -> None:
        """Refuse new requests and wait for those in flight: the engine is free for others until `open`."""
        with self.cond:
            self.serving = False
        self.idle()

    def open(self) -> None:
        with self.cond:
            self.serving = True

    @contextmanager
    def held(self) -> Iterator[None]:
        """The engine lent out (a weight sync, a validation, a checkpoint): the requests in flight finish first;
        those submitted meanwhile wait for the end of the block."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        with self.cond:
            self.holds += 1
            self.cond.wait_for(lambda: not self.busy and not self.requests)

    def release(self) -> None:
        with self.cond:
            self.holds -= 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()

    # --- the loop's thread --------------------------------------------------------------------------------------
    def _admits(self) -> bool:
        return bool(self.incoming) and not self.holds

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or self._admits() or self.requests)
                if self.closed:
                    break
                incoming = []
                if not self.holds:
                    incoming, self.incoming = self.incoming, []
                self.busy = True
            try:
                self._steps(incoming)
            except Exception as e:  # a failed step fails the requests in flight, not the server
                self._fail_all(e)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    @torch.no_grad()
    def _steps(self, incoming: list[tuple[Seq, _Request]]) -> None:
        """Admit `incoming`, then step until nothing is in flight or more requests arrive."""
        e = self.engine
        if self.sched is None or self.sched.blocks is not e.blocks or e.kv is None:  # another call replaced the pool
            bs, seqs = e.block_size, e.max_num_seqs
            e.allocate(self.max_model_len, seqs * (-(-self.max_model_len // bs) + 1), seqs)
            self.sched = e.scheduler()
        for seq, req in incoming:
            self.requests[seq.request_index] = req
            self.streaming += req.on_tokens is not None
            self.sched.add(seq)
        sched, t0 = self.sched, time.perf_counter()
        try:
            while sched.has_work():
                first = (sched.running or sched.waiting)[0].sampling  # (the decode graphs' sampling, if all share it)
                self._book(e.engine_step(sched, first, ahead=False))
                self._stream()
                with self.cond:
                    if self._admits() or self.closed:
                        break
        finally:
            e.end_steps(sched, t0)

    def _book(self, finished: list[Seq]) -> None:
        for seq in finished:
            req = self.requests[seq.request_index]
            j = seq.sample_indices[0]
            req.done[j] = seq.to_sample(self.engine.weight_version)
            if req.on_tokens is not None:
                self._send(req, j, seq)
            if len(req.done) == req.n:
                self.streaming -= req.on_tokens is not None
                with self.cond:
                    del self.requests[seq.request_index]
                    self.cond.notify_all()
                req.future.set_result([req.done[i] for i in range(req.n)])

    def _stream(self) -> None:
        if not self.streaming:
            return
        for seq in self.sched.running:
            req = self.requests.get(seq.request_index)
            if req is not None and req.on_tokens is not None and seq.num_generated:
                for j in seq.sample_indices if seq.width == 1 else ():  # (a prompt not forked yet has no tokens)
                    self._send(req, j, seq)

    @staticmethod
    def _send(req: _Request, j: int, seq: Seq) -> None:
        start, end = req.sent.get(j, 0), seq.num_generated
        if end > start:
            req.sent[j] = end
            req.on_tokens(j, seq.tokens[seq.prompt_len + start:], seq.logprobs[start:end])

    def _fail_all(self, error: Exception) -> None:
        with self.cond:
            requests, self.requests, self.streaming = self.requests, {}, 0
            self.sched = None
            self.cond.notify_all()
        for req in requests.values():
            if not req.future.done():
                req.future.set_exception(error)

"""Data-parallel rollout engines in worker processes on one CPU host: one single-threaded engine per core.

Why: one engine's step on a small CPU model is about half serial work (the Python dispatching ~100 small ops,
scheduling, sampling), during which all cores but one idle; only its GEMMs use them all. N engines of one thread
each, every one generating a share of the requests, keep every core busy (README, Results: rollout engine). The
trainer keeps all its threads: the workers sleep on their pipes between rollouts.

- Weights: the pool's model is in shared memory (`share_memory`), so a sync writes it once, here, as into one
  engine; each worker then re-makes its private packed GEMM copies (`RolloutEngine.weights_loaded(elsewhere=True)`).
- Samples: a call's seed is drawn here, from the one generator a checkpoint saves, and sample j of request i draws
  from (seed, i, j) in whichever worker runs it. The samples are one engine's, apart from the floating point of
  batched matmuls (the CPU tests see identical outputs), and a resume may change the worker count.
- Requests are dealt longest first to the least-loaded worker (`assign_rows`, as to engines on Ray).
- Workers are forked (no re-import: no `__main__` guard needed), set one thread before any torch op (the pattern
  of DataLoader workers: libgomp's thread pool does not survive a fork), ignore SIGINT/SIGTERM (the run decides:
  emergency checkpoint, then `close`) and die with this process. A worker's exception is raised here with its
  type and message; a worker that dies raises `WorkerError` naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection

import torch

from twinplane.errors import WorkerError
from twinplane.model import Transformer, load_weights
from twinplane.rollout.engine import Done, EngineStats, RolloutEngine, Sample, call_seed
from twinplane.rollout.sampling import SamplingParams
from twinplane.sync import weights_checksum
from twinplane.train.balance import assign_rows


class EnginePool:
    """`RolloutEngine`'s interface over `workers` engine processes (CPU only; `options` go to each engine)."""

    def __init__(self, model: Transformer, eos_token_id: int | None, pad_token_id: int = 0, *, workers: int,
                 seed: int = 0, **options):
        if workers < 2:
            raise ValueError(f"an engine pool needs at least 2 workers, got {workers}")
        if model.output_weight().device.type != "cpu" or "fork" not in mp.get_all_start_methods():
            raise ValueError("an engine pool runs on CPU, where processes can fork")
        self.model = model.eval().requires_grad_(False).share_memory()
        self.device = torch.device("cpu")
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.generator = torch.Generator().manual_seed(seed)  # one draw per call: that call's seed
        self.weight_version = 0
        self.stats = EngineStats()
        ctx = mp.get_context("fork")
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for i in range(workers):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(there, [*self.conns, here], model, eos_token_id, pad_token_id,
                                                    options), daemon=True, name=f"twinplane-engine-{i}")
            proc.start()
            there.close()
            self.conns.append(here)
            self.procs.append(proc)
        try:
            self._call([("ready",)] * workers)  # an engine that cannot be built fails here, with its error
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> int:
        return len(self.procs)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.output_weight().dtype

    @torch.no_grad()
    def generate(self, requests: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Sample]:
        """Samples ordered request by request, `sampling.n` per request."""
        seed = call_seed(self.generator, sampling)
        loads = [(len(r) + sampling.max_new_tokens) * sampling.n for r in requests]
        shares = assign_rows(loads, self.workers, balance_counts=False)
        msgs = [("generate", [(i, list(requests[i])) for i in share], sampling, seed) if share else None
                for share in shares]
        samples, stats = [], []
        for out in self._call(msgs):
            if out is not None:
                samples += out[0]
                stats.append(out[1])
        self.stats = self.stats + EngineStats.parallel(stats)
        return sorted(samples, key=lambda s: s.request_index)  # stable: a request's samples keep their order

    def submit(self, requests: Sequence[Sequence[int]], sampling: SamplingParams) -> Done:
        return Done(self.generate(requests, sampling))

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     strict: bool = True) -> None:
        """Copied in place into the shared weights; the workers re-pack theirs before this returns."""
        load_weights(self.model, named, strict=strict)
        self.weight_version = self.weight_version + 1 if version is None else version
        self._call([("weights", self.weight_version)] * self.workers)

    def checksum(self) -> int:
        return weights_checksum(self.model.named_parameters())

    def pop_stats(self) -> EngineStats:
        s, self.stats = self.stats, EngineStats()
        return s

    def pop_metrics(self) -> dict[str, float]:
        return self.pop_stats().metrics()

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:  # already gone
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def _call(self, msgs: list[tuple | None]) -> list:
        """Send message i to worker i (None: nothing for it), then collect every answer; the first failure is
        raised once all have answered (so no answer is left in a pipe for the next call)."""
        sent = []
        for conn, msg in zip(self.conns, msgs, strict=True):
            try:
                if msg is not None:
                    conn.send(msg)
                sent.append(msg is not None)
            except OSError:  # its end is closed: the worker is gone (named below)
                sent.append(False)
        outs, error = [], None
        for i, (conn, msg, ok) in enumerate(zip(self.conns, msgs, sent, strict=True)):
            status, payload = "ok", None
            if msg is not None:
                try:
                    if not ok:
                        raise EOFError
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self.procs[i].join(timeout=5)
                    status, payload = "error", WorkerError(
                        f"rollout engine process {i} (pid {self.procs[i].pid}) died with exit code "
                        f"{self.procs[i].exitcode} during {msg[0]}")
            if status == "error":
                error = error or payload
                payload = None
            outs.append(payload)
        if error is not None:
            raise error
        return outs


def engines(model: Transformer, eos_token_id: int | None, pad_token_id: int = 0, processes: int = 1,
            **options) -> RolloutEngine | EnginePool:
    """One engine in this process, or `processes` > 1 engines in worker processes behind its interface."""
    if processes > 1:
        return EnginePool(model, eos_token_id, pad_token_id, workers=processes, **options)
    return RolloutEngine(model, eos_token_id, pad_token_id, **options)


def _serve(conn: Connection, inherited: list[Connection], model: Transformer, eos_token_id: int | None,
           pad_token_id: int, options: dict) -> None:
    """A worker's loop: answer each message with ("ok", result) or ("error", exception) until "stop" or EOF.
    `inherited`: the pool's ends of the pipes, copied by the fork; closed at once, so that when the pool's process
    ends (even by `os._exit`) every worker reads EOF and exits."""
    torch.set_num_threads(1)  # first: the parent's OpenMP pool did not survive the fork
    for c in inherited:
        c.close()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    engine = None
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:  # the pool's process is gone
            return
        if cmd == "stop":
            return
        try:
            if cmd == "ready":
                engine = RolloutEngine(model, eos_token_id, pad_token_id, **options)
                out = None
            elif cmd == "generate":
                items, sampling, seed = args
                engine.pop_stats()
                out = engine.run(engine.sequences(items, sampling, seed)), engine.pop_stats()
            else:  # "weights"
                engine.weights_loaded(args[0], elsewhere=True)
                out = None
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 (any error goes back to the caller, which raises it)
            conn.send(("error", _portable(e)))


def _portable(e: Exception) -> Exception:
    """The exception itself when it pickles (its type and message survive), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")

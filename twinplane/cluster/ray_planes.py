"""Both planes as Ray actors: training ranks (FSDP2), rollout engines and (PPO, `cluster.critic_devices` > 0) critic
ranks, placed by one Ray placement group.

Disaggregated (`cluster.colocate=false`): N training actors + M engine actors, one device each; weights go from
training rank 0 to the engines by bucketed broadcast over a torch.distributed group. Colocated: N training actors,
each also running an engine on its device (time-shared: the KV cache is freed after each rollout), loaded
in-process. Every call waits at most `cluster.timeout_s`; a dead or silent worker raises `WorkerError` naming it,
and `close()` kills the actors, removes the placement group and stops a Ray instance this process started.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from twinplane.cluster.planes import WorkerError, load_critic_state, reference_is_base
from twinplane.cluster.ray_serving import RemoteEngineLoops
from twinplane.cluster.sync import SyncReport
from twinplane.cluster.workers import CriticWorker, RolloutWorker, TrainWorker, WorkerSpec, free_address
from twinplane.config import Config, ConfigError
from twinplane.errors import first_line
from twinplane.model import ModelConfig
from twinplane.platform import runtime
from twinplane.rollout import SamplingParams
from twinplane.rollout.stats import EngineStats
from twinplane.rollout.stream import StreamRequest
from twinplane.tokenizer import Tokenizer
from twinplane.train import Batch
from twinplane.train.balance import assign_rows


def _actor_class(cls):
    class Actor(cls):
        def __init__(self, spec: WorkerSpec, rank: int):  # Ray scopes each actor's visible GPUs: pass their ids
            super().__init__(spec, rank, [int(g) for g in ray.get_gpu_ids()])

        def address(self) -> tuple[str, int]:  # the node's IP as Ray (and so the other nodes) sees it
            return free_address(ray.util.get_node_ip_address())

    Actor.__name__ = Actor.__qualname__ = cls.__name__
    return ray.remote(max_restarts=0)(Actor)


class RayPlanes:
    """The `Planes` over Ray actors."""

    in_process = False

    def __init__(self, cfg: Config, model_config: ModelConfig, tokenizer: Tokenizer, policy: dict[str, torch.Tensor],
                 reference: dict[str, torch.Tensor] | None, total_steps: int, tis_cap: float | None, log=print,
                 critic: dict[str, torch.Tensor] | None = None):
        """`critic`: the critic's starting weights (PPO; None: no critic), on the training ranks or on
        `cluster.critic_devices` ranks of its own."""
        c = cfg.cluster
        self.cfg, self.timeout, self.colocated = cfg, c.timeout_s, c.colocate
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            try:
                with _keeping_signal_handlers():
                    ray.init(address=c.address, include_dashboard=False, logging_level="WARNING")
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"cluster.address={c.address}: cannot start or join Ray ({_ray_error(e)})") from None
        self.pg, self.actors, self.weight_version = None, {}, 0
        try:
            self._start(cfg, model_config, tokenizer, policy, reference, critic, total_steps, tis_cap, log)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg, model_config, tokenizer, policy, reference, critic, total_steps, tis_cap, log) -> None:
        c = cfg.cluster
        spec = WorkerSpec(cfg, model_config, tokenizer, total_steps, tis_cap)
        self.train_devices, self.rollout_devices = spec.num_train, spec.num_engines
        use_gpu = cfg.device != "cpu" and (cfg.device != "auto" or ray.cluster_resources().get("GPU", 0) > 0)
        self.gpus = use_gpu
        bundle = {"CPU": c.cpus_per_worker} | ({"GPU": 1} if use_gpu else {})
        have = ray.cluster_resources()
        n = spec.num_workers
        short = {k: v * n for k, v in bundle.items() if v * n > have.get(k, 0)}
        if short:  # a placement group that can never fit would wait forever: say so now (the layout's fault: exit 2)
            raise ConfigError(f"cluster: {n} workers of {bundle} need {short}, the Ray cluster has "
                              f"{ {k: have.get(k, 0) for k in short} } in all (cluster.train_devices + "
                              f"rollout_devices + critic_devices, or cluster.cpus_per_worker, too large)")
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.timeout)
        if not ready:
            raise WorkerError(f"cluster: could not place {n} workers of {bundle} within "
                              f"{self.timeout:.0f} s (cluster.timeout_s); the Ray cluster has "
                              f"{ray.cluster_resources()}")

        def make(cls, rank: int, **options):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            return _actor_class(cls).options(num_cpus=c.cpus_per_worker, num_gpus=1 if use_gpu else 0,
                                             scheduling_strategy=strategy, **options).remote(spec, rank)

        # agents' calls each wait on a thread of their engine actor, beside the driver's own calls
        serving = {"max_concurrency": cfg.agent.concurrency + 8} if cfg.agent.entrypoint is not None else {}

        engine_label = " (and engine {})" if c.colocate else ""
        self.trainers = [make(TrainWorker, r) for r in range(spec.num_train)]
        self.actors = {f"training rank {r}" + engine_label.format(r): a for r, a in enumerate(self.trainers)}
        self.engines = self.trainers if c.colocate else \
            [make(RolloutWorker, spec.num_train + i, **serving) for i in range(spec.num_engines)]
        if not c.colocate:
            self.actors |= {f"rollout engine {i}": a for i, a in enumerate(self.engines)}
        self.critics = [make(CriticWorker, spec.world_size + i) for i in range(spec.num_critics)]
        self.actors |= {f"critic rank {i}": a for i, a in enumerate(self.critics)}
        self.names = {id(a): n for n, a in self.actors.items()}
        where = self._wait([(a, a.address.remote()) for a in self.actors.values()], "start")
        pids = self._wait([(a, a.pid.remote()) for a in self.actors.values()], "start")
        self.names = {id(a): f"{n} (pid {pid} on {host})"
                      for (n, a), (host, _), pid in zip(self.actors.items(), where, pids, strict=True)}
        addr, port = where[0]
        policy_ref = ray.put(policy)
        ref_ref = ray.put(reference) if reference is not None else None
        critic_ref = ray.put(critic) if critic is not None else None
        on_trainers = critic_ref if not self.critics else None
        calls = [(t, t.setup.remote(addr, port, policy_ref, ref_ref, on_trainers)) for t in self.trainers]
        if not c.colocate:
            calls += [(e, e.setup.remote(addr, port, policy_ref, i)) for i, e in enumerate(self.engines)]
        if self.critics:  # their own world: rendezvous at critic rank 0
            caddr, cport = where[spec.world_size]
            calls += [(a, a.setup.remote(caddr, cport, critic_ref)) for a in self.critics]
        self._wait(calls, "setup")
        self.engine_names = [self._name(e) for e in self.engines]
        self.trainer = _TrainerProxy(self, model_config)
        self.reference = _ReferenceProxy(self) if reference is not None or reference_is_base(cfg) else None
        self.critic = None if critic is None else _CriticProxy(self, self.critics or self.trainers)
        self.rollout_dtype = runtime.rollout_dtype(cfg.model, "cuda" if self.gpus else "cpu")
        self.rollout = _Engines(self)
        critics = f" + {spec.num_critics} critic rank(s)" if self.critics else ""
        log(f"ray: {spec.num_train} training rank(s) + {spec.num_engines} engine(s) "
            f"{'colocated' if c.colocate else 'disaggregated'}{critics}, {bundle} each, on {len(ray.nodes())} "
            f"node(s)")

    # --- calls ------------------------------------------------------------------------------------------------
    def _name(self, actor) -> str:
        return self.names.get(id(actor), "a worker")

    def _wait(self, calls: list[tuple[object, ray.ObjectRef]], what: str) -> list:
        """Results in call order. A dead actor is reported in preference to the errors it causes in its
        collective peers (which follow within seconds), so the message names the cause."""
        pending = {ref: actor for actor, ref in calls}
        results, failure = {}, None
        deadline = time.monotonic() + self.timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                if failure is not None:
                    break
                late = ", ".join(self._name(a) for a in pending.values())
                raise WorkerError(f"{late}: no answer to {what} within {self.timeout:.0f} s (cluster.timeout_s)")
            ref = ready[0]
            actor = pending.pop(ref)
            try:
                results[ref] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise WorkerError(f"{self._name(actor)} died during {what}: {_ray_error(e)}") from None
            except ray.exceptions.RayError as e:
                if failure is None:
                    failure = (actor, e)
                    deadline = min(deadline, time.monotonic() + 10.0)  # time for a dead peer to show itself
        if failure is not None:
            actor, e = failure
            raise WorkerError(f"{self._name(actor)} failed during {what}: {_ray_error(e)}")
        return [results[ref] for _, ref in calls]

    def _per_rank(self, method: str, batch: Batch, actors: list | None = None) -> tuple[list, list[list[int]]]:
        """`method` on each of `actors` (default: the training ranks) with its token-balanced share of the rows."""
        actors = actors or self.trainers
        rows = assign_rows(batch.attention_mask.sum(1).tolist(), len(actors))
        calls = [(a, getattr(a, method).remote(batch.select(torch.tensor(r))))
                 for a, r in zip(actors, rows, strict=True)]
        return self._wait(calls, method), rows

    def _per_token(self, method: str, batch: Batch, actors: list | None = None) -> torch.Tensor:
        """[N, R] per-token results of `method` over the ranks, reassembled (the parts are column-trimmed)."""
        parts, rows = self._per_rank(method, batch, actors)
        out = torch.zeros(len(batch), batch.response_mask.shape[1])
        for part, r in zip(parts, rows, strict=True):
            out[torch.tensor(r), :part.shape[1]] = part
        return out

    def submit(self, requests, sampling: SamplingParams) -> _Pending:
        """The engines' data-parallel share of `requests`, dealt by load: longest first to the least-loaded one."""
        loads = [len(r) + sampling.max_new_tokens for r in requests]
        shares = assign_rows(loads, len(self.engines), balance_counts=False)
        busy = [(e, share) for e, share in zip(self.engines, shares, strict=True) if share]
        calls = [(e, e.generate.remote([list(requests[i]) for i in share], sampling)) for e, share in busy]
        return _Pending(self, calls, [share for _, share in busy])

    def open_streams(self, request: StreamRequest) -> list[_RemoteStream]:
        self._wait([(e, e.stream_open.remote(request)) for e in self.engines], "rollout")
        return [_RemoteStream(self, e) for e in self.engines]

    def serve(self, max_model_len: int) -> RemoteEngineLoops:
        """The engines behind the agents' server, each call on one engine actor."""
        return RemoteEngineLoops(self, max_model_len)

    def sync(self, version: int) -> SyncReport:
        calls = [(t, t.push_weights.remote(version)) for t in self.trainers]
        if not self.cfg.cluster.colocate:
            calls += [(e, e.receive_weights.remote(version)) for e in self.engines]
        results = self._wait(calls, "weight sync")
        sent = results[0]
        engine_results = results if self.cfg.cluster.colocate else results[len(self.trainers):]
        self.weight_version = version
        return SyncReport(version, sent["expected"], {n: r["checksum"] for n, r in zip(self.engine_names,
                                                                                       engine_results, strict=True)},
                          sent["bytes"], max(r["seconds"] for r in results[:len(self.trainers)]))

    # --- checkpoints --------------------------------------------------------------------------------------------
    def state(self, shards: Path | None = None) -> dict:
        """Full tensors gathered by rank 0, or with `shards` each rank's own written there (run dir storage that
        every node sees)."""
        where = None if shards is None else str(shards)
        trained = self._wait([(t, t.state.remote(where)) for t in self.trainers], "checkpoint")[0]
        engines = self._wait([(e, e.engine_state.remote()) for e in self.engines], "checkpoint")
        critic = None if self.critic is None else self.critic.state(where)
        return trained | {"engine_rng": [g for g, _ in engines], "weight_version": engines[0][1], "critic": critic}

    def load_state(self, optimizer: dict | None, scheduler: dict, engine_rng: list[torch.Tensor], version: int,
                   critic: dict | None = None, shards: Path | None = None) -> None:
        load_critic_state(self.critic, critic, shards)
        where = None if shards is None else str(shards)
        self._wait([(t, t.load_state.remote(optimizer, scheduler, where)) for t in self.trainers], "restore")
        if shards is not None:  # the engines were built from the driver's weights, not the checkpoint's
            self.sync(version)
        exact = len(engine_rng) == len(self.engines)
        self._wait([(e, e.set_engine_state.remote(engine_rng[i] if exact else None, version))
                    for i, e in enumerate(self.engines)], "restore")
        self.weight_version = version

    def kill(self, name: str) -> None:
        """Fault injection for tests: kill the worker whose name starts with `name`."""
        ray.kill(next(a for n, a in self.actors.items() if n.startswith(name)), no_restart=True)

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors = {}
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self.started_ray and ray.is_initialized():
            with _keeping_signal_handlers():
                ray.shutdown()


class _TrainerProxy:
    """The training plane's interface over N ranks: each takes its token-balanced share of the rows."""

    def __init__(self, planes: RayPlanes, config: ModelConfig):
        self.planes, self.config, self.device = planes, config, torch.device("cpu")

    def logprobs(self, batch: Batch, method: str = "logprobs") -> torch.Tensor:
        return self.planes._per_token(method, batch)

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.planes._per_rank("train_step", batch)[0][0]  # metrics are global reductions: equal on all


class _CriticProxy:
    """The critic plane over its ranks (the training ranks, or critic ranks of its own): each takes its
    token-balanced share of the rows, as the trainer's; state is gathered to full tensors by name, or each rank
    writes and reads its own shards."""

    def __init__(self, planes: RayPlanes, actors: list):
        self.planes, self.actors = planes, actors

    def values(self, batch: Batch) -> torch.Tensor:
        return self.planes._per_token("critic_values", batch, self.actors)

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.planes._per_rank("critic_train_step", batch, self.actors)[0][0]  # global reductions

    def state(self, shards: str | None = None) -> dict | None:
        return self.planes._wait([(a, a.critic_state.remote(shards)) for a in self.actors], "checkpoint")[0]

    def load_state(self, state: dict | None, shards: Path | None = None) -> None:
        ref = ray.put(state)
        where = None if shards is None else str(shards)
        self.planes._wait([(a, a.critic_load_state.remote(ref, where)) for a in self.actors], "restore")


class _ReferenceProxy:
    def __init__(self, planes: RayPlanes):
        self.planes = planes

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return self.planes.trainer.logprobs(batch, "ref_logprobs")


class _Pending:
    """A rollout in flight on the engines (the one-step off-policy mode waits for it a step later)."""

    def __init__(self, planes: RayPlanes, calls: list, shares: list[list[int]]):
        self.planes, self.calls, self.shares = planes, calls, shares
        self.stats = EngineStats()  # the engines' counters, merged, once `result()` has collected them

    def result(self) -> list:
        samples, stats = [], []
        for share, (part, st) in zip(self.shares, self.planes._wait(self.calls, "rollout"), strict=True):
            for s in part:  # each engine numbered its own requests 0..k-1
                s.request_index = share[s.request_index]
            samples += part
            stats.append(st)
        self.stats = EngineStats.parallel(stats)
        return sorted(samples, key=lambda s: s.request_index)  # stable: a request's n samples keep their order


class _RemoteStream:
    """An engine actor's stream (`twinplane.rollout.stream`); calls are queued on the actor in order."""

    def __init__(self, planes: RayPlanes, actor):
        self.planes, self.actor = planes, actor

    def call(self, add, steps: int | None, until: int | None) -> _Call:
        return _Call(self.planes, self.actor, self.actor.stream_call.remote(add, steps, until))

    def state(self) -> dict:
        return self.planes._wait([(self.actor, self.actor.stream_state.remote())], "checkpoint")[0]

    def load_state(self, state: dict) -> None:
        self.planes._wait([(self.actor, self.actor.stream_load.remote(state))], "restore")


class _Call:
    def __init__(self, planes: RayPlanes, actor, ref):
        self.planes, self.actor, self.ref = planes, actor, ref

    def result(self):
        return self.planes._wait([(self.actor, self.ref)], "rollout")[0]


class _Engines:
    """The M data-parallel engines as one `Rollout` (validation generates through it)."""

    def __init__(self, planes: RayPlanes):
        self.planes = planes

    def generate(self, requests, sampling: SamplingParams) -> list:
        return self.planes.submit(requests, sampling).result()


@contextmanager
def _keeping_signal_handlers() -> Iterator[None]:
    """Ray's driver start and shutdown replace the SIGTERM/SIGINT handlers (SIGTERM would end the run at once):
    the run's own stay, so that a stop request remains a preemption (checkpoint, exit 75)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _ray_error(e: BaseException) -> str:
    """What a Ray call's failure says, in one line: the worker's own exception (`RayTaskError.cause`, as
    `first_line` has it), else the last line of Ray's message (where Ray writes the exception, after a traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
        return first_line(cause, typed=True)
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__

"""The processes of a cluster run: a training rank (an FSDP2 shard of the policy with its optimizer, reference
shard and, with `cluster.critic_devices=0`, critic shard; when colocated also an engine on the same device), a
rollout engine, and a critic rank (`cluster.critic_devices` > 0).

Plain classes: `ray_planes` runs them as Ray actors. Global ranks: training 0..N-1, then (disaggregated) engines
N..N+M-1. Two process groups: the training group (FSDP2 collectives) and the sync group {trainer rank 0, engines}
over which full weights are broadcast in buckets. Colocated, each rank loads its own engine in-process instead.
Critic ranks form a torch.distributed world of their own (they exchange nothing with the others but through the
driver), so the training world is the same with or without them.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from twinplane.cluster.planes import (
    build_algorithm,
    build_critic,
    build_engine,
    build_rollout,
    reference_is_base,
    restore_generator,
)
from twinplane.cluster.sync import broadcast_bucket, bucket_plan
from twinplane.config import Config, LoraSection
from twinplane.model import ModelConfig, Transformer, load_weights
from twinplane.model.checksum import combine_checksums, tensor_checksum
from twinplane.model.export import export_shapes, exported
from twinplane.model.hf import HFCausalLM, build_hf
from twinplane.model.hf_config import HFConfig
from twinplane.model.lora import apply_lora, cast_base, has_lora, merge_lora
from twinplane.model.precision import fp32_names
from twinplane.platform import hardware, runtime
from twinplane.rollout import MultiTurnRollout, Sample, SamplingParams
from twinplane.rollout.stats import EngineStats
from twinplane.rollout.stream import EngineStream, GroupRequest, StreamRequest, StreamResult
from twinplane.serving.engine_loop import EngineLoop
from twinplane.tokenizer import Tokenizer
from twinplane.train import Reference, Trainer, sharded
from twinplane.train.critic import Critic
from twinplane.train.fsdp import shard_over
from twinplane.train.optim import load_named_optimizer_state, named_optimizer_state


@dataclass
class WorkerSpec:
    """What every worker of one run is built from (the weights travel separately, as Ray objects)."""
    cfg: Config
    model_config: ModelConfig
    tokenizer: Tokenizer
    total_steps: int  # optimizer steps, for the LR schedule
    tis_cap: float | None

    @property
    def num_train(self) -> int:
        return self.cfg.cluster.train_devices

    @property
    def num_engines(self) -> int:
        c = self.cfg.cluster
        return c.train_devices if c.colocate else c.rollout_devices

    @property
    def world_size(self) -> int:
        """Processes of the training world (training ranks and engines); critic ranks form a world of their own."""
        return self.num_train + (0 if self.cfg.cluster.colocate else self.num_engines)

    @property
    def num_critics(self) -> int:
        return self.cfg.cluster.critic_devices

    @property
    def num_workers(self) -> int:
        return self.world_size + self.num_critics


def free_address(host: str | None = None) -> tuple[str, int]:
    """`host` (this node's address as the other nodes reach it; default: what the hostname resolves to, which
    may be a loopback address) and a free TCP port, for the process-group rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        return host or socket.gethostbyname(socket.gethostname()), s.getsockname()[1]


class _Worker:
    def __init__(self, spec: WorkerSpec, rank: int, gpu_ids: list[int] | None = None):
        self.spec, self.rank = spec, rank
        self.device = runtime.worker_device(spec.cfg.device, gpu_ids)
        runtime.setup(spec.cfg.seed, spec.cfg.cluster.cpus_per_worker)

    def address(self) -> tuple[str, int]:
        return free_address()

    def pid(self) -> int:
        return os.getpid()

    def _init_groups(self, addr: str, port: int) -> None:
        s = self.spec
        timeout = datetime.timedelta(seconds=s.cfg.cluster.timeout_s)
        dist.init_process_group(runtime.dist_backend(self.device), init_method=f"tcp://{addr}:{port}",
                                rank=self.rank, world_size=s.world_size, timeout=timeout)
        # Every process creates every group, in the same order (torch.distributed requires it).
        if s.cfg.cluster.colocate:
            self.train_group, self.sync_group = dist.group.WORLD, None
        else:
            self.train_group = dist.new_group(list(range(s.num_train)), timeout=timeout)
            self.sync_group = dist.new_group([0, *range(s.num_train, s.world_size)], timeout=timeout)

    def _build_engine(self, policy: dict[str, torch.Tensor], index: int) -> None:
        s = self.spec
        dtype = runtime.rollout_dtype(s.cfg.model, self.device)
        model = build_model(s.model_config, policy, self.device, dtype, s.cfg.train.lora, s.cfg.rollout.lora_merge)
        adapters = has_lora(model)  # LoRA unmerged: only the adapters travel (fp32)
        # what a weight sync delivers, in the sender's order (`export_shapes`): the engine may not keep `model`
        self.sync_shapes = [(n, p.shape) for n, p in model.named_parameters() if exported(n, adapters_only=adapters)]
        self.sync_dtype = torch.float32 if adapters else dtype
        self.sync_fp32 = frozenset() if adapters else fp32_names(model)  # (travel in buckets of their own)
        # Engine i samples from its own stream; engine 0 uses the run's seed, like the single-process engine.
        self.engine = build_engine(s.cfg, model, s.tokenizer, seed_offset=1_000_003 * index,
                                   shared=s.cfg.cluster.colocate)
        self.rollout = build_rollout(s.cfg, self.engine, s.tokenizer)

    # --- the engine's side (a RolloutWorker, or a colocated TrainWorker) ----------------------------------------
    def generate(self, requests: list[list[int]], sampling: SamplingParams) -> tuple[list, EngineStats]:
        """Samples, and this rollout's engine counters (the driver merges every engine's into the plane's)."""
        self.engine.pop_stats()
        samples = self.rollout.generate(requests, sampling)
        hardware.synchronize(self.device)
        if self.spec.cfg.cluster.colocate:
            runtime.empty_cache(self.device)  # hand the KV cache's memory (released by the engine) to training
        return samples, self.engine.pop_stats()

    def stream_open(self, request: StreamRequest) -> None:
        turns = self.rollout if isinstance(self.rollout, MultiTurnRollout) else None
        self.stream = EngineStream(self.engine, request, turns)

    def stream_call(self, add: list[GroupRequest], steps: int | None, until: int | None) -> StreamResult:
        return self.stream.call(add, steps, until)

    def stream_state(self) -> dict:
        return self.stream.state()

    def stream_load(self, state: dict) -> None:
        self.stream.load_state(state)

    # agents' calls (twinplane.cluster.ray_serving): a threaded actor, each call waiting on its own thread
    def serve_open(self, max_model_len: int) -> None:
        self.serving = EngineLoop(self.engine, max_model_len)

    def serve(self, prompt_ids: list[int], sampling: SamplingParams, seed: int) -> list[Sample]:
        return self.serving.submit(prompt_ids, sampling, seed).result()

    def serve_hold(self) -> None:
        self.serving.hold()

    def serve_release(self) -> None:
        self.serving.release()

    def serve_stats(self) -> EngineStats:
        return self.engine.pop_stats()

    def engine_state(self) -> tuple[torch.Tensor, int]:
        return self.engine.generator.get_state(), self.engine.weight_version

    def set_engine_state(self, generator_state: torch.Tensor | None, version: int) -> None:
        """None (the checkpoint had another engine count): reseed, so the run continues but not bitwise."""
        restore_generator(self.engine.generator, generator_state, version + self.rank)
        self.engine.weight_version = version

    def checksum(self) -> int:
        return self.engine.checksum()


class RolloutWorker(_Worker):
    """One data-parallel rollout engine on its own device."""

    def setup(self, addr: str, port: int, policy: dict[str, torch.Tensor], index: int) -> None:
        self._init_groups(addr, port)
        self._build_engine(policy, index)

    def receive_weights(self, version: int) -> dict:
        """The receiving end of `TrainWorker.push_weights`; returns this engine's checksum afterwards. Each bucket
        is copied into the engine's parameters, or, for an engine whose weights are not modules of this process
        (vLLM's), every received tensor is loaded by name at the end, the engine computing its checksum."""
        held = self.engine.model
        params = None if held is None else dict(held.named_parameters())
        received = []
        bucket_bytes = self.spec.cfg.cluster.sync_bucket_mb << 20
        with torch.no_grad():
            for bucket in bucket_plan(self.sync_shapes, self.sync_dtype.itemsize, bucket_bytes, self.sync_fp32):
                dtype = torch.float32 if bucket[0][0] in self.sync_fp32 else self.sync_dtype
                tensors = broadcast_bucket(None, bucket, dtype, self.device, 0, self.sync_group)
                if params is None:
                    received += tensors
                else:
                    for name, t in tensors:
                        params[name].copy_(t)
        if params is None:
            self.engine.load_weights(received, version=version)
        else:
            self.engine.weights_loaded(version)
        return {"checksum": self.engine.checksum()}


class _CriticCalls:
    """The critic plane's calls, the same on a training rank (critic_devices=0) and on a critic rank."""

    critic: Critic
    critic_group: object  # the group the critic's ranks save and load shards over (its own, or the training one)

    def critic_values(self, batch):
        return self.critic.values(batch).cpu()

    def critic_train_step(self, batch) -> dict[str, float]:
        return self.critic.train_step(batch)

    def critic_state(self, shards: str | None = None) -> dict | None:
        """Full state (collectives: every rank calls), returned by the group's first rank; with `shards` each rank
        writes its own to `shards/critic/` instead."""
        if shards is not None:
            sharded.save(Path(shards) / "critic", self.critic.model, self.critic.opt, self.critic_group)
            return None
        state = self.critic.state()
        return state if self.critic.group is None or dist.get_rank(self.critic.group) == 0 else None

    def critic_load_state(self, state: dict | None, shards: str | None = None) -> None:
        if shards is not None:
            sharded.load(Path(shards) / "critic", self.critic.model, self.critic.opt, self.critic_group)
        else:
            self.critic.load_state(state)


class TrainWorker(_CriticCalls, _Worker):
    """One training rank; with `cluster.colocate` it also hosts engine `rank` on the same device."""

    def setup(self, addr: str, port: int, policy: dict[str, torch.Tensor],
              reference: dict[str, torch.Tensor] | None, critic: dict[str, torch.Tensor] | None = None) -> None:
        """`critic`: the critic's starting weights when it is sharded over the training ranks (else None)."""
        self._init_groups(addr, port)
        s, cfg = self.spec, self.spec.cfg
        group = self.train_group if s.num_train > 1 else None  # one rank: the plain model, as the local backend
        dtype = runtime.resolve_dtype(cfg.model.dtype)
        t = cfg.train
        model = shard_over(build_model(s.model_config, policy, self.device, dtype, t.lora), group, t.compute_dtype)
        algo = build_algorithm(cfg)  # (a process of its own: the run's algorithm, rebuilt from the run's config)
        self.trainer = Trainer(model, t, algo, cfg.rollout.temperature, s.total_steps, group, tis_cap=s.tis_cap)
        self.reference = None
        if reference_is_base(cfg, algo):  # LoRA: the policy's base, adapters off
            self.reference = Reference(model, cfg.rollout.temperature, t.micro_batch_size, group=group,
                                       max_tokens=t.max_tokens_per_micro_batch, train=t)
        elif reference is not None:
            ref = shard_over(build_model(s.model_config, reference, self.device, dtype), group, t.compute_dtype)
            self.reference = Reference(ref, cfg.rollout.temperature, t.micro_batch_size, group=group,
                                       max_tokens=t.max_tokens_per_micro_batch, train=t,
                                       routing_replay=cfg.algo.routing_replay)
        if critic is not None:
            self.critic = build_critic(cfg, s.model_config, critic.items(), self.device, group)
            self.critic_group = self.train_group
        if cfg.cluster.colocate:
            self._build_engine(policy, self.rank)

    def logprobs(self, batch):
        return self.trainer.logprobs(batch).cpu()

    def ref_logprobs(self, batch):
        return self.reference.logprobs(batch).cpu()

    def train_step(self, batch) -> dict[str, float]:
        hardware.reset_peak_memory(self.device)
        m = self.trainer.train_step(batch)
        return m | {"mem/peak_gb_train": hardware.peak_memory_bytes(self.device) / 1e9}  # this rank's device

    def push_weights(self, version: int) -> dict | None:
        """Full weights, gathered from the FSDP shards one bucket at a time (every rank takes part in each
        gather), cast to the engine dtype; rank 0 broadcasts each bucket to the engines, or (colocated) every rank
        loads its own engine. Returns the sender's checksum of what it sent, bytes and seconds."""
        cfg = self.spec.cfg
        cluster, lora = cfg.cluster, cfg.train.lora
        dtype = runtime.rollout_dtype(cfg.model, self.device)
        # LoRA: only the adapters (fp32) when the engines hold them; merged weights when `rollout.lora_merge`
        adapters, merged = lora.rank > 0 and not cfg.rollout.lora_merge, lora.rank > 0 and cfg.rollout.lora_merge
        shapes = export_shapes(self.trainer.model, adapters, merged)  # a DTensor's shape is the full one
        send_dtype = torch.float32 if adapters else dtype
        fp32 = frozenset() if adapters else fp32_names(self.trainer.model)  # (sent as they are, `export_weights`)
        weights = self.trainer.named_weights(dtype, adapters_only=adapters, merged=merged)
        per_tensor, sent = {}, 0
        # colocated with an engine whose weights are not modules of this process (vLLM's): every tensor by name in
        # one load at the end, the engine computing its checksum of what it loaded
        by_name = [] if cluster.colocate and self.engine.model is None else None
        t0 = time.perf_counter()
        with torch.no_grad():
            for bucket in bucket_plan(shapes, send_dtype.itemsize, cluster.sync_bucket_mb << 20, fp32):
                full = [next(weights)[1] for _ in bucket]  # a collective per sharded tensor
                bucket_dtype = torch.float32 if bucket[0][0] in fp32 else send_dtype
                if by_name is not None:
                    by_name += [(n, x) for (n, _), x in zip(bucket, full, strict=True)]
                elif cluster.colocate:
                    load_weights(self.engine.model, [(n, x) for (n, _), x in zip(bucket, full, strict=True)],
                                 strict=not adapters)
                elif self.rank == 0:
                    broadcast_bucket(full, bucket, bucket_dtype, self.device, 0, self.sync_group)
                if cluster.colocate or self.rank == 0:
                    per_tensor.update({n: tensor_checksum(x) for (n, _), x in zip(bucket, full, strict=True)})
                    sent += sum(x.numel() for x in full) * bucket_dtype.itemsize
            if by_name is not None:
                self.engine.load_weights(by_name, version=version)
        hardware.synchronize(self.device)
        if adapters:  # the engines' checksums cover the base too (computed once: it is frozen)
            per_tensor |= self.trainer.frozen_checksums(dtype)
        out = {"expected": combine_checksums(per_tensor), "bytes": sent, "seconds": time.perf_counter() - t0}
        if cluster.colocate:
            if by_name is None:
                self.engine.weights_loaded(version)
            return out | {"checksum": self.engine.checksum()}
        return out if self.rank == 0 else None

    def state(self, shards: str | None = None) -> dict | None:
        """Full policy weights and named optimizer state (collectives: every rank calls), returned by rank 0; with
        `shards` each rank writes its own to `shards/policy/` and rank 0 returns the scheduler alone."""
        tr = self.trainer
        if shards is not None:  # the training group, not the world: a 1-rank plane's world holds the engines too
            sharded.save(Path(shards) / "policy", tr.model, tr.opt, self.train_group)
            return {"policy": None, "optimizer": None, "scheduler": tr.sched.state_dict()} if self.rank == 0 else None
        lora = self.spec.cfg.train.lora.rank > 0  # the base never changes: only the adapters come back
        policy = {n: t.cpu().clone() for n, t in tr.named_weights(adapters_only=lora)}
        opt = named_optimizer_state(tr.model, tr.opt)
        return {"policy": policy, "optimizer": opt, "scheduler": tr.sched.state_dict()} if self.rank == 0 else None

    def load_state(self, optimizer: dict | None, scheduler: dict, shards: str | None = None) -> None:
        tr = self.trainer
        if shards is not None:
            sharded.load(Path(shards) / "policy", tr.model, tr.opt, self.train_group)
        else:
            load_named_optimizer_state(tr.model, tr.opt, optimizer)
        tr.sched.load_state_dict(scheduler)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class CriticWorker(_CriticCalls, _Worker):
    """One critic rank of `cluster.critic_devices`: the value model's FSDP2 shard and its AdamW, in a
    torch.distributed world of the critic ranks alone (values and returns travel through the driver)."""

    def setup(self, addr: str, port: int, weights: dict[str, torch.Tensor]) -> None:
        s = self.spec
        index = self.rank - s.world_size  # placed after the training world's processes
        timeout = datetime.timedelta(seconds=s.cfg.cluster.timeout_s)
        dist.init_process_group(runtime.dist_backend(self.device), init_method=f"tcp://{addr}:{port}",
                                rank=index, world_size=s.num_critics, timeout=timeout)
        group = dist.group.WORLD if s.num_critics > 1 else None  # one rank: the plain model, as one process
        self.critic = build_critic(s.cfg, s.model_config, weights.items(), self.device, group)
        self.critic_group = dist.group.WORLD


def build_model(config: ModelConfig | HFConfig, state: dict[str, torch.Tensor], device: torch.device,
                dtype: torch.dtype, lora: LoraSection | None = None, merge: bool = False) -> Transformer | HFCausalLM:
    """The model from named tensors (with `lora.rank` > 0: base and adapters; `merge`: folded into plain Linears),
    the base in `dtype` and adapters (and `precision.fp32_names`) in fp32."""
    model = build_hf(config, device) if isinstance(config, HFConfig) else Transformer(copy.deepcopy(config))
    if lora is not None and lora.rank > 0:
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
    load_weights(model, state.items())
    if merge:
        merge_lora(model)
    return cast_base(model, dtype, device)


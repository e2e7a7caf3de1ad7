"""The two planes as the controller and the run loop see them (`Planes`), whichever backend holds them.

`Planes` is the protocol: the training plane `trainer`, the `reference` and `critic` planes (or None: which roles
exist is the algorithm's call, `algos.Algorithm.needs_reference` / `needs_critic`), `rollout` for validation,
`submit` for the step's rollout, `sync(version)` to move the trainer's weights to the engines, `state()` /
`load_state(...)` for checkpoints (full tensors by name, or with `shards` each rank's own, written and read by the
ranks themselves: `twinplane.train.sharded`) and `close()`. `LocalPlanes` keeps everything in this process; `RayPlanes`
(`twinplane.cluster.ray_planes`) places training ranks, engines and critic ranks as Ray actors. The engine, the
trainer, the reference and the critic are built here (and by the Ray workers from the same `build_*` functions);
`twinplane eval` builds its engine here too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch

from twinplane.algos import Algorithm, as_algorithm
from twinplane.cluster.sync import SyncReport, sync_in_process
from twinplane.config import Config
from twinplane.model import ModelConfig, Transformer, iter_safetensors
from twinplane.model.export import export_weights
from twinplane.model.hf import HFCausalLM
from twinplane.model.lora import cast_base, merge_lora
from twinplane.platform import backends, runtime
from twinplane.rollout import Done, MultiTurnRollout, RolloutEngine, Sample, SamplingParams, build_tools, engine_options
from twinplane.rollout.stats import EngineStats
from twinplane.rollout.stream import EngineStream, GroupRequest, StreamRequest
from twinplane.serving.engine_loop import EngineLoop
from twinplane.tokenizer import Tokenizer
from twinplane.train import Batch, Reference, Trainer, sharded
from twinplane.train.critic import Critic, build_value_model
from twinplane.train.fsdp import shard_over
from twinplane.train.optim import load_named_optimizer_state, named_optimizer_state


class WorkerError(RuntimeError):
    """A worker died or stopped answering; the message names it."""


class RolloutHandle(Protocol):
    """A submitted rollout: `result()` waits for its samples; then `stats` holds the engines' counters for them."""
    stats: EngineStats

    def result(self) -> list[Sample]: ...


class Rollout(Protocol):
    """What generates: an engine, a multi-turn tool driver around one, or the remote engines together."""

    def generate(self, requests: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Sample]: ...


class TrainingPlane(Protocol):
    config: ModelConfig
    device: torch.device

    def logprobs(self, batch: Batch) -> torch.Tensor: ...  # [N, R]

    def train_step(self, batch: Batch) -> dict[str, float]: ...


class ReferencePlane(Protocol):
    def logprobs(self, batch: Batch) -> torch.Tensor: ...  # [N, R]


class CriticPlane(Protocol):
    def values(self, batch: Batch) -> torch.Tensor: ...  # [N, R]

    def train_step(self, batch: Batch) -> dict[str, float]: ...

    def state(self, shards: Path | None = None) -> dict | None: ...

    def load_state(self, state: dict | None, shards: Path | None = None) -> None: ...


class StreamClient(Protocol):
    """One engine's stream as the producer drives it: `call` returns a handle whose `result()` is the
    `StreamResult`; `state` / `load_state` between steps, for checkpoints."""

    def call(self, add: list[GroupRequest], steps: int | None, until: int | None): ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


class Planes(Protocol):
    """Both planes, as the controller and the run loop use them."""
    trainer: TrainingPlane
    reference: ReferencePlane | None
    critic: CriticPlane | None
    rollout: Rollout
    rollout_dtype: torch.dtype  # the engines' weights
    weight_version: int  # the version the engines hold
    train_devices: int
    rollout_devices: int
    in_process: bool  # the trainer runs in this process (its peak memory is this process's)
    colocated: bool  # engines share the trainers' devices

    def submit(self, requests: Sequence[Sequence[int]], sampling: SamplingParams) -> RolloutHandle:
        """Start rolling out `requests` with the engines' current weights."""
        ...

    def sync(self, version: int) -> SyncReport:
        """Push the trainer's weights to every engine as `version`; the report says what each one holds."""
        ...

    def open_streams(self, request: StreamRequest) -> list[StreamClient]:
        """Each engine as a stream (`twinplane.rollout.stream`), following its weight syncs from now on."""
        ...

    def serve(self, max_model_len: int):
        """The engines behind an OpenAI-compatible server (agents' sessions): `submit` calls, batched with each
        other, and `held()` to lend them out between calls (`twinplane.serving.engine_loop.EngineLoop`)."""
        ...

    def state(self, shards: Path | None = None) -> dict:
        """For a checkpoint: {policy (None: `model` is the trainer's own), optimizer, scheduler, engine_rng,
        weight_version, critic}. With `shards`, the training ranks write the policy and its optimizer to
        `shards/policy/` and the critic ranks theirs to `shards/critic/`; policy, optimizer and critic are then None."""
        ...

    def load_state(self, optimizer: dict | None, scheduler: dict, engine_rng: list[torch.Tensor], version: int,
                   critic: dict | None = None, shards: Path | None = None) -> None:
        """`shards`: a sharded checkpoint, read by the ranks (then the engines take the loaded weights)."""
        ...

    def close(self) -> None: ...


def build_algorithm(cfg: Config) -> Algorithm:
    """The run's algorithm: built once by the run, which hands it to the planes, the controller and the producer; a
    Ray training worker, in a process of its own, rebuilds it from the same config here."""
    return as_algorithm(cfg.algo, cfg.rollout.max_new_tokens)


def build_engine(cfg: Config, model: Transformer, tokenizer: Tokenizer, seed_offset: int = 0,
                 shared: bool = False) -> RolloutEngine:
    """An engine generating with `model` itself (callers pass a copy when the model also trains), or, with
    `rollout.backend=vllm`, vLLM's engine starting from its weights; `shared`: it shares its device with a trainer
    (`runtime.keep_kv_pool` then decides whether its KV pool stays; vLLM sleeps between calls on GPUs)."""
    r = cfg.rollout
    if isinstance(model, HFCausalLM) and r.backend != "vllm":  # transformers' code: its own cache, static batches
        from twinplane.rollout.hf_engine import HFEngine

        return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, r.max_num_seqs, cfg.seed + seed_offset)
    if r.backend == "vllm":  # (imported here: vLLM is optional, and its import takes seconds)
        from twinplane.rollout.vllm_backend import VllmEngine

        return VllmEngine(model, tokenizer.eos_token_id, seed=cfg.seed + seed_offset, max_num_seqs=r.max_num_seqs,
                          max_num_batched_tokens=r.max_num_batched_tokens, kv_cache_bytes=int(r.kv_cache_gb * 2**30),
                          gpu_memory_utilization=r.gpu_memory_utilization, temperature=r.temperature, sleep=shared)
    keep = not shared or runtime.keep_kv_pool(model.output_weight().device)
    return RolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=cfg.seed + seed_offset,
                         keep_pool=keep, **engine_options(cfg.rollout))


def build_rollout(cfg: Config, engine: RolloutEngine, tokenizer: Tokenizer):
    if not cfg.rollout.tools:
        return engine
    return MultiTurnRollout(engine, tokenizer, build_tools(cfg.rollout.tools, cfg.sandbox), cfg.rollout.max_turns)


def critic_weights(cfg: Config, policy: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """The critic's starting weights: `critic.model_path`, else the policy's current (starting) weights (with LoRA
    folded in, base names only: the critic itself trains every weight)."""
    return iter_safetensors(cfg.critic.model_path) if cfg.critic.model_path else export_weights(policy, merged=True)


def build_critic(cfg: Config, model_config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                 device: torch.device, group=None) -> Critic:
    """PPO's critic on `device`, FSDP2-sharded over `group` (None: one rank, the plain model). The one builder of
    the local plane, the training workers (critic on the training ranks) and the critic workers."""
    c, t = cfg.critic, cfg.train
    model = build_value_model(model_config, weights, device, runtime.resolve_dtype(cfg.model.dtype))
    model.compile_layers = backends.compile_layers(device, t.compile)
    return Critic(shard_over(model, group, t.compute_dtype), c.lr, t.betas, t.weight_decay, c.value_clip,
                  c.grad_clip, t.micro_batch_size, t.max_tokens_per_micro_batch, group, c.loss_agg)


def reference_is_base(cfg: Config, algo: Algorithm | None = None) -> bool:
    """LoRA with a KL term: the reference is the policy's own base with the adapters off (no second model).
    `algo`: the run's algorithm (None: `build_algorithm(cfg)`)."""
    return cfg.train.lora.rank > 0 and (algo or build_algorithm(cfg)).needs_reference


def engine_model(cfg: Config, model: Transformer) -> Transformer:
    """The engine's copy of the policy in the rollout dtype (LoRA adapters and `precision.fp32_names` stay fp32): the
    same adapted model, or with `rollout.lora_merge` a plain model with the adapters folded in."""
    rollout_dtype = runtime.rollout_dtype(cfg.model, model.output_weight().device)
    model = copy.deepcopy(model)
    if cfg.rollout.lora_merge:
        merge_lora(model)
    return cast_base(model, rollout_dtype)


class LocalPlanes:
    """Both planes in this process, sharing the device; the engine takes the trainer's tensors in-process."""

    train_devices = rollout_devices = 1
    in_process, colocated = True, True

    def __init__(self, engine: RolloutEngine, trainer: Trainer, reference: Reference | None = None,
                 critic: Critic | None = None, rollout: Rollout | None = None):
        """`rollout`: what generates with `engine` (default: the engine itself)."""
        self.engine, self.trainer, self.reference, self.critic = engine, trainer, reference, critic
        self.rollout = rollout or engine

    @classmethod
    def build(cls, cfg: Config, model: Transformer, reference: Transformer | None, tokenizer: Tokenizer,
              total_steps: int, tis_cap: float | None, algo: Algorithm) -> LocalPlanes:
        r, t = cfg.rollout, cfg.train
        engine = build_engine(cfg, engine_model(cfg, model), tokenizer, shared=True)
        rollout = build_rollout(cfg, engine, tokenizer)
        trainer = Trainer(model, t, algo, r.temperature, total_steps, tis_cap=tis_cap)
        if reference_is_base(cfg, algo):
            reference = model
        ref = None if reference is None else Reference(
            reference, r.temperature, t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch, train=t,
            routing_replay=cfg.algo.routing_replay)
        critic = build_critic(cfg, model.config, critic_weights(cfg, model), model.output_weight().device) \
            if algo.needs_critic else None
        return cls(engine, trainer, ref, critic, rollout)

    @property
    def rollout_dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def submit(self, requests: Sequence[Sequence[int]], sampling: SamplingParams) -> Done:
        """Runs now (one process: the same weights as later), on the engine's own counters (not validation's)."""
        self.engine.pop_stats()
        samples = self.rollout.generate(requests, sampling)
        return Done(samples, self.engine.pop_stats())

    def serve(self, max_model_len: int) -> EngineLoop:
        """The engine behind the agents' server."""
        return EngineLoop(self.engine, max_model_len)

    def sync(self, version: int) -> SyncReport:
        return sync_in_process(self.engine, self.trainer, version)

    def open_streams(self, request: StreamRequest) -> list[_LocalStream]:
        turns = self.rollout if isinstance(self.rollout, MultiTurnRollout) else None
        return [_LocalStream(EngineStream(self.engine, request, turns))]

    def state(self, shards: Path | None = None) -> dict:
        """Policy weights are the trainer's model itself here (None: nothing to copy)."""
        tr = self.trainer
        if shards is not None:
            sharded.save(shards / "policy", tr.model, tr.opt)
            if self.critic is not None:
                sharded.save(shards / "critic", self.critic.model, self.critic.opt)
        optimizer = named_optimizer_state(tr.model, tr.opt) if shards is None else None
        return {"policy": None, "optimizer": optimizer, "scheduler": tr.sched.state_dict(),
                "engine_rng": [self.engine.generator.get_state()], "weight_version": self.engine.weight_version,
                "critic": self.critic.state() if self.critic is not None and shards is None else None}

    def load_state(self, optimizer: dict | None, scheduler: dict, engine_rng: list[torch.Tensor], version: int,
                   critic: dict | None = None, shards: Path | None = None) -> None:
        tr = self.trainer
        if shards is None:
            load_critic_state(self.critic, critic)
            load_named_optimizer_state(tr.model, tr.opt, optimizer)
        else:
            if self.critic is not None:
                sharded.load(critic_shards(shards), self.critic.model, self.critic.opt)
            sharded.load(shards / "policy", tr.model, tr.opt)
        tr.sched.load_state_dict(scheduler)
        sync_in_process(self.engine, self.trainer, version)
        restore_generator(self.engine.generator, engine_rng[0] if len(engine_rng) == 1 else None, version)

    def close(self) -> None:
        pass


class _LocalStream:
    """The in-process engine's stream: each call runs at once."""

    def __init__(self, stream: EngineStream):
        self.stream = stream

    def call(self, add: list[GroupRequest], steps: int | None, until: int | None) -> Done:
        return Done(self.stream.call(add, steps, until))

    def state(self) -> dict:
        return self.stream.state()

    def load_state(self, state: dict) -> None:
        self.stream.load_state(state)


def load_critic_state(critic, state: dict | None, shards: Path | None = None) -> None:
    if critic is None:
        return
    if shards is not None:
        critic.load_state(None, critic_shards(shards))
        return
    if state is None:
        raise ValueError(NO_CRITIC)
    critic.load_state(state)


NO_CRITIC = "the checkpoint has no critic state (it was written by a run without a critic)"


def critic_shards(shards: Path) -> Path:
    if not sharded.is_sharded(shards / "critic"):
        raise ValueError(NO_CRITIC)
    return shards / "critic"


def sharded_checkpoints(cfg: Config, train_devices: int) -> bool:
    """Whether checkpoints are written sharded (`checkpoint.format`; auto: with more than one training rank)."""
    fmt = cfg.checkpoint.format
    return fmt == "sharded" or (fmt == "auto" and train_devices > 1)


def restore_generator(gen: torch.Generator, state: torch.Tensor | None, salt: int) -> bool:
    """Put a saved sampling-generator state back; a state from another device type (CPU and CUDA generators
    differ) or another engine count reseeds instead, so the run continues, but not bitwise. Returns exactness."""
    if state is not None and state.numel() == gen.get_state().numel():
        gen.set_state(state)
        return True
    gen.manual_seed(salt * 1_000_003 + (int(state.sum()) if state is not None else 0))
    return False

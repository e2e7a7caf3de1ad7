"""The two planes as the controller and the run loop see them, whichever backend holds them.

A `Planes` object offers `trainer` (`logprobs`, `train_step`, `config`, `device`), `reference` (or None), `critic`
(`values`, `train_step`; or None), `engine` and `rollout` (`generate`, optionally `submit` for an overlapped
rollout), `sync(version) -> SyncReport`, `state()` / `load_state(...)` for checkpoints and `close()`. Which roles
exist is the algorithm's call (`algos.Algorithm.needs_reference`, `needs_critic`). `LocalPlanes` keeps everything
in this process; `RayPlanes` (`twinplane.cluster.ray_planes`) places training ranks and engines as Ray actors.
The engine, the trainer, the reference and the critic are built here (and by the Ray workers from the same
`build_*` functions); `twinplane eval` builds its engine here too.
"""

from __future__ import annotations

import copy

import torch

from twinplane import platform
from twinplane.algos import Algorithm
from twinplane.config import Config
from twinplane.model import Transformer, iter_safetensors, load_weights
from twinplane.model.lora import cast_base, merge_lora
from twinplane.rollout import MultiTurnRollout, RolloutEngine, build_tools, engine_options
from twinplane.sync import SyncReport, sync_in_process
from twinplane.tokenizer import Tokenizer
from twinplane.train import Reference, Trainer
from twinplane.train.critic import Critic, build_value_model
from twinplane.train.export import export_weights
from twinplane.train.optim import load_named_optimizer_state, named_optimizer_state


class WorkerError(RuntimeError):
    """A worker died or stopped answering; the message names it."""


def build_algorithm(cfg: Config) -> Algorithm:
    return Algorithm(cfg.algo, cfg.algo.loss_agg_horizon or cfg.rollout.max_new_tokens)


def build_engine(cfg: Config, model: Transformer, tokenizer: Tokenizer, seed_offset: int = 0) -> RolloutEngine:
    """An engine generating with `model` itself (callers pass a copy when the model also trains)."""
    return RolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=cfg.seed + seed_offset,
                         **engine_options(cfg.rollout))


def build_rollout(cfg: Config, engine: RolloutEngine, tokenizer: Tokenizer):
    if not cfg.rollout.tools:
        return engine
    return MultiTurnRollout(engine, tokenizer, build_tools(cfg.rollout.tools, cfg.sandbox), cfg.rollout.max_turns)


def build_critic(cfg: Config, policy: Transformer, device: torch.device) -> Critic:
    """PPO's critic: the value model from `critic.model_path`, else from the policy's current (starting) weights
    (with LoRA: folded in, base names only; the critic itself trains every weight)."""
    c, t = cfg.critic, cfg.train
    weights = iter_safetensors(c.model_path) if c.model_path else export_weights(policy, merged=True)
    model = build_value_model(policy.config, weights, device, platform.resolve_dtype(cfg.model.dtype))
    return Critic(model, c.lr, t.betas, t.weight_decay, c.value_clip, c.grad_clip, t.micro_batch_size,
                  t.max_tokens_per_micro_batch)


def reference_is_base(cfg: Config) -> bool:
    """LoRA with a KL term: the reference is the policy's own base with the adapters off (no second model)."""
    return cfg.train.lora.rank > 0 and build_algorithm(cfg).needs_reference


def engine_model(cfg: Config, model: Transformer) -> Transformer:
    """The engine's copy of the policy in the rollout dtype (LoRA adapters stay fp32): the same adapted model, or
    with `rollout.lora_merge` a plain model with the adapters folded in."""
    rollout_dtype = platform.resolve_dtype(cfg.model.rollout_dtype or cfg.model.dtype)
    model = copy.deepcopy(model)
    if cfg.rollout.lora_merge:
        merge_lora(model)
    return cast_base(model, rollout_dtype)


class LocalPlanes:
    """Both planes in this process, sharing the device; the engine takes the trainer's tensors in-process."""

    train_devices = rollout_devices = 1

    def __init__(self, cfg: Config, model: Transformer, reference: Transformer | None, tokenizer: Tokenizer,
                 total_steps: int, tis_cap: float | None):
        r, t = cfg.rollout, cfg.train
        self.engine = build_engine(cfg, engine_model(cfg, model), tokenizer)
        self.rollout = build_rollout(cfg, self.engine, tokenizer)
        self.trainer = Trainer(model, t, cfg.algo, r.temperature, total_steps, tis_cap=tis_cap,
                               horizon=r.max_new_tokens)
        if reference_is_base(cfg):
            reference = model
        self.reference = None if reference is None else Reference(
            reference, r.temperature, t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch, train=t,
            routing_replay=cfg.algo.routing_replay)
        needs_critic = build_algorithm(cfg).needs_critic
        self.critic = build_critic(cfg, model, model.output_weight().device) if needs_critic else None

    def sync(self, version: int) -> SyncReport:
        return sync_in_process(self.engine, self.trainer, version)

    def state(self) -> dict:
        """Policy weights are the trainer's model itself here (None: nothing to copy)."""
        tr, cr = self.trainer, self.critic
        critic = None if cr is None else {"weights": {n: t.cpu() for n, t in cr.named_weights()},
                                          "optimizer": named_optimizer_state(cr.model, cr.opt)}
        return {"policy": None, "optimizer": named_optimizer_state(tr.model, tr.opt),
                "scheduler": tr.sched.state_dict(), "engine_rng": [self.engine.generator.get_state()],
                "weight_version": self.engine.weight_version, "critic": critic}

    def load_state(self, optimizer: dict, scheduler: dict, engine_rng: list[torch.Tensor], version: int,
                   critic: dict | None = None) -> None:
        if self.critic is not None:
            if critic is None:
                raise ValueError("the checkpoint has no critic state (it was written by a run without a critic)")
            load_weights(self.critic.model, critic["weights"].items())
            load_named_optimizer_state(self.critic.model, self.critic.opt, critic["optimizer"])
        load_named_optimizer_state(self.trainer.model, self.trainer.opt, optimizer)
        self.trainer.sched.load_state_dict(scheduler)
        sync_in_process(self.engine, self.trainer, version)
        restore_generator(self.engine.generator, engine_rng[0] if len(engine_rng) == 1 else None, version)

    def close(self) -> None:
        pass


def restore_generator(gen: torch.Generator, state: torch.Tensor | None, salt: int) -> bool:
    """Put a saved sampling-generator state back; a state from another device type (CPU and CUDA generators
    differ) or another engine count reseeds instead, so the run continues, but not bitwise. Returns exactness."""
    if state is not None and state.numel() == gen.get_state().numel():
        gen.set_state(state)
        return True
    gen.manual_seed(salt * 1_000_003 + (int(state.sum()) if state is not None else 0))
    return False

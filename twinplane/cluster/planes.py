"""The two planes as the controller and the run loop see them, whichever backend holds them.

A `Planes` object offers `trainer` (`logprobs`, `train_step`, `config`, `device`), `reference` (or None), `engine`
and `rollout` (`generate`, optionally `submit` for an overlapped rollout), `sync(version) -> SyncReport`, `state()` /
`load_state(...)` for checkpoints and `close()`. `LocalPlanes` keeps everything in this process; `RayPlanes`
(`twinplane.cluster.ray_planes`) places training ranks and engines as Ray actors.
"""

from __future__ import annotations

import copy

import torch

from twinplane import platform
from twinplane.config import Config
from twinplane.model import Transformer
from twinplane.model.lora import cast_base, merge_lora
from twinplane.rollout import MultiTurnRollout, RolloutEngine, build_tools
from twinplane.sync import SyncReport, sync_in_process
from twinplane.tokenizer import Tokenizer
from twinplane.train import Reference, Trainer
from twinplane.train.optim import load_named_optimizer_state, named_optimizer_state


class WorkerError(RuntimeError):
    """A worker died or stopped answering; the message names it."""


def build_rollout(cfg: Config, engine: RolloutEngine, tokenizer: Tokenizer):
    if not cfg.rollout.tools:
        return engine
    return MultiTurnRollout(engine, tokenizer, build_tools(cfg.rollout.tools), cfg.rollout.max_turns)


def reference_is_base(cfg: Config) -> bool:
    """LoRA with a KL term: the reference is the policy's own base with the adapters off (no second model)."""
    return cfg.train.lora.rank > 0 and cfg.algo.kl_coef > 0


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
        self.engine = RolloutEngine(engine_model(cfg, model), tokenizer.eos_token_id, tokenizer.pad_token_id,
                                    r.max_num_seqs, seed=cfg.seed)
        self.rollout = build_rollout(cfg, self.engine, tokenizer)
        self.trainer = Trainer(model, t, cfg.algo, r.temperature, total_steps, tis_cap=tis_cap)
        if reference_is_base(cfg):
            reference = model
        self.reference = None if reference is None else Reference(
            reference, r.temperature, t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch)

    def sync(self, version: int) -> SyncReport:
        return sync_in_process(self.engine, self.trainer, version)

    def state(self) -> dict:
        """Policy weights are the trainer's model itself here (None: nothing to copy)."""
        tr = self.trainer
        return {"policy": None, "optimizer": named_optimizer_state(tr.model, tr.opt),
                "scheduler": tr.sched.state_dict(), "engine_rng": [self.engine.generator.get_state()],
                "weight_version": self.engine.weight_version}

    def load_state(self, optimizer: dict, scheduler: dict, engine_rng: list[torch.Tensor], version: int) -> None:
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

"""Typed run configuration: YAML (safe-loaded) + dotted `key.sub=value` overrides, validated before any work.

Each section is a flat dataclass; every field's comment is its help text (`twinplane train --help` prints them).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import keyword
import math
import os
import re
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from twinplane.algos import AGG_MODES, ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, PRESETS
from twinplane.errors import InputError
from twinplane.model.lora import TARGETS as LORA_TARGETS

PLAIN_FIELDS = ("prompt", "raw_prompt", "suffix", "system")  # data.plain_template's fields


def plain_template_problem(template: str) -> str | None:
    """What is wrong with a plain template, or None. Found by parsing, never by rendering: a width such as
    `{prompt:>99999999999}` would allocate that many characters. Fields are substituted as they are: no
    positional `{}`, no `{prompt.attr}` or `{prompt[0]}` access, no conversions or format specs."""
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        return f"is not a str.format template ({e})"
    for name, conv, spec in fields:
        if name not in PLAIN_FIELDS:
            return (f"field {{{name}}} is not one of {', '.join('{' + f + '}' for f in PLAIN_FIELDS)} "
                    "(use {{ }} for literal braces)")
        if conv or spec:
            written = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            return (f"field {written} has a {'conversion' if conv else 'format spec'}: fields are substituted as "
                    f"they are, write {{{name}}}")
    if not any(name in ("prompt", "raw_prompt") for name, _, _ in fields):
        return "has no {prompt} field (the record's prompt would be left out)"
    return None


class ConfigError(InputError):
    """A bad config: the message names the key and is printed as one line."""


@dataclass
class ModelSection:
    path: str | None = None  # HF model folder (config.json + safetensors + tokenizer); unset = tiny demo model
    hidden_size: int = 128  # demo model only
    num_layers: int = 4  # demo model only
    num_heads: int = 4  # demo model only
    num_kv_heads: int = 2  # demo model only
    intermediate_size: int = 512  # demo model only
    num_experts: int = 0  # demo model only: > 0 builds a Qwen3-MoE-style policy with this many experts per layer
    num_experts_per_tok: int = 2  # demo MoE only: experts each token runs (top-k)
    moe_intermediate_size: int = 128  # demo MoE only: each expert's hidden size
    dtype: str = "float32"  # training-plane dtype (master weights)
    rollout_dtype: str | None = None  # engine dtype; unset = bfloat16 on GPUs when dtype is float32, else dtype


@dataclass
class DataSection:
    train_file: str | None = None  # JSONL, Parquet or a saved `datasets` folder; unset = the built-in task
    val_file: str | None = None  # held-out prompts for evaluation (the built-in task has its own)
    prompt_field: str = "question"  # field holding the prompt (a string or a list of chat messages)
    answer_field: str = "answer"  # field holding the reference answer
    system_field: str | None = None  # per-record system prompt
    template: str = "auto"  # chat | plain | auto (chat when the tokenizer has a chat template)
    plain_template: str = "{prompt}"  # for template=plain: text with {prompt} {raw_prompt} {suffix} {system} fields
    system_prompt: str | None = None  # system message for every prompt
    instruction_suffix: str | None = None  # appended to each question, e.g. asking for '#### <answer>'
    max_prompt_tokens: int = 512  # longer prompts are dropped and counted, never truncated
    on_error: str = "fail"  # fail | skip (malformed lines)
    val_size: int = 0  # evaluate on the first N validation prompts (0 = all)


@dataclass
class RewardSection:
    name: str = "exact_int"  # gsm8k | math | exact_match | exact_int | module:function | path/file.py:function
    options: dict = field(default_factory=dict)  # keyword options for the function, e.g. {mode: strict}
    format_weight: float = 0.0  # bonus for a well-formatted answer ('#### N', \boxed{})
    timeout_s: float = 10.0  # per sample (per call for batched functions); late samples score 0, in reward/errors
    step_timeout_s: float = 300.0  # scoring deadline per step: unfinished samples score 0 (reward/timeouts); 0 = off
    partial: bool = False  # code reward: the fraction of tests passed instead of 1 only when all pass
    model: str | None = None  # local sequence-classification reward model folder
    model_weight: float = 1.0  # weight of the reward model's score in the reward


@dataclass
class TaskSection:
    name: str = "arithmetic"  # built-in synthetic task, used when data.train_file is unset
    digits: int = 2  # operand digits: a + b with 0 <= a, b < 10**digits
    heldout_size: int = 500  # problems held out of all training, for evaluation
    teacher_carry_error: float = 0.6  # warm-start teacher drops each carry with this probability


@dataclass
class WarmStartSection:
    steps: int = 600  # supervised steps on teacher answers before RL (0 = skip)
    batch_size: int = 128  # sequences per supervised step
    lr: float = 2e-3  # peak learning rate (cosine to 10%)


@dataclass
class RolloutSection:
    prompts_per_step: int = 32  # prompts per RL step
    n: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 8  # response length limit
    min_new_tokens: int = 0  # EOS is suppressed before this many tokens
    max_num_seqs: int = 512  # cap on the engine's running sequences (a request's n samples count n)
    max_num_batched_tokens: int = 4096  # tokens per engine forward (decodes + prefill chunks); >= max_num_seqs
    kv_cache_gb: float = 0.0  # KV block pool budget in GiB; 0 = automatic (GPU: gpu_memory_utilization, CPU: 1 GiB)
    gpu_memory_utilization: float = 0.9  # automatic KV budget on GPUs: this fraction of the memory free after weights
    graphs: bool = True  # decode steps as CUDA/HIP graphs at bucketed batch sizes where the device can (false = eager)
    graph_max_batch: int = 0  # largest captured decode batch (0 = max_num_seqs); larger decode steps run eagerly
    batch_invariant: bool = False  # CPU fp32: every engine GEMM via oneDNN, whose rows do not depend on the batch
    kernels: str = "auto"  # decode-path kernels: auto (Triton on GPUs where its self-check passes) | triton | torch
    tools: list[str] = field(default_factory=list)  # calculator | python: multi-turn tool calls
    max_turns: int = 1  # model turns per sample when tools are on
    tp: int = 1  # tensor-parallel size of one engine (1 in this version: engines are data parallel)
    record_routing: bool = False  # MoE: record each token's experts per sparse layer (for algo.routing_replay)
    lora_merge: bool = False  # with train.lora: engines hold merged weights (base-speed decode, full sync)


@dataclass
class LoraSection:
    rank: int = 0  # LoRA rank r (0 = off: full fine-tuning); the base is frozen, only the adapters train
    alpha: float = 32.0  # LoRA alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (training forwards only)
    targets: str = "all"  # all (every attention and MLP linear) or a comma list, e.g. q_proj,v_proj


@dataclass
class TrainSection:
    steps: int = 150  # RL steps
    lr: float = 1e-4  # AdamW learning rate
    warmup_steps: int = 0  # linear warmup steps
    schedule: str = "constant"  # constant | cosine (after warmup)
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas, each in [0, 1)
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    micro_batch_size: int = 128  # sequences per forward/backward; accumulation never changes the result
    mini_batches: int = 1  # optimizer steps per rollout batch (>1 makes the PPO clip matter)
    max_tokens_per_micro_batch: int = 0  # token budget per micro-batch (real tokens when packed, else padded); 0 = off
    packing: bool = True  # padding-free micro-batches: sequences back to back, varlen attention, balanced by tokens
    share_prompts: bool = True  # packed: rows with the same prompt share one copy of it per micro-batch (computed once)
    logprob_chunk_tokens: int = 512  # tokens per LM-head chunk in log-probs/entropy (memory ~ this x vocab)
    compute_dtype: str = "auto"  # auto (bf16 on GPUs, else model.dtype) | float32 | bfloat16 | float16
    activation_checkpointing: bool = False  # recompute each decoder block in backward: less memory, ~30% more compute
    optimizer_offload: bool = False  # keep AdamW state in host memory between updates (frees device memory)
    router_aux_loss_coef: float = 0.0  # MoE: weight of the load-balancing loss (transformers' formula; 0 = off)
    lora: LoraSection = field(default_factory=LoraSection)  # train.lora.*: low-rank adapters instead of all weights


@dataclass
class AlgoSection:
    name: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gspo | dapo | ppo: a preset
    adv_estimator: str | None = None  # grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae (critic); unset=preset
    norm_adv_by_std: bool | None = None  # grpo estimator: divide by the group std (false = Dr.GRPO); unset = preset
    policy_loss: str | None = None  # ppo (token ratio) | gspo (sequence ratio); unset = preset
    loss_agg: str | None = None  # token-mean | seq-mean-token-mean | seq-mean-token-sum[-norm]; unset = preset
    loss_agg_horizon: int = 0  # seq-mean-token-sum-norm's constant divisor (0 = rollout.max_new_tokens)
    clip_low: float | None = None  # ratio clip below 1: 1 - clip_low (unset = preset: 0.2; gspo 3e-4)
    clip_high: float | None = None  # ratio clip above 1: 1 + clip_high (unset = preset: 0.28 clip-higher; ppo 0.2)
    clip_c: float = 0.0  # dual-clip bound on the loss of negative-advantage tokens (0 = off; typical 3)
    gamma: float = 1.0  # discount of token rewards (reinforce_pp, gae)
    lam: float = 1.0  # GAE lambda
    kl_coef: float = 0.0  # KL-to-reference loss weight (0 = no reference model unless kl_in_reward)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (low_var_kl) | abs, for the KL loss term
    kl_in_reward: bool = False  # PPO-RLHF: subtract kl_reward_coef * (log pi_old - log pi_ref) from token rewards
    kl_reward_coef: float = 0.001  # (initial) coefficient of the KL in the reward
    kl_ctrl: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019: steers the mean sequence KL to kl_target)
    kl_target: float = 0.1  # adaptive KL controller: target KL per sequence
    kl_horizon: float = 10000.0  # adaptive KL controller: horizon in samples
    entropy_coef: float = 0.0  # entropy bonus weight
    recompute_old_logprobs: bool = False  # score old log-probs with the trainer instead of using the engine's
    tis_cap: float = 2.0  # cluster.async: truncated importance-sampling cap on pi_old / pi_rollout per token
    dynamic_sampling: bool | None = None  # DAPO: train only on groups whose rewards differ, generating more batches
    max_gen_batches: int = 10  # dynamic sampling: at most this many prompt batches generated per step
    overlong_buffer: int | None = None  # DAPO shaping over the last N tokens before the cap (0 = off; -1 = a fifth)
    overlong_penalty: float = 1.0  # overlong shaping: the reward penalty at rollout.max_new_tokens
    mask_truncated: bool = False  # leave samples cut off at rollout.max_new_tokens out of the loss
    routing_replay: bool = False  # MoE: trainer and reference run the engine's recorded experts (R3)

    def __post_init__(self):
        """Keys left unset take the preset's value (an unknown name is reported by `Config.validate`)."""
        preset = PRESETS.get(self.name)
        for key, value in (preset.values.items() if preset else ()):
            if getattr(self, key) is None:
                setattr(self, key, value)


@dataclass
class CriticSection:
    model_path: str | None = None  # value model's decoder (HF folder); unset = the policy's starting weights
    lr: float = 1e-4  # critic AdamW learning rate (constant)
    warmup_steps: int = 0  # first RL steps in which only the critic trains (the actor waits)
    value_clip: float = 0.5  # value-loss clipping: new values within old values +- this
    grad_clip: float = 1.0  # max critic grad norm (0 = off)


@dataclass
class EvalSection:
    before: bool = True  # evaluate before the first RL step (logged as step 0)
    after: bool = True  # evaluate after the last step
    every: int = 0  # also every N steps (0 = never), logged as val/*
    n: int = 1  # samples per prompt for pass@k / mean@k (1 = greedy only)
    temperature: float = 1.0  # for the sampled evaluation


@dataclass
class CheckpointSection:
    every: int = 50  # steps between checkpoints in RUN_DIR/checkpoints (0 = only on preemption); also at the end
    keep: int = 2  # newest complete checkpoints kept


@dataclass
class LogSection:
    progress: bool = True  # progress on the console: one live line on a terminal, else a line every log.every steps
    every: int = 10  # without a terminal, print the progress line every N steps (and the last)
    backends: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard, wandb
    wandb_project: str = "twinplane"  # W&B project name
    wandb_mode: str = "offline"  # offline | online | disabled


@dataclass
class ClusterSection:
    backend: str = "local"  # local (one process) | ray (training ranks and rollout engines as Ray actors)
    address: str | None = None  # Ray cluster to join ("auto" after `ray start`); unset = start a local one
    train_devices: int = 1  # training ranks (FSDP2 data parallel), one device each
    rollout_devices: int = 1  # rollout engines (data parallel), one device each; = train_devices when colocated
    critic_devices: int = 0  # PPO critic on Ray: 0 = sharded over the training ranks; K = K critic ranks of its own
    colocate: bool = False  # true: each training rank also hosts an engine and time-shares its device
    async_: bool = False  # (key cluster.async) roll out step k+1 while step k trains: one-step off-policy
    timeout_s: float = 600.0  # collectives and worker calls; a worker silent this long stops the run
    sync_bucket_mb: int = 256  # weight-sync bucket size (MB of engine-dtype weights per broadcast)
    cpus_per_worker: int = 1  # Ray CPUs per worker (and its torch threads)


@dataclass
class Config:
    seed: int = 0  # seeds every RNG; a seeded CPU run is bitwise reproducible
    device: str = "auto"  # auto | cpu | cuda | cuda:N (ROCm GPUs are "cuda" too)
    threads: int = 0  # torch CPU threads (0 = torch's default)
    run_dir: str | None = None  # default runs/<timestamp>
    sandbox: str = "bwrap"  # bwrap | unsafe-local (no isolation): where the python tool and the code reward run
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    task: TaskSection = field(default_factory=TaskSection)
    warmstart: WarmStartSection = field(default_factory=WarmStartSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    critic: CriticSection = field(default_factory=CriticSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)

    def validate(self) -> None:
        if self.algo.name not in PRESETS:  # before the checks below read the preset's (unset) keys
            raise ConfigError(f"algo.name: must be one of {', '.join(PRESETS)}, got {self.algo.name!r}")
        for key in _all_keys(Config):  # no setting means anything at inf or NaN (limits that can be off use 0)
            value = _get(self, key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        if (problem := plain_template_problem(self.data.plain_template)) is not None:
            raise ConfigError(f"data.plain_template: {problem}")
        checks = [
            (self.rollout.n >= 1, "rollout.n", "must be >= 1"),
            (self.rollout.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1"),
            (self.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1"),
            (self.rollout.temperature >= 0, "rollout.temperature", "must be >= 0"),
            (0 < self.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]"),
            (self.train.steps >= 0, "train.steps", "must be >= 0"),
            (self.train.lr > 0, "train.lr", "must be > 0"),
            (self.train.schedule in ("constant", "cosine"), "train.schedule", "must be constant or cosine"),
            (len(self.train.betas) == 2, "train.betas", "must be two numbers"),
            (self.train.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1"),
            (self.train.mini_batches >= 1, "train.mini_batches", "must be >= 1"),
            (self.rollout.prompts_per_step % self.train.mini_batches == 0, "train.mini_batches",
             "must divide rollout.prompts_per_step (mini-batches hold whole groups)"),
            (self.algo.adv_estimator in ESTIMATORS, "algo.adv_estimator", f"must be one of {', '.join(ESTIMATORS)}"),
            (self.algo.policy_loss in POLICY_LOSSES, "algo.policy_loss", f"must be one of {', '.join(POLICY_LOSSES)}"),
            (self.algo.loss_agg in AGG_MODES, "algo.loss_agg", f"must be one of {', '.join(AGG_MODES)}"),
            (self.algo.loss_agg_horizon >= 0, "algo.loss_agg_horizon", "must be >= 0"),
            (0 <= self.algo.clip_low < 1, "algo.clip_low", "must be in [0, 1)"),
            (self.algo.clip_high >= 0, "algo.clip_high", "must be >= 0"),
            (self.algo.clip_c == 0 or self.algo.clip_c > 1, "algo.clip_c", "must be 0 (off) or > 1"),
            (0 <= self.algo.gamma <= 1 and 0 <= self.algo.lam <= 1, "algo", "needs gamma and lam in [0, 1]"),
            (self.algo.kl_estimator in KL_ESTIMATORS, "algo.kl_estimator",
             f"must be one of {', '.join(KL_ESTIMATORS)}"),
            (self.algo.kl_coef >= 0 and self.algo.kl_reward_coef >= 0, "algo", "needs kl_coef, kl_reward_coef >= 0"),
            (self.algo.kl_ctrl in ("fixed", "adaptive"), "algo.kl_ctrl", "must be fixed or adaptive"),
            (self.algo.kl_target > 0 and self.algo.kl_horizon > 0, "algo", "needs kl_target > 0 and kl_horizon > 0"),
            (self.algo.max_gen_batches >= 1, "algo.max_gen_batches", "must be >= 1"),
            (not self.algo.dynamic_sampling or self.rollout.n >= 2, "algo.dynamic_sampling",
             "needs rollout.n >= 2 (it keeps groups whose rewards differ)"),
            (not (self.algo.dynamic_sampling and self.cluster.async_), "algo.dynamic_sampling",
             "does not combine with cluster.async (the next batch is submitted before this one is filtered)"),
            (-1 <= self.algo.overlong_buffer < self.rollout.max_new_tokens, "algo.overlong_buffer",
             "must be -1 (a fifth of rollout.max_new_tokens), 0 (off) or less than rollout.max_new_tokens"),
            (self.critic.lr > 0 and self.critic.warmup_steps >= 0 and self.critic.value_clip > 0
             and self.critic.grad_clip >= 0, "critic",
             "needs lr > 0, warmup_steps >= 0, value_clip > 0 and grad_clip >= 0"),
            (self.cluster.critic_devices >= 0, "cluster.critic_devices", "must be >= 0 (0 = on the training ranks)"),
            (self.cluster.critic_devices == 0 or self.algo.adv_estimator == "gae", "cluster.critic_devices",
             "must be 0 without a critic (algo.adv_estimator=gae)"),
            (self.cluster.critic_devices == 0 or self.cluster.backend == "ray", "cluster.critic_devices",
             "needs cluster.backend=ray (a local run keeps the critic in its process)"),
            (self.rollout.prompts_per_step * self.rollout.n // self.train.mini_batches >= self.cluster.critic_devices,
             "cluster.critic_devices", "must be <= the samples per mini-batch (every critic rank needs a sample)"),
            (self.task.name == "arithmetic", "task.name", "must be arithmetic"),
            (self.data.template in ("auto", "chat", "plain"), "data.template", "must be auto, chat or plain"),
            (self.data.on_error in ("fail", "skip"), "data.on_error", "must be fail or skip"),
            (self.data.max_prompt_tokens >= 1, "data.max_prompt_tokens", "must be >= 1"),
            (self.data.val_file is None or self.data.train_file is not None, "data.val_file",
             "needs data.train_file (the built-in task has its own held-out set)"),
            (self.reward.timeout_s > 0, "reward.timeout_s", "must be > 0"),
            (set(self.rollout.tools) <= {"calculator", "python"}, "rollout.tools", "must name calculator or python"),
            (self.sandbox in ("bwrap", "unsafe-local"), "sandbox", "must be bwrap or unsafe-local"),
            (set(self.log.backends) <= {"console", "jsonl", "tensorboard", "wandb"}, "log.backends",
             "must name console, jsonl, tensorboard or wandb"),
            (self.log.wandb_mode in ("offline", "online", "disabled"), "log.wandb_mode",
             "must be offline, online or disabled"),
            (self.checkpoint.every >= 0, "checkpoint.every", "must be >= 0"),
            (self.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1"),
            (self.rollout.max_turns >= 1, "rollout.max_turns", "must be >= 1"),
            (self.rollout.max_num_seqs >= 1, "rollout.max_num_seqs", "must be >= 1"),
            (self.rollout.max_num_batched_tokens >= self.rollout.max_num_seqs, "rollout.max_num_batched_tokens",
             "must be >= rollout.max_num_seqs (every running sequence decodes one token per step)"),
            (self.rollout.kv_cache_gb >= 0, "rollout.kv_cache_gb", "must be >= 0 (0 = automatic)"),
            (0 < self.rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]"),
            (0 <= self.rollout.graph_max_batch <= 1024, "rollout.graph_max_batch",
             "must be in 0..1024 (0 = max_num_seqs)"),
            (self.rollout.kernels in ("auto", "triton", "torch"), "rollout.kernels", "must be auto, triton or torch"),
            (self.eval.n >= 1 and self.eval.every >= 0, "eval", "needs eval.n >= 1 and eval.every >= 0"),
            (1 <= self.task.digits <= 6, "task.digits", "must be 1..6"),
            (0 <= self.task.teacher_carry_error <= 1, "task.teacher_carry_error", "must be in [0, 1]"),
            (self.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
             "must be float32, bfloat16 or float16"),
            (self.model.rollout_dtype in (None, "float32", "bfloat16", "float16"), "model.rollout_dtype",
             "must be float32, bfloat16 or float16"),
            (self.train.max_tokens_per_micro_batch >= 0, "train.max_tokens_per_micro_batch", "must be >= 0"),
            (self.train.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", "must be >= 1"),
            (self.train.compute_dtype in ("auto", "float32", "bfloat16", "float16"), "train.compute_dtype",
             "must be auto, float32, bfloat16 or float16"),
            (self.rollout.tp == 1, "rollout.tp", "must be 1 (tensor-parallel engines are not in this version)"),
            (self.algo.tis_cap >= 1, "algo.tis_cap", "must be >= 1"),
            (self.cluster.backend in ("local", "ray"), "cluster.backend", "must be local or ray"),
            (self.cluster.train_devices >= 1 and self.cluster.rollout_devices >= 1, "cluster",
             "needs train_devices >= 1 and rollout_devices >= 1"),
            (self.cluster.backend == "ray" or (self.cluster.train_devices, self.cluster.rollout_devices) == (1, 1),
             "cluster.backend", "must be ray for more than one training rank or engine"),
            (not self.cluster.colocate or self.cluster.rollout_devices in (1, self.cluster.train_devices),
             "cluster.rollout_devices", "must equal cluster.train_devices when colocated (one engine per rank)"),
            (self.cluster.timeout_s > 0 and self.cluster.sync_bucket_mb >= 1 and self.cluster.cpus_per_worker >= 1,
             "cluster", "needs timeout_s > 0, sync_bucket_mb >= 1 and cpus_per_worker >= 1"),
            (self.rollout.prompts_per_step * self.rollout.n // self.train.mini_batches >= self.cluster.train_devices,
             "cluster.train_devices", "must be <= the samples per mini-batch (every rank needs a sample)"),
            (not (self.cluster.async_ and self.rollout.tools), "cluster.async", "does not support rollout.tools yet"),
            (self.model.num_experts >= 0 and 1 <= self.model.num_experts_per_tok and self.model.moe_intermediate_size
             >= 1, "model", "needs num_experts >= 0, num_experts_per_tok >= 1 and moe_intermediate_size >= 1"),
            (self.model.num_experts == 0 or self.model.num_experts_per_tok <= self.model.num_experts,
             "model.num_experts_per_tok", "must be <= model.num_experts"),
            (self.train.router_aux_loss_coef >= 0, "train.router_aux_loss_coef", "must be >= 0"),
            (not self.algo.routing_replay or self.rollout.record_routing, "algo.routing_replay",
             "needs rollout.record_routing=true (the engine's record is what is replayed)"),
            (not (self.rollout.record_routing and self.rollout.tools), "rollout.record_routing",
             "does not support rollout.tools yet"),
            (self.train.lora.rank >= 0, "train.lora.rank", "must be >= 0 (0 = off)"),
            (self.train.lora.alpha > 0, "train.lora.alpha", "must be > 0"),
            (0 <= self.train.lora.dropout < 1, "train.lora.dropout", "must be in [0, 1)"),
            (self.train.lora.targets == "all" or set(self.train.lora.targets.split(",")) <= set(LORA_TARGETS),
             "train.lora.targets", f"must be all or a comma list of {','.join(LORA_TARGETS)}"),
            (not (self.train.lora.dropout > 0 and self.train.activation_checkpointing), "train.lora.dropout",
             "must be 0 with train.activation_checkpointing (the recomputed block would draw other dropout masks)"),
            (not self.rollout.lora_merge or self.train.lora.rank > 0, "rollout.lora_merge",
             "needs train.lora.rank > 0"),
            (not self.rollout.tools or self.model.path, "rollout.tools",
             "needs model.path (the built-in demo's digit vocabulary cannot spell tool calls)"),
            # ranges and choices of every remaining key, then keys that depend on each other
            (0 <= self.seed < 2**32, "seed", "must be in [0, 2**32)"),
            (_DEVICE.fullmatch(self.device) is not None, "device", "must be auto, cpu, cuda or cuda:N"),
            (0 <= self.threads <= 4096, "threads", "must be >= 0 (0 = torch's default)"),
            (self.run_dir is None or self.run_dir.strip() != "", "run_dir", "must not be empty"),
            (self.model.path is None or self.model.path.strip() != "", "model.path", "must not be empty"),
            (min(self.model.hidden_size, self.model.num_layers, self.model.intermediate_size) >= 1, "model",
             "needs hidden_size, num_layers and intermediate_size >= 1"),
            (self.model.num_heads >= 1 and self.model.num_kv_heads >= 1, "model.num_heads",
             "must be >= 1 (and model.num_kv_heads too)"),
            (self.model.num_heads % self.model.num_kv_heads == 0, "model.num_kv_heads", "must divide model.num_heads"),
            (self.model.hidden_size % self.model.num_heads == 0, "model.hidden_size",
             "must be a multiple of model.num_heads"),
            (self.model.hidden_size // self.model.num_heads % 2 == 0, "model.hidden_size",
             "/ model.num_heads (the head size) must be even for rotary embeddings"),
            (self.data.train_file is None or self.data.train_file.strip() != "", "data.train_file",
             "must not be empty"),
            (self.data.prompt_field != "" and self.data.answer_field != "", "data.prompt_field",
             "and data.answer_field must not be empty"),
            (self.data.val_size >= 0, "data.val_size", "must be >= 0 (0 = all)"),
            (self.reward.name.strip() != "", "reward.name", "must not be empty"),
            (self.reward.step_timeout_s >= 0, "reward.step_timeout_s", "must be >= 0 (0 = no deadline)"),
            (self.task.heldout_size >= 1, "task.heldout_size", "must be >= 1"),
            (self.task.heldout_size < 100**min(max(self.task.digits, 1), 6), "task.heldout_size",
             "must leave training problems (there are 100**task.digits in all)"),
            (self.warmstart.steps >= 0, "warmstart.steps", "must be >= 0"),
            (self.warmstart.batch_size >= 1, "warmstart.batch_size", "must be >= 1"),
            (self.warmstart.lr > 0, "warmstart.lr", "must be > 0"),
            (self.rollout.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)"),
            (self.rollout.min_new_tokens >= 0, "rollout.min_new_tokens", "must be >= 0"),
            (self.rollout.min_new_tokens <= self.rollout.max_new_tokens, "rollout.min_new_tokens",
             "must be <= rollout.max_new_tokens"),
            (len(set(self.rollout.tools)) == len(self.rollout.tools), "rollout.tools", "must not repeat a tool"),
            # one sample per prompt has no group to compare with: every advantage is 0 and nothing is learned
            (self.rollout.n >= 2 or self.train.steps == 0 or self.algo.adv_estimator in ("gae", "reinforce_pp"),
             "rollout.n", f"must be >= 2: {self.algo.adv_estimator}'s group baseline makes every advantage 0 with "
             "one sample per prompt"),
            (self.train.warmup_steps >= 0, "train.warmup_steps", "must be >= 0"),
            (0 <= self.train.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]"),
            (self.train.weight_decay >= 0, "train.weight_decay", "must be >= 0"),
            (all(0 <= b < 1 for b in self.train.betas), "train.betas", "must each be in [0, 1)"),
            (self.train.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 = off)"),
            (self.algo.entropy_coef >= 0, "algo.entropy_coef", "must be >= 0"),
            (self.eval.temperature >= 0, "eval.temperature", "must be >= 0"),
            (self.eval.n == 1 or self.eval.temperature > 0, "eval.temperature",
             "must be > 0 when eval.n > 1 (greedy samples are all the same)"),
            (self.log.wandb_project.strip() != "", "log.wandb_project", "must not be empty"),
            (self.log.every >= 1, "log.every", "must be >= 1"),
        ]
        for ok, key, msg in checks:
            if not ok:
                value = _get(self, key)
                raise ConfigError(f"{key}: {msg}" + ("" if dataclasses.is_dataclass(value) else f", got {value!r}"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self, dict_factory=lambda kv: {_key(k): v for k, v in kv})


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _attr(key: str) -> str:
    """The dataclass field behind a config key: Python keywords (`async`) get a trailing underscore."""
    return key + "_" if keyword.iskeyword(key) else key


def _key(name: str) -> str:
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, _attr(part))
    return cfg


@functools.cache
def _all_keys(cls, prefix="") -> tuple[str, ...]:
    keys, hints = [], typing.get_type_hints(cls)  # (resolving the hints is the slow part: once per class)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        keys += _all_keys(t, f"{prefix}{f.name}.") if dataclasses.is_dataclass(t) else [prefix + _key(f.name)]
    return tuple(keys)


def _coerce(value, t, key: str):
    """Check/convert one value to the annotated type; YAML and CLI strings both arrive here."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if t is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if t is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if t is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {t}")


# What a bare name most likely means, and other RL trainers' names (TRL, verl) -> (twinplane's key, a note where
# the meaning differs).
_UPPER = "algo.clip_high bounds the ratio above 1"
ALIASES = {
    "steps": ("train.steps", ""), "lr": ("train.lr", ""), "temperature": ("rollout.temperature", ""),
    "n": ("rollout.n", ""), "learning_rate": ("train.lr", ""), "max_steps": ("train.steps", ""),
    "total_training_steps": ("train.steps", ""),
    "num_train_epochs": ("train.steps", "twinplane counts RL steps, not epochs"),
    "total_epochs": ("train.steps", "twinplane counts RL steps, not epochs"),
    "per_device_train_batch_size": ("train.micro_batch_size", ""),
    "ppo_micro_batch_size_per_gpu": ("train.micro_batch_size", ""),
    "gradient_accumulation_steps": ("train.micro_batch_size", "micro-batches of this size are accumulated into "
                                    "each optimizer step"),
    "ppo_mini_batch_size": ("train.mini_batches", "a number of mini-batches per rollout batch, not a size"),
    "ppo_max_token_len_per_gpu": ("train.max_tokens_per_micro_batch", ""),
    "train_batch_size": ("rollout.prompts_per_step", ""), "num_generations": ("rollout.n", ""),
    "max_completion_length": ("rollout.max_new_tokens", ""), "max_response_length": ("rollout.max_new_tokens", ""),
    "response_length": ("rollout.max_new_tokens", ""), "max_prompt_length": ("data.max_prompt_tokens", ""),
    "beta": ("algo.kl_coef", ""), "kl_loss_coef": ("algo.kl_coef", ""), "kl_loss_type": ("algo.kl_estimator", ""),
    "use_kl_in_reward": ("algo.kl_in_reward", ""), "epsilon": ("algo.clip_low", _UPPER),
    "epsilon_high": ("algo.clip_high", ""), "clip_ratio": ("algo.clip_low", _UPPER),
    "clip_ratio_low": ("algo.clip_low", ""), "clip_ratio_high": ("algo.clip_high", ""),
    "clip_ratio_c": ("algo.clip_c", ""), "cliprange": ("algo.clip_low", _UPPER),
    "cliprange_value": ("critic.value_clip", ""), "entropy_coeff": ("algo.entropy_coef", ""),
    "loss_agg_mode": ("algo.loss_agg", ""), "loss_type": ("algo.name", ""),
    "scale_rewards": ("algo.norm_adv_by_std", ""), "norm_adv_by_std_in_grpo": ("algo.norm_adv_by_std", ""),
    "mask_truncated_completions": ("algo.mask_truncated", ""), "importance_sampling_level": ("algo.policy_loss", ""),
    "max_grad_norm": ("train.grad_clip", ""), "lr_scheduler_type": ("train.schedule", ""),
    "gradient_checkpointing": ("train.activation_checkpointing", ""),
    "enable_gradient_checkpointing": ("train.activation_checkpointing", ""), "bf16": ("train.compute_dtype", ""),
    "model_name_or_path": ("model.path", ""), "train_files": ("data.train_file", ""),
    "val_files": ("data.val_file", ""), "prompt_key": ("data.prompt_field", ""), "reward_funcs": ("reward.name", ""),
    "output_dir": ("run_dir", ""), "save_steps": ("checkpoint.every", ""), "save_freq": ("checkpoint.every", ""),
    "save_total_limit": ("checkpoint.keep", ""), "logging_steps": ("log.every", ""), "eval_steps": ("eval.every", ""),
    "test_freq": ("eval.every", ""), "val_before_train": ("eval.before", ""), "report_to": ("log.backends", ""),
    "vllm_gpu_memory_utilization": ("rollout.gpu_memory_utilization", ""),
    "tensor_model_parallel_size": ("rollout.tp", ""), "n_gpus_per_node": ("cluster.train_devices", ""),
    "lora_r": ("train.lora.rank", ""), "lora_rank": ("train.lora.rank", ""), "lora_alpha": ("train.lora.alpha", ""),
    "lora_dropout": ("train.lora.dropout", ""), "lora_target_modules": ("train.lora.targets", ""),
    "target_modules": ("train.lora.targets", ""),
}


def _did_you_mean(full: str) -> str:
    """The hint for an unknown key, first found of: twinplane's key with the same last part in a similar section; a
    near-typo in the same section; what a bare or another trainer's name means here; a close key anywhere."""
    keys = _all_keys(Config)
    section, _, leaf = full.rpartition(".")

    def near(key: str) -> float:  # how close a key's section is to the one written
        return difflib.SequenceMatcher(None, section, key.rpartition(".")[0]).ratio()

    same = sorted((k for k in keys if k.rpartition(".")[2] == leaf), key=near, reverse=True)
    alias, note = ALIASES.get(leaf, (None, ""))
    typo = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section],
                                     n=1, cutoff=0.8)
    if same and (near(same[0]) >= 0.6 or alias is None):
        hint = same[0]
    elif typo:
        hint = f"{section}.{typo[0]}" if section else typo[0]
    elif alias is not None:
        return f" (did you mean {alias}?{' ' + note if note else ''})"
    else:
        close = difflib.get_close_matches(full, keys, n=1, cutoff=0.6)
        hint = close[0] if close else ""
    return f" (did you mean {hint}?)" if hint else ""


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        full, key = prefix + str(key), _attr(str(key))
        if key not in hints:
            while isinstance(value, dict) and value:  # an unknown section: name the key as written (trian.steps)
                sub, value = next(iter(value.items()))
                full += f".{sub}"
            raise ConfigError(f"unknown key {full}{_did_you_mean(full)}")
        t = hints[key]
        kwargs[key] = _build(t, value, full + ".") if dataclasses.is_dataclass(t) else _coerce(value, t, full)
    return cls(**kwargs)


# Keys naming files or folders to read. Relative paths in a config file are taken from the file's folder (so an
# example runs from any directory), on the command line from the current one; ${VAR} is read from the environment.
# They are kept absolute: errors, the run's config.yaml and a resume from elsewhere all name the same file.
PATH_KEYS = ("model.path", "data.train_file", "data.val_file", "reward.model", "critic.model_path")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _absolute(value, key: str, base: Path):
    """An input path made absolute against `base`, after ${VAR} (a relative value of the variable counts from the
    current directory) and ~; a reward.name file spec (path/file.py:function) has its path part made absolute."""
    if not isinstance(value, str) or not value.strip():
        return value  # a wrong type or an empty path is `_coerce`'s and `validate`'s to report

    def env(m: re.Match) -> str:
        if m[1] not in os.environ:
            raise ConfigError(f"{key}: {value} uses ${{{m[1]}}}, which is not set in the environment")
        return os.path.abspath(os.path.expanduser(os.environ[m[1]]))

    text = _VAR.sub(env, value)
    target, sep, function = text.rpartition(":") if key == "reward.name" else (text, "", "")
    if key == "reward.name" and not (target.endswith(".py") or "/" in target):  # a built-in or module:function
        return text
    return os.path.normpath(base / os.path.expanduser(target)) + sep + function


def _absolute_paths(data: dict, base: Path, skip: set[str]) -> None:
    """`_absolute` on the input paths of a config file's sections but `skip`, in place."""
    for key in (*PATH_KEYS, "reward.name"):
        section, leaf = key.split(".")
        if key not in skip and isinstance(data.get(section), dict) and leaf in data[section]:
            data[section][leaf] = _absolute(data[section][leaf], key, base)


def _merge(base: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = base
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


def _is_text(dotted: str) -> bool:
    """Whether a key holds a string (or an optional string)."""
    cls: typing.Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        t = typing.get_type_hints(cls).get(_attr(part))
        if t is None:
            return False
        cls = t
    return cls is str or (typing.get_origin(cls) in (typing.Union, types.UnionType)
                          and set(typing.get_args(cls)) == {str, type(None)})


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} " + ("is a folder" if path.is_dir() else "not found"))
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    overridden = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        if _is_text(key.strip()):  # `data.system_prompt=Answer: briefly` stays a string (YAML would see a mapping)
            value = None if raw in ("null", "~") else raw
        else:
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
        if key.strip() in (*PATH_KEYS, "reward.name"):
            value = _absolute(value, key.strip(), Path.cwd())
            overridden.add(key.strip())
        _merge(data, key.strip(), value)
    if path is not None:  # the file's own paths (an overridden one may name an unset variable: it is not used)
        _absolute_paths(data, path.parent.absolute(), skip=overridden)
    cfg = _build(Config, data)
    cfg.validate()
    return cfg


def config_help() -> str:
    """Every key with its default and help comment, read from this file's source."""
    import inspect

    lines = []
    for name in _all_keys(Config):
        section, _, leaf = name.rpartition(".")
        cls = Config
        for part in filter(None, section.split(".")):  # nested sections (train.lora) walk down
            cls = typing.get_type_hints(cls)[_attr(part)]
        src = inspect.getsource(cls).splitlines()
        field_line = f"{_attr(leaf)}:"
        comment = next((s.split("#", 1)[1].strip() for s in src if s.strip().startswith(field_line) and "#" in s), "")
        default = _get(Config(), name)
        lines.append(f"  {name} = {default!r}" + (f"  # {comment}" if comment else ""))
    return "\n".join(lines)

"""The config's sections: each key with its type, default, help and range, and each section's rules across keys."""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from twinplane.algos import AGG_MODES, ESTIMATORS, IS_MASKS, IS_WEIGHTS, KL_ESTIMATORS, POLICY_LOSSES, PRESETS
from twinplane.config.keys import OneOf, Rule, Section, _get, _sections, _settings, opt, value_hint, value_problem
from twinplane.errors import InputError
from twinplane.model.lora import targets_problem as lora_targets_problem
from twinplane.rewards.registry import builtin_rewards, is_user_spec, precheck_user_spec

# Keys naming a registered thing: their choices are the registry's names whenever they are read (a name registered
# later, by a plugin or a test, is valid, in `--help` and in the hints), their help starts with the registry's notes.
AlgoName = Annotated[str, OneOf(PRESETS)]
Estimator = Annotated[str, OneOf(ESTIMATORS)]
PolicyLoss = Annotated[str, OneOf(POLICY_LOSSES)]
LossAgg = Annotated[str, OneOf(AGG_MODES)]
KLEstimator = Annotated[str, OneOf(KL_ESTIMATORS)]
ISWeight = Annotated[str, OneOf(IS_WEIGHTS)]
ISMask = Annotated[str, OneOf(IS_MASKS)]
RewardName = Annotated[str, OneOf(builtin_rewards, also=("module:function", "path/file.py:function"),
                                  accepts=is_user_spec)]
DType = Literal["float32", "bfloat16", "float16"]


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
class ModelSection(Section):
    path: str | None = opt(None, "HF model folder (config.json + safetensors + tokenizer); unset = tiny demo model")
    impl: Literal["auto", "native", "hf"] = opt(
        "auto", "auto (native for the families twinplane implements, else transformers' code) | native | hf "
        "(transformers' modeling code; docs/models.md)")
    hidden_size: int = opt(128, "demo model only", bounds=">= 1")
    num_layers: int = opt(4, "demo model only", bounds=">= 1")
    num_heads: int = opt(4, "demo model only", bounds=">= 1")
    num_kv_heads: int = opt(4, "demo model only", bounds=">= 1")
    intermediate_size: int = opt(512, "demo model only", bounds=">= 1")
    num_experts: int = opt(0, "demo model only: > 0 builds a Qwen3-MoE-style policy with this many experts per layer",
        bounds=">= 0")
    num_experts_per_tok: int = opt(2, "demo MoE only: experts each token runs (top-k)", bounds=">= 1")
    moe_intermediate_size: int = opt(128, "demo MoE only: each expert's hidden size", bounds=">= 1")
    dtype: DType = opt("float32", "training-plane dtype (master weights)")
    rollout_dtype: DType | None = opt(None, "engine dtype; unset = bfloat16 on GPUs when dtype is float32, else dtype")

    def rules(self, cfg: Config) -> list[Rule]:
        return [
            (self.path is None or self.path.strip() != "", "model.path", "must not be empty"),
            (self.impl != "hf" or self.path is not None, "model.impl",
             "hf needs model.path (the built-in demo model is native)"),
            (self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", f"must divide model.num_heads "
             f"({self.num_heads})",
             ("model.num_heads", f"must be a multiple of model.num_kv_heads ({self.num_kv_heads})")),
            (self.hidden_size % self.num_heads == 0, "model.hidden_size", f"must be a multiple of model.num_heads "
             f"({self.num_heads})", ("model.num_heads", f"must divide model.hidden_size ({self.hidden_size})")),
            (self.hidden_size // self.num_heads % 2 == 0, "model.hidden_size",
             "/ model.num_heads (the head size) must be even for rotary embeddings",
             ("model.num_heads", "must leave an even head size (model.hidden_size / model.num_heads) for rotary "
              "embeddings")),
            (self.num_experts == 0 or self.num_experts_per_tok <= self.num_experts, "model.num_experts_per_tok",
             "must be <= model.num_experts"),
        ]


@dataclass
class DataSection(Section):
    train_file: str | None = opt(None, "JSONL, Parquet or a saved `datasets` folder; unset = the built-in task")
    val_file: str | None = opt(None, "held-out prompts for evaluation (the built-in task has its own)")
    prompt_field: str = opt("question", "field holding the prompt (a string or a list of chat messages)")
    answer_field: str = opt("answer", "field holding the reference answer")
    system_field: str | None = opt(None, "per-record system prompt")
    template: Literal["auto", "chat", "plain"] = opt(
        "auto", "chat | plain | auto (chat when the tokenizer has a chat template)")
    plain_template: str = opt(
        "{prompt}", "for template=plain: text with {prompt} {raw_prompt} {suffix} {system} fields",
        check=plain_template_problem)
    system_prompt: str | None = opt(None, "system message for every prompt")
    instruction_suffix: str | None = opt(None, "appended to each question, e.g. asking for '#### <answer>'")
    max_prompt_tokens: int = opt(512, "longer prompts are dropped and counted, never truncated", bounds=">= 1")
    on_error: Literal["fail", "skip"] = opt("fail", "fail | skip (malformed lines)")
    val_size: int = opt(0, "evaluate on the first N validation prompts (0 = all)", bounds=">= 0 (0 = all)")

    def rules(self, cfg: Config) -> list[Rule]:
        return [
            (self.val_file is None or self.train_file is not None, "data.val_file",
             "needs data.train_file (the built-in task has its own held-out set)"),
            (self.train_file is None or self.train_file.strip() != "", "data.train_file", "must not be empty"),
            (self.prompt_field != "" and self.answer_field != "", "data.prompt_field",
             "and data.answer_field must not be empty"),
        ]


def judge_problem(value: str | None) -> str | None:
    """A judge is a URL or an existing model folder."""
    if value is None or value.startswith(("http://", "https://")):
        return None
    if not (Path(value) / "config.json").is_file():
        return f"{value} is neither an http(s) URL nor a model folder (no config.json)"
    return None


@dataclass
class RewardSection(Section):
    name: RewardName = opt("exact_int", "the reward: a built-in verifier or your function")
    options: dict = opt(help="keyword options for the function, e.g. {mode: strict}", factory=dict)
    format_weight: float = opt(0.0, "bonus for a well-formatted answer ('#### N', \\boxed{})")
    timeout_s: float = opt(10.0, "per sample (per call for batched functions); late samples score 0, in reward/errors",
        bounds="> 0")
    step_timeout_s: float = opt(
        300.0, "scoring deadline per step: unfinished samples score 0 (reward/timeouts); 0 = off",
        bounds=">= 0 (0 = no deadline)")
    partial: bool = opt(False, "code reward: the fraction of tests passed instead of 1 only when all pass")
    model: str | None = opt(None, "local sequence-classification reward model folder")
    model_weight: float = opt(1.0, "weight of the reward model's score in the reward")
    judge: str | None = opt(
        None, "LLM judge for a reward function that takes `judge`: an OpenAI-compatible base URL (http://.../v1) or "
        "a model folder the run serves itself (docs/data-rewards-eval.md)", check=judge_problem)
    judge_model: str | None = opt(None, "the judge's model name (default: the first its server lists)")
    judge_concurrency: int = opt(8, "judge requests at once", bounds=">= 1")
    judge_timeout_s: float = opt(60.0, "per judge request", bounds="> 0")
    judge_retries: int = opt(2, "retries of a judge request after a connection error, timeout or 5xx; then its "
        "judgement fails (reward.judge_failure_score)", bounds=">= 0")
    judge_failure_score: float | None = opt(
        None, "what a sample whose judgement failed scores (counted in reward/judge_failures); unset: the sample "
        "fails, scoring 0 in reward/errors")

    def rules(self, cfg: Config) -> list[Rule]:
        return [(self.name.strip() != "", "reward.name", "must not be empty")]


@dataclass
class TaskSection(Section):
    name: Literal["arithmetic"] = opt("arithmetic", "built-in synthetic task, used when data.train_file is unset")
    digits: int = opt(2, "operand digits: a + b with 0 <= a, b < 10**digits", bounds="1..6")
    heldout_size: int = opt(500, "problems held out of all training, for evaluation", bounds=">= 1")
    teacher_carry_error: float = opt(0.6, "warm-start teacher drops each carry with this probability", bounds="[0, 1]")

    def rules(self, cfg: Config) -> list[Rule]:
        return [(self.heldout_size < 100**self.digits, "task.heldout_size",
                 "must leave training problems (there are 100**task.digits in all)")]


@dataclass
class WarmStartSection(Section):
    steps: int = opt(600, "supervised steps on teacher answers before RL (0 = skip)", bounds=">= 0")
    batch_size: int = opt(128, "sequences per supervised step", bounds=">= 1")
    lr: float = opt(2e-3, "peak learning rate; the last 30% of the steps decay to 10% of it", bounds="> 0")
    target: float = opt(
        0.9, "the decay waits until greedy answers to this share of 256 carry-free training problems (where the "
        "teacher is exact) are right; 0 = no check", bounds="[0, 1]")
    max_steps: int = opt(0, "the most steps a waiting decay may stretch the warm start to (0 = 4 x warmstart.steps)",
        bounds=">= 0 (0 = 4 x warmstart.steps)")


@dataclass
class RolloutSection(Section):
    backend: Literal["twinplane", "vllm"] = opt(
        "twinplane", "twinplane (the own engine) | vllm (vLLM's engine; docs/vllm.md)")
    prompts_per_step: int = opt(32, "prompts per RL step", bounds=">= 1")
    n: int = opt(8, "samples per prompt (the GRPO group)", bounds=">= 1")
    temperature: float = opt(1.0, "0 = greedy", bounds=">= 0")
    top_p: float = opt(1.0, "nucleus sampling (1 = off)", bounds="(0, 1]")
    top_k: int = opt(0, "0 = off", bounds=">= 0 (0 = off)")
    max_new_tokens: int = opt(8, "response length limit", bounds=">= 1")
    min_new_tokens: int = opt(0, "EOS is suppressed before this many tokens", bounds=">= 0")
    max_num_seqs: int = opt(512, "cap on the engine's running sequences (a request's n samples count n)", bounds=">= 1")
    max_num_batched_tokens: int = opt(4096, "tokens per engine forward (decodes + prefill chunks); >= max_num_seqs")
    kv_cache_gb: float = opt(
        0.0, "KV block pool budget in GiB (a hybrid's recurrent states included); 0 = automatic (GPU: "
        "gpu_memory_utilization, CPU: 1 GiB)",
        bounds=">= 0 (0 = automatic)")
    gpu_memory_utilization: float = opt(
        0.9, "automatic KV budget on GPUs: this fraction of the memory free after weights", bounds="(0, 1]")
    graphs: bool = opt(
        True, "decode steps as CUDA/HIP graphs at bucketed batch sizes where the device can (false = eager)")
    graph_max_batch: int = opt(0, "largest captured decode batch (0 = max_num_seqs); larger decode steps run eagerly",
        bounds="0..1024 (0 = max_num_seqs)")
    run_ahead: bool = opt(True, "with decode graphs: launch each decode step before reading back the one before "
                          "(the host's work overlaps the device's)")
    batch_invariant: bool = opt(False, "CPU fp32: every engine GEMM via oneDNN, whose rows do not depend on the batch")
    kernels: Literal["auto", "triton", "torch"] = opt(
        "auto", "decode-path kernels: auto (Triton on GPUs where its self-check passes) | triton | torch")
    tools: list[Literal["calculator", "python"]] = opt(help="calculator | python: multi-turn tool calls", factory=list)
    max_turns: int = opt(1, "model turns per sample when tools are on", bounds=">= 1")
    record_routing: bool = opt(False, "MoE: record each token's experts per sparse layer (for algo.routing_replay)")
    lora_merge: bool = opt(False, "with train.lora: engines hold merged weights (base-speed decode, full sync)")
    partial: bool = opt(True, "asynchronous RL: samples in flight at a weight update continue under the new weights "
                        "(false: they start again)")

    @property
    def samples(self) -> int:
        """Samples per step: every prompt's group."""
        return self.prompts_per_step * self.n

    def rules(self, cfg: Config) -> list[Rule]:
        return [
            (self.max_num_batched_tokens >= self.max_num_seqs, "rollout.max_num_batched_tokens",
             "must be >= rollout.max_num_seqs (every running sequence decodes one token per step)"),
            (self.backend == "twinplane" or not cfg.cluster.max_staleness, "rollout.backend",
             "vllm rolls out synchronously in this version: cluster.max_staleness must be 0 (the asynchronous "
             "producer drives the own engine step by step)"),
            (not (self.record_routing and self.tools), "rollout.record_routing", "does not support rollout.tools yet"),
            (not self.lora_merge or cfg.train.lora.rank > 0, "rollout.lora_merge", "needs train.lora.rank > 0"),
            (not self.tools or cfg.model.path, "rollout.tools",
             "needs model.path (the built-in demo's digit vocabulary cannot spell tool calls)"),
            (self.min_new_tokens <= self.max_new_tokens, "rollout.min_new_tokens", "must be <= rollout.max_new_tokens"),
            (len(set(self.tools)) == len(self.tools), "rollout.tools", "must not repeat a tool"),
            (self.backend == "twinplane" or not self.record_routing, "rollout.backend",
             "must be twinplane for rollout.record_routing / algo.routing_replay (the vllm backend does not pass "
             "vLLM's routed experts on to the trainer)"),
            (self.backend == "twinplane" or not self.batch_invariant, "rollout.backend",
             "must be twinplane for rollout.batch_invariant (it is a property of the own engine's GEMMs)"),
            (self.backend == "twinplane" or cfg.train.lora.rank == 0 or self.lora_merge, "rollout.backend",
             "vllm with train.lora needs rollout.lora_merge=true (the engine receives merged weights)"),
            (self.backend == "twinplane" or self.temperature in (0, 1) or (self.top_k == 0 and self.top_p == 1),
             "rollout.backend", "vllm reports the log-probs the trainer scores (logits / T, no top-k/top-p) only at "
             "rollout.temperature 0 or 1, or without top-k/top-p"),
            # one sample per prompt has no group to compare with: every advantage is 0 and nothing is learned
            (self.n >= 2 or cfg.train.steps == 0 or cfg.algo.adv_estimator in ("gae", "reinforce_pp"), "rollout.n",
             f"must be >= 2: {cfg.algo.adv_estimator}'s group baseline makes every advantage 0 with one sample per "
             "prompt"),
        ]


@dataclass
class LoraSection(Section):
    rank: int = opt(0, "LoRA rank r (0 = off: full fine-tuning); the base is frozen, only the adapters train",
        bounds=">= 0 (0 = off)")
    alpha: float = opt(32.0, "LoRA alpha: the update is scaled by alpha / rank", bounds="> 0")
    dropout: float = opt(0.0, "dropout on the adapters' input (training forwards only)", bounds="[0, 1)")
    targets: str = opt("all", "all (every attention and MLP linear) or a comma list, e.g. q_proj,v_proj; with "
                       "model.impl=hf also PEFT's all-linear, any module names and re:REGEX (docs/models.md)")

    def rules(self, cfg: Config) -> list[Rule]:
        # the native decoder's names are checked here when the model is surely native; else at preflight
        problem = lora_targets_problem(self.targets, native=not cfg.model.path or cfg.model.impl == "native")
        return [
            (problem is None, "train.lora.targets", problem or "must be all, all-linear, re:REGEX or a comma list"),
            (not (self.dropout > 0 and cfg.train.activation_checkpointing), "train.lora.dropout",
             "must be 0 with train.activation_checkpointing (the recomputed block would draw other dropout masks)"),
        ]


@dataclass
class TrainSection(Section):
    steps: int = opt(150, "RL steps", bounds=">= 0")
    lr: float = opt(1e-4, "AdamW learning rate", bounds="> 0")
    warmup_steps: int = opt(0, "linear warmup steps", bounds=">= 0")
    schedule: Literal["constant", "cosine", "wsd"] = opt(
        "constant", "constant | cosine | wsd (after warmup; wsd: constant, then a cosine over the last 30% of steps)")
    min_lr_ratio: float = opt(0.1, "cosine floor, as a fraction of lr", bounds="[0, 1]")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay", bounds=">= 0")
    betas: list[float] = opt(help="AdamW betas, each in [0, 1)", factory=lambda: [0.9, 0.999], bounds="[0, 1)")
    grad_clip: float = opt(1.0, "max global grad norm (0 = off)", bounds=">= 0 (0 = off)")
    micro_batch_size: int = opt(128, "sequences per forward/backward; accumulation never changes the result",
        bounds=">= 1")
    mini_batches: int = opt(1, "optimizer steps per rollout batch (>1 makes the PPO clip matter)", bounds=">= 1")
    max_tokens_per_micro_batch: int = opt(
        0, "token budget per micro-batch (real tokens when packed, else padded); 0 = off", bounds=">= 0")
    packing: bool = opt(
        True, "padding-free micro-batches: sequences back to back, varlen attention, balanced by tokens")
    share_prompts: bool = opt(
        True, "packed: rows with the same prompt share one copy of it per micro-batch (computed once)")
    logprob_chunk_tokens: int = opt(0, "tokens per LM-head chunk in log-probs/entropy (memory ~ this x vocab); "
        "0 = auto (512 on CPU, 2048 on GPUs)", bounds=">= 0 (0 = auto)")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "auto (bf16 on GPUs, else model.dtype) | float32 | bfloat16 | float16")
    activation_checkpointing: bool = opt(
        False, "recompute each decoder block in backward: less memory, ~30% more compute")
    compile: Literal["auto", "on", "off"] = opt(
        "auto", "torch.compile each decoder layer for training forwards: auto (on for GPUs, off on CPU) | on | off")
    optimizer_offload: bool = opt(False, "keep AdamW state in host memory between updates (frees device memory)")
    router_aux_loss_coef: float = opt(0.0, "MoE: weight of the load-balancing loss (transformers' formula; 0 = off)",
        bounds=">= 0")
    lora: LoraSection = field(default_factory=LoraSection)  # train.lora.*: low-rank adapters instead of all weights

    def rules(self, cfg: Config) -> list[Rule]:
        return [
            (len(self.betas) == 2, "train.betas", "must be two numbers"),
            (cfg.rollout.prompts_per_step % self.mini_batches == 0, "train.mini_batches",
             "must divide rollout.prompts_per_step (mini-batches hold whole groups)"),
        ]


@dataclass
class AlgoSection(Section):
    name: AlgoName = opt("grpo", "a preset (the algo.* values it sets stay overridable)")
    adv_estimator: Estimator | None = opt(None, "the advantage estimator; unset = preset")
    norm_adv_by_std: bool | None = opt(
        None, "grpo estimator: divide by the group std (false = Dr.GRPO); unset = preset")
    policy_loss: PolicyLoss | None = opt(None, "the per-token policy loss; unset = preset")
    loss_agg: LossAgg | None = opt(None, "how the token losses make the loss; unset = preset")
    loss_agg_horizon: int = opt(0, "seq-mean-token-sum-norm's constant divisor (0 = rollout.max_new_tokens)",
        bounds=">= 0")
    clip_low: float | None = opt(None, "ratio clip below 1: 1 - clip_low (unset = preset: 0.2; gspo 3e-4)",
        bounds="[0, 1)")
    clip_high: float | None = opt(None, "ratio clip above 1: 1 + clip_high (unset = preset: 0.28 clip-higher; ppo 0.2)",
        bounds=">= 0")
    clip_c: float = opt(0.0, "dual-clip bound on the loss of negative-advantage tokens (0 = off; typical 3)")
    sapo_tau_pos: float = opt(1.0, "sapo: gate temperature of positive-advantage tokens", bounds="> 0")
    sapo_tau_neg: float = opt(1.05, "sapo: gate temperature of negative-advantage tokens", bounds="> 0")
    gamma: float = opt(1.0, "discount of token rewards (reinforce_pp, gae)", bounds="[0, 1]")
    lam: float = opt(1.0, "GAE lambda", bounds="[0, 1]")
    kl_coef: float = opt(0.0, "KL-to-reference loss weight (0 = no reference model unless kl_in_reward)", bounds=">= 0")
    kl_estimator: KLEstimator = opt("k3", "the KL loss term's estimator")
    kl_in_reward: bool = opt(False, "PPO-RLHF: subtract kl_reward_coef * (log pi_old - log pi_ref) from token rewards")
    kl_reward_coef: float = opt(0.001, "(initial) coefficient of the KL in the reward", bounds=">= 0")
    kl_ctrl: Literal["fixed", "adaptive"] = opt(
        "fixed", "fixed | adaptive (Ziegler et al. 2019: steers the mean sequence KL to kl_target)")
    kl_target: float = opt(0.1, "adaptive KL controller: target KL per sequence", bounds="> 0")
    kl_horizon: float = opt(10000.0, "adaptive KL controller: horizon in samples", bounds="> 0")
    entropy_coef: float = opt(0.0, "entropy bonus weight", bounds=">= 0")
    recompute_old_logprobs: bool | None = opt(
        None, "score old log-probs with the trainer (the decoupled objective's proximal policy) instead of using the "
        "engine's; unset: when they can differ (asynchronous RL, another rollout dtype). With train.mini_batches=1 "
        "they are the training forward's own (no separate forward) unless kl_in_reward or is_mask needs them first")
    tis_cap: float = opt(2.0, "off-policy correction (cluster.max_staleness >= 1, is_sync, or rollout.backend=vllm "
        "with recompute_old_logprobs): cap of the importance weight pi_old / pi_rollout", bounds=">= 1")
    is_weight: ISWeight = opt("token", "the off-policy correction's weight on r = pi_old / pi_rollout (token and "
        "sequence truncated at tis_cap)")
    is_mask: ISMask = opt("off", "the off-policy correction's band mask, dropping what leaves [is_low, is_high]")
    is_low: float = opt(0.5, "lower bound of the ratio band of is_mask and icepop", bounds="(0, 1]")
    is_high: float = opt(2.0, "upper bound of the ratio band of is_mask and icepop", bounds=">= 1")
    is_sync: bool = opt(False, "also correct synchronous runs (engine kernels/dtype) when old log-probs are recomputed")
    dynamic_sampling: bool | None = opt(
        None, "DAPO: train only on groups whose rewards differ, generating more batches")
    max_gen_batches: int = opt(10, "dynamic sampling: at most this many prompt batches generated per step",
        bounds=">= 1")
    overlong_buffer: int | None = opt(
        None, "DAPO shaping over the last N tokens before the cap (0 = off; -1 = a fifth)")
    overlong_penalty: float = opt(1.0, "overlong shaping: the reward penalty at rollout.max_new_tokens")
    mask_truncated: bool = opt(False, "leave samples cut off at rollout.max_new_tokens out of the loss")
    routing_replay: bool = opt(False, "MoE: trainer and reference run the engine's recorded experts (R3)")

    def __post_init__(self):
        """Keys left unset take the preset's value (an unknown name is reported by `Config.validate`)."""
        preset = PRESETS.get(self.name)
        for key, value in (preset.values.items() if preset else ()):
            if getattr(self, key) is None:
                setattr(self, key, value)

    def rules(self, cfg: Config) -> list[Rule]:
        return [
            (self.clip_c == 0 or self.clip_c > 1, "algo.clip_c", "must be 0 (off) or > 1"),
            (self.clip_c == 0 or self.policy_loss in ("ppo", "gspo"), "algo.clip_c",
             f"is the dual clip of policy_loss ppo and gspo (this one is {self.policy_loss})"),
            (self.is_low < self.is_high, "algo.is_low", "must be below algo.is_high"),
            (not self.dynamic_sampling or cfg.rollout.n >= 2, "algo.dynamic_sampling",
             "needs rollout.n >= 2 (it keeps groups whose rewards differ)"),
            (-1 <= self.overlong_buffer < cfg.rollout.max_new_tokens, "algo.overlong_buffer",
             "must be -1 (a fifth of rollout.max_new_tokens), 0 (off) or less than rollout.max_new_tokens"),
            (not self.routing_replay or cfg.rollout.backend == "twinplane", "algo.routing_replay",
             "needs rollout.backend=twinplane (the vllm backend does not pass vLLM's routed experts on)"),
            (not self.routing_replay or cfg.rollout.record_routing, "algo.routing_replay",
             "needs rollout.record_routing=true (the engine's record is what is replayed)"),
        ]


@dataclass
class CriticSection(Section):
    model_path: str | None = opt(None, "value model's decoder (HF folder); unset = the policy's starting weights")
    lr: float = opt(1e-4, "critic AdamW learning rate (constant)", bounds="> 0")
    warmup_steps: int = opt(0, "first RL steps in which only the critic trains (the actor waits)", bounds=">= 0")
    value_clip: float = opt(0.5, "value-loss clipping: new values within old values +- this", bounds="> 0")
    loss_agg: Literal["token-mean", "token-sum"] = opt("token-mean", "value-loss aggregation: token-mean | token-sum")
    grad_clip: float = opt(1.0, "max critic grad norm (0 = off)", bounds=">= 0")


@dataclass
class EvalSection(Section):
    before: bool = opt(True, "evaluate before the first RL step (logged as step 0)")
    after: bool = opt(True, "evaluate after the last step")
    every: int = opt(0, "also every N steps (0 = never), logged as val/*", bounds=">= 0")
    n: int = opt(1, "samples per prompt for pass@k / mean@k (1 = greedy only)", bounds=">= 1")
    temperature: float = opt(1.0, "for the sampled evaluation", bounds=">= 0")

    def rules(self, cfg: Config) -> list[Rule]:
        return [(self.n == 1 or self.temperature > 0, "eval.temperature",
                 "must be > 0 when eval.n > 1 (greedy samples are all the same)")]


@dataclass
class CheckpointSection(Section):
    every: int = opt(50, "steps between checkpoints in RUN_DIR/checkpoints (0 = only on preemption); also at the end",
        bounds=">= 0")
    keep: int = opt(2, "newest complete checkpoints kept", bounds=">= 1")
    format: Literal["auto", "full", "sharded"] = opt(
        "auto", "auto | full | sharded: full = the policy as an HF folder and full AdamW state, gathered through the "
        "driver; sharded = each training and critic rank writes its own shards (torch.distributed.checkpoint, "
        "loads onto any rank count; the run dir on storage every node sees); auto = sharded with more than one "
        "training rank")


@dataclass
class LogSection(Section):
    progress: bool = opt(
        True, "progress on the console: one live line on a terminal, else a line every log.every steps")
    every: int = opt(10, "without a terminal, print the progress line every N steps (and the last)", bounds=">= 1")
    backends: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = opt(
        help="+ tensorboard, wandb", factory=lambda: ["console", "jsonl"])
    wandb_project: str = opt("twinplane", "W&B project name")
    wandb_mode: Literal["offline", "online", "disabled"] = opt("offline", "offline | online | disabled")

    def rules(self, cfg: Config) -> list[Rule]:
        return [(self.wandb_project.strip() != "", "log.wandb_project", "must not be empty")]


@dataclass
class ClusterSection(Section):
    backend: Literal["local", "ray"] = opt(
        "local", "local (one process) | ray (training ranks and rollout engines as Ray actors)")
    address: str | None = opt(None, "Ray cluster to join (\"auto\" after `ray start`); unset = start a local one")
    train_devices: int = opt(1, "training ranks (FSDP2 data parallel), one device each", bounds=">= 1")
    rollout_devices: int = opt(1, "rollout engines (data parallel), one device each; = train_devices when colocated",
        bounds=">= 1")
    critic_devices: int = opt(
        0, "PPO critic on Ray: 0 = sharded over the training ranks; K = K critic ranks of its own",
        bounds=">= 0 (0 = on the training ranks)")
    colocate: bool = opt(False, "true: each training rank also hosts an engine and time-shares its device")
    max_staleness: int = opt(
        0, "asynchronous RL: policy versions a trained sample may lag (0 synchronous, 1 one-step off-policy, "
        "k >= 2 fully asynchronous; docs/async.md)", bounds=">= 0")
    async_schedule: int = opt(
        0, "asynchronous RL: engine steps each engine runs while a step trains, so that runs are reproducible "
        "(0: on Ray as long as training lasts, in one process none)", bounds=">= 0")
    timeout_s: float = opt(600.0, "collectives and worker calls; a worker silent this long stops the run", bounds="> 0")
    sync_bucket_mb: int = opt(256, "weight-sync bucket size (MB of engine-dtype weights per broadcast)", bounds=">= 1")
    cpus_per_worker: int = opt(1, "Ray CPUs per worker (and its torch threads)", bounds=">= 1")

    def rules(self, cfg: Config) -> list[Rule]:
        per_mini_batch = cfg.samples_per_mini_batch
        return [
            (self.critic_devices == 0 or cfg.algo.adv_estimator == "gae", "cluster.critic_devices",
             "must be 0 without a critic (algo.adv_estimator=gae)"),
            (self.critic_devices == 0 or self.backend == "ray", "cluster.critic_devices",
             "needs cluster.backend=ray (a local run keeps the critic in its process)"),
            (per_mini_batch >= self.critic_devices, "cluster.critic_devices",
             "must be <= the samples per mini-batch (every critic rank needs a sample)"),
            (self.backend == "ray" or (self.train_devices, self.rollout_devices) == (1, 1), "cluster.backend",
             "must be ray for more than one training rank or engine"),
            (not self.colocate or self.rollout_devices in (1, self.train_devices), "cluster.rollout_devices",
             "must equal cluster.train_devices when colocated (one engine per rank)"),
            (per_mini_batch >= self.train_devices, "cluster.train_devices",
             "must be <= the samples per mini-batch (every rank needs a sample)"),
        ]


def agent_problem(spec: str | None) -> str | None:
    """What is wrong with an agent spec that shows without running its code (the file, the module), or None."""
    try:
        if spec is not None:
            precheck_user_spec(spec, "agent")
    except ValueError as e:
        return str(e)
    return None


@dataclass
class AgentSection(Section):
    entrypoint: str | None = opt(
        None, "your agent, FILE.py:function or module:function: run(base_url, task) (def or async def) talks to the "
        "policy through the OpenAI API at base_url and returns its reward (docs/agents.md); unset = built-in rollout",
        check=agent_problem)
    concurrency: int = opt(64, "episodes in flight at once", bounds=">= 1")
    timeout_s: float = opt(300.0, "per episode: a later one is cancelled (its `abort(task)` runs if the agent's "
        "module has one) and counted in agent/timeouts", bounds="> 0")
    max_turns: int = opt(16, "model calls per episode; a call past them is refused", bounds=">= 1")

    def rules(self, cfg: Config) -> list[Rule]:
        if self.entrypoint is None:
            return []
        return [(cfg.cluster.backend == "local" or not cfg.cluster.colocate, "agent.entrypoint",
                 "on Ray needs engines of their own (cluster.colocate=false)"),
                (cfg.rollout.backend == "twinplane", "agent.entrypoint", "needs rollout.backend=twinplane"),
                (not cfg.algo.dynamic_sampling, "agent.entrypoint", "does not combine with algo.dynamic_sampling")]


@dataclass
class Config(Section):
    seed: int = opt(0, "seeds every RNG; a seeded CPU run is bitwise reproducible", bounds="[0, 2**32)")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N (ROCm GPUs are \"cuda\" too)")
    threads: int = opt(0, "torch CPU threads (0 = torch's default)", bounds=">= 0 (0 = torch's default)")
    run_dir: str | None = opt(None, "default runs/<timestamp>")
    sandbox: Literal["bwrap", "unsafe-local"] = opt(
        "bwrap", "bwrap | unsafe-local (no isolation): where the python tool and the code reward run")
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
    agent: AgentSection = field(default_factory=AgentSection)

    @property
    def samples_per_mini_batch(self) -> int:
        return self.rollout.samples // self.train.mini_batches

    def rules(self, cfg: Config) -> list[Rule]:
        return [
            (_DEVICE.fullmatch(self.device) is not None, "device", "must be auto, cpu, cuda or cuda:N"),
            (self.threads <= 4096, "threads", "must be <= 4096"),
            (self.run_dir is None or self.run_dir.strip() != "", "run_dir", "must not be empty"),
        ]

    def validate(self, given: Collection[str] = ()) -> None:
        """Every key against its type's choices and its metadata, then each section's rules across keys (those
        may count on every key being in range); the first problem is a ConfigError naming its key: of a rule's
        two keys, the one the user set (`given`: the dotted keys of the config file and the overrides)."""
        for key, value, t, meta in _settings(self):
            if (problem := value_problem(value, t, meta)) is not None:
                raise ConfigError(f"{key}: {problem}, got {value!r}{value_hint(value, t)}")
            if meta.get("check") and (problem := meta["check"](value)) is not None:
                raise ConfigError(f"{key}: {problem}")
        for section in _sections(self):
            for ok, key, msg, *other in section.rules(self):
                if not ok and other and other[0][0] in given and key not in given:
                    key, msg = other[0]
                if not ok:
                    value = _get(self, key)
                    raise ConfigError(f"{key}: {msg}" + ("" if dataclasses.is_dataclass(value) else f", got {value!r}"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")

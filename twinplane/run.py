"""`twinplane train` and `twinplane eval`: build the planes from a config, warm-start, run GRPO, evaluate, save.

`prepare()` does every check that can fail on bad input (config, data, model folder, reward spec) before any
training work, so those surface as one-line errors; `train()` then runs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from rich.console import Console

from twinplane import checkpoint, platform, run_state
from twinplane.cluster import WorkerError, build_planes
from twinplane.config import Config, ConfigError
from twinplane.controller import Controller
from twinplane.data import DataError, PromptFormatter, PromptStream, Record, load_records
from twinplane.evaluation import evaluate
from twinplane.loggers import build_loggers, check_backends
from twinplane.metrics import MetricsLog, progress_line
from twinplane.model import ModelConfig, Transformer, iter_safetensors, load_model, load_weights, save_pretrained
from twinplane.model.lora import adapter_numel, apply_lora, merge_lora
from twinplane.model.lora_io import base_sha256, save_adapter
from twinplane.prompts import Prompt, encode_prompts
from twinplane.rewards.runner import RewardRunner
from twinplane.rollout import SamplingParams
from twinplane.tasks import ALPHABET, ArithmeticTask
from twinplane.tokenizer import Tokenizer, build_char_tokenizer, load_tokenizer
from twinplane.train.sft import warm_start


def build_demo_model(cfg: Config, tokenizer: Tokenizer, device: torch.device) -> Transformer:
    m = cfg.model
    mc = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                     num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                     head_dim=m.hidden_size // m.num_heads, max_position_embeddings=64, tie_word_embeddings=True,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    model = Transformer(mc)
    with torch.no_grad():  # GPT-2-style small init keeps the tiny model's first steps stable
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.02)
    return model.to(device)


def save_hf_folder(model: Transformer, tokenizer: Tokenizer, out: Path) -> None:
    save_pretrained(model, out)
    tokenizer.save(out)
    c = model.config
    gen = {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


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


def load_prompts(cfg: Config, tokenizer: Tokenizer, path: str) -> tuple[list[Prompt], dict]:
    d = cfg.data
    records, stats = load_records(path, d.prompt_field, d.answer_field, d.system_field, on_error=d.on_error)
    prompts, dropped = encode_prompts(records, formatter(cfg).format, tokenizer, d.max_prompt_tokens)
    if not prompts:
        raise ValueError(f"{path}: all {len(records)} prompts are longer than data.max_prompt_tokens="
                         f"{d.max_prompt_tokens}")
    stats = {"loaded": stats["loaded"], "skipped": stats["skipped"], "too_long": dropped}
    return prompts, stats


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
        raise ValueError("data.template=chat needs model.path with a chat template (or use data.template=plain)")
    return PromptFormatter(mode="plain", **kw)


def find_resume(cfg: Config, resume: str | None, log=print) -> Path | None:
    """The checkpoint to resume from, after checking the config may continue it (one-line errors otherwise)."""
    if resume is None:
        return None
    if resume == "auto" and not cfg.run_dir:
        raise ConfigError("--resume auto needs --run-dir (the run to continue)")
    ckpt = checkpoint.resolve(Path(cfg.run_dir or "."), resume, log)
    if ckpt is None:
        log(f"--resume auto: no complete checkpoint in {cfg.run_dir}; starting from scratch")
        return None
    bad, ok = run_state.config_changes(run_state.read_config(ckpt), cfg.to_dict())
    if bad:
        raise ConfigError(f"--resume {ckpt}: {bad[0].split(':')[0]} cannot change on resume ({bad[0]})")
    for change in ok:
        log(f"resume: {change}")
    return ckpt


def prepare(cfg: Config, resume: str | None = None) -> Setup:
    check_backends(cfg.log.backends)
    if cfg.cluster.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("cluster.backend=ray needs Ray: pip install 'twinplane[cluster]'")
    resume_from = find_resume(cfg, resume)
    platform.setup(cfg.seed, cfg.threads or None)
    # With Ray the workers take the devices; this process only holds a host copy (warm start, checkpoints).
    device = platform.resolve_device(cfg.device) if cfg.cluster.backend == "local" else torch.device("cpu")
    dtype = platform.resolve_dtype(cfg.model.dtype)
    if cfg.model.path:
        tokenizer = load_tokenizer(cfg.model.path)
        model = load_model(cfg.model.path, device=device, dtype=dtype)
    else:
        tokenizer = build_char_tokenizer(ALPHABET)
        model = build_demo_model(cfg, tokenizer, device).to(dtype)
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
    if cfg.data.val_size:
        val_prompts = val_prompts[:cfg.data.val_size]
    r = cfg.reward
    scorer = RewardRunner(r.name, r.options, r.timeout_s, r.format_weight, r.model, r.model_weight)
    run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    return Setup(cfg, device, tokenizer, model, train_prompts, val_prompts, task, scorer, stats, run_dir, resume_from)


def run_eval(s: Setup, rollout, n: int = 1, temperature: float = 0.0) -> dict[str, float]:
    return evaluate(rollout, s.tokenizer, s.val_prompts, s.scorer, s.cfg.rollout.max_new_tokens, n, temperature,
                    s.cfg.seed)


def attach_lora(s: Setup, console: Console) -> dict:
    """Freeze `s.model` as the LoRA base and add adapters (B = 0: still the base). Returns the base's identity
    {path, sha256, dropout}, which checkpoints record instead of copying the base.

    The base is `model.path`, or for the built-in demo the (warm-started) model written once to RUN_DIR/base/. On
    resume, the base the checkpoint names is loaded (demo) and must still hash the same: one-line error if not."""
    cfg, lora = s.cfg, s.cfg.train.lora
    if s.resume_from is not None:
        saved = run_state.read_lora_base(s.resume_from)
        if saved is None:
            raise ConfigError(f"--resume {s.resume_from}: train.lora.rank cannot change on resume (a full-weight "
                              f"checkpoint)")
        base_dir = Path(saved["path"])
        if not (base_dir / "config.json").exists():
            raise ConfigError(f"--resume {s.resume_from}: the LoRA base {base_dir} is missing")
        digest = base_sha256(base_dir)
        if digest != saved["sha256"]:
            raise ConfigError(f"--resume {s.resume_from}: the LoRA base {base_dir} changed since the checkpoint "
                              f"(sha256 {digest[:12]} != {saved['sha256'][:12]})")
        if not cfg.model.path:
            load_weights(s.model, iter_safetensors(base_dir))
    else:
        base_dir = Path(cfg.model.path) if cfg.model.path else s.run_dir / "base"
        if not cfg.model.path:
            save_hf_folder(s.model, s.tokenizer, base_dir)
        digest = base_sha256(base_dir)
    full = sum(p.numel() for p in s.model.parameters())
    apply_lora(s.model, lora.rank, lora.alpha, lora.dropout, lora.targets, seed=cfg.seed)
    adapters = adapter_numel(s.model)
    console.print(f"LoRA r={lora.rank} alpha={lora.alpha:g} on {lora.targets}: {adapters:,} trainable parameters "
                  f"({100 * adapters / full:.2f}% of {full:,}); base {base_dir} frozen")
    return {"path": str(base_dir.resolve()), "sha256": digest, "dropout": lora.dropout}


PREEMPTED = 75  # exit code after a SIGTERM/SIGINT was handled and an emergency checkpoint written


class Preempted(Exception):
    pass


def fault_hook(spec: str | None, planes=None):
    """TWINPLANE_FAULT="phase@step[xN],..." sends this process N (default 1) SIGTERMs when `phase` starts at
    `step` (rollout, reward, train, weight_sync, checkpoint, ...): deterministic preemption points for tests.
    "kill:WORKER@phase@step" instead kills a cluster worker (e.g. kill:rollout engine 0@rollout@2).
    With TWINPLANE_FAULT_ONCE=FILE a fault fires only if FILE does not exist yet (and creates it), so a
    relaunched run is not preempted again at the same point."""
    points, kills = {}, {}
    for p in filter(None, (spec or "").split(",")):
        if p.startswith("kill:"):
            worker, phase, at = p[5:].split("@")
            kills[(phase, at)] = worker
            continue
        where, _, count = p.partition("x")
        points[tuple(where.split("@"))] = int(count or 1)
    current = {"step": 0}

    once = os.environ.get("TWINPLANE_FAULT_ONCE")

    def hook(phase: str) -> None:
        worker = kills.get((phase, str(current["step"])))
        if worker is not None and planes is not None:
            planes.kill(worker)
        count = points.get((phase, str(current["step"])), 0)
        if count and once:
            if os.path.exists(once):
                return
            Path(once).touch()
        for i in range(count):
            if i:
                time.sleep(1.1)  # a separate request, not a duplicate delivery of the first
            os.kill(os.getpid(), signal.SIGTERM)

    return hook, current


def train(s: Setup, console: Console | None = None) -> dict:
    """Run (or continue) the job. Raises `Preempted` after a handled SIGTERM/SIGINT (checkpoint written)."""
    cfg, tokenizer, model, run_dir = s.cfg, s.tokenizer, s.model, s.run_dir
    console = console or Console(stderr=True)
    t_start = time.perf_counter()
    dtype = platform.resolve_dtype(cfg.model.dtype)
    rollout_dtype = platform.resolve_dtype(cfg.model.rollout_dtype or cfg.model.dtype)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    console.print(f"[bold]twinplane[/] run dir {run_dir} | device {s.device} | model {model.config.model_type} "
                  f"{model.config.num_params / 1e6:.2f}M params | {dtype} | {len(s.train_prompts)} train prompts, "
                  f"{len(s.val_prompts)} validation prompts {s.data_stats or ''}")

    warm = s.task is not None and cfg.warmstart.steps > 0
    if warm and s.resume_from is None:
        ws = cfg.warmstart
        pairs = s.task.teacher_data(ws.steps * ws.batch_size, cfg.task.teacher_carry_error, cfg.seed + 1)
        prompts = [tokenizer.encode(p) for p, _ in pairs]
        answers = [tokenizer.encode(a) + [tokenizer.eos_token_id] for _, a in pairs]
        t0 = time.perf_counter()
        losses = warm_start(model, prompts, answers, ws.steps, ws.batch_size, ws.lr, tokenizer.pad_token_id, cfg.seed)
        console.print(f"warm start: {ws.steps} steps on imperfect-teacher answers, loss "
                      f"{losses[0]:.3f} -> {losses[-1]:.3f} ({time.perf_counter() - t0:.1f}s)")

    r = cfg.rollout
    lora_base = attach_lora(s, console) if cfg.train.lora.rank > 0 else None
    # Taken before a restore, so without a warm start the reference is the unchanged source; after a warm start
    # its weights are in the checkpoint. With LoRA the reference is the policy's own base (adapters off).
    reference = copy.deepcopy(model) if cfg.algo.kl_coef > 0 and lora_base is None else None
    stream = PromptStream(s.train_prompts, cfg.seed)
    summary: dict = {"heldout_size": len(s.val_prompts)}
    phase_sums: dict[str, float] = {}
    start, state = 1, None
    if s.resume_from is not None:
        state = run_state.restore(s.resume_from, policy=model, reference=reference, stream=stream)
        start, summary, phase_sums = state["step"] + 1, state["summary"], state["phase_sums"]
    planes = build_planes(cfg, model, reference, tokenizer, log=console.print)
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens, n=r.n)
    hook, fault_step = fault_hook(os.environ.get("TWINPLANE_FAULT"), planes)
    controller = Controller(planes.engine, planes.trainer, planes.reference, s.scorer, tokenizer, sampling,
                            cfg.train.mini_batches, cfg.algo.recompute_old_logprobs or rollout_dtype != dtype,
                            cfg.algo.norm_adv_by_std, rollout=planes.rollout, on_phase=hook,
                            peak_flops=platform.detect().peak_flops, sync=planes.sync, async_=cfg.cluster.async_,
                            devices=(planes.train_devices, planes.rollout_devices))
    log = MetricsLog(run_dir / "metrics.jsonl", keep_through_step=start - 1 if s.resume_from else None)
    sinks = build_loggers(cfg.log.backends, run_dir, cfg.to_dict(), cfg.log.wandb_project, cfg.log.wandb_mode)

    def record(step: int, metrics: dict) -> None:
        log.write({"step": step, **metrics})
        for sink in sinks:
            sink.log(step, metrics)

    def validate(step: int) -> dict:
        ev = {f"val/{k}": v for k, v in run_eval(s, planes.rollout, cfg.eval.n, cfg.eval.temperature).items()}
        console.print(f"validation at step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in ev.items()),
                      highlight=False, soft_wrap=True)
        return ev

    def due(step: int) -> bool:
        last = step == cfg.train.steps and cfg.eval.after
        return bool(s.val_prompts) and (last or (cfg.eval.every > 0 and step % cfg.eval.every == 0))

    def pull_policy() -> dict:
        planes_state = planes.state()
        if planes_state["policy"] is not None:  # the trainer is elsewhere: bring its weights into `model`
            load_weights(model, planes_state["policy"].items(), strict=lora_base is None)  # LoRA: adapters only
        return planes_state

    def save_checkpoint(step: int) -> None:
        t0 = time.perf_counter()
        planes_state = pull_policy()
        extra = {"summary": summary, "phase_sums": phase_sums, "pending": controller.pending_state()}
        path = checkpoint.save(run_dir, step, lambda out: run_state.write(
            out, config=cfg.to_dict(), policy=model, save_policy_extras=lambda m, d: save_hf_folder(m, tokenizer, d),
            reference=reference if warm else None, planes_state=planes_state, stream=stream, step=step,
            extra=extra, lora_base=lora_base), cfg.checkpoint.keep, before_manifest=lambda: hook("checkpoint"))
        console.print(f"checkpoint {path} ({time.perf_counter() - t0:.2f}s)")

    signals = {"count": 0, "first": 0.0}

    def on_signal(signum, frame):
        now = time.monotonic()
        if signals["count"] and now - signals["first"] < 1.0:
            return  # the same stop request delivered twice (e.g. Slurm signals every process of the job)
        signals["count"] += 1
        if signals["count"] > 1:  # a second request: leave now; a half-written checkpoint has no manifest
            os._exit(128 + signum)
        signals["first"] = now
        console.print(f"received {signal.Signals(signum).name}: finishing step, then an emergency checkpoint")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if state is not None:
            planes.load_state(state["optimizer"], state["scheduler"], state["engine_rng"], state["weight_version"])
            controller.version = state["weight_version"]
            controller.load_pending(state.get("pending"))
            console.print(f"resumed from {s.resume_from} (step {state['step']})")
        if cfg.eval.before and s.val_prompts and s.resume_from is None:
            ev = validate(0)
            record(0, ev)  # step 0: the policy before any RL update
            summary["warmstart_accuracy"] = ev["val/accuracy"]
        for step in range(start, cfg.train.steps + 1):
            fault_step["step"] = step
            prompts = controller.pending[0] if controller.pending else stream.next_batch(r.prompts_per_step)
            upcoming = stream.next_batch(r.prompts_per_step) if cfg.cluster.async_ and step < cfg.train.steps \
                else None
            m = controller.step(prompts, upcoming)
            for k, v in m.items():
                if k.startswith("time/"):
                    phase_sums[k] = phase_sums.get(k, 0.0) + v
            if cfg.log.progress and "console" in cfg.log.backends:
                console.print(progress_line(step, cfg.train.steps, m), highlight=False, markup=False, soft_wrap=True)
            if due(step):
                m |= validate(step)
                if step == cfg.train.steps:
                    summary["final_accuracy"] = m["val/accuracy"]
            record(step, m)
            periodic = cfg.checkpoint.every > 0 and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps)
            if periodic or signals["count"]:
                save_checkpoint(step)
            if signals["count"]:
                raise Preempted(f"preempted at step {step}; resume with --resume auto")
        if cfg.eval.after and s.val_prompts and cfg.train.steps == 0:
            summary["final_accuracy"] = validate(0)["val/accuracy"]
        if cfg.cluster.backend != "local":
            pull_policy()
    except WorkerError as e:
        done = checkpoint.list_checkpoints(run_dir)
        last = f"last complete checkpoint {done[-1]} (continue with --resume auto)" if done else "no checkpoint yet"
        raise WorkerError(f"{e}; {last}") from None
    finally:
        planes.close()
        log.close()
        for sink in sinks:
            sink.close()
        s.scorer.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if lora_base is None:
        save_hf_folder(model, tokenizer, run_dir / "final")
    else:  # final/ is the merged model (loads anywhere); final_adapter/ the adapters alone (PEFT)
        save_hf_folder(merge_lora(copy.deepcopy(model)), tokenizer, run_dir / "final")
        save_adapter(model, run_dir / "final_adapter", lora_base["path"], cfg.train.lora.dropout)
    steps = max(cfg.train.steps, 1)
    summary.update(steps=cfg.train.steps, wall_seconds=time.perf_counter() - t_start,
                   phase_seconds_mean={k[5:]: v / steps for k, v in phase_sums.items()})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"summary: {json.dumps(summary)}", highlight=False, soft_wrap=True)
    return summary

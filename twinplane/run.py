"""`twinplane train` and `twinplane eval`: build the planes from a config, warm-start, run RL, evaluate, save.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from rich.console import Console

from twinplane import checkpoint, platform, preflight, run_state
from twinplane import run_dir as rundir
from twinplane.cluster import WorkerError, build_algorithm, build_planes
from twinplane.config import Config, ConfigError, DataSection
from twinplane.controller import Controller
from twinplane.data import DataError, PromptFormatter, PromptStream, Record, load_code_records, load_records
from twinplane.errors import InputError, Preempted
from twinplane.evaluation import evaluate
from twinplane.loggers import build_loggers, check_backends
from twinplane.metrics import LiveLine, MetricsLog, progress_line, summary_table
from twinplane.model import ModelConfig, Transformer, iter_safetensors, load_weights, save_pretrained
from twinplane.model.lora import adapter_numel, apply_lora, merge_lora
from twinplane.model.lora_io import base_sha256, save_adapter
from twinplane.prompts import Prompt, encode_prompts
from twinplane.rewards.runner import RewardRunner
from twinplane.rollout import SamplingParams
from twinplane.sandbox import SandboxUnavailable, get_sandbox
from twinplane.signals import StopRequests
from twinplane.tasks import ALPHABET, ArithmeticTask
from twinplane.tokenizer import Tokenizer, build_char_tokenizer
from twinplane.train.sft import warm_start


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


def save_hf_folder(model: Transformer, tokenizer: Tokenizer, out: Path) -> None:
    save_pretrained(model, out)
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
        raise DataError(f"{path}: the model's tokenizer cannot encode it ({preflight._first_line(e)})") from None


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
    if saved is not None:
        bad, ok = run_state.config_changes(saved, cfg.to_dict())
        if bad:
            raise ConfigError(f"{what}: {bad[0].split(':')[0]} cannot change on resume ({bad[0]})")
        for change in ok:
            log(f"resume: {change}")

    def apply() -> None:  # only after every check: a refused run leaves the run dir exactly as it was
        for path, why in damaged:
            rundir.quarantine(path, why, log)
        if ckpt is None:
            log(f"--resume {resume}: no complete checkpoint in {run_dir}; "
                + ("starting its run over from the beginning" if present else "starting from scratch"))
    return ckpt, ckpt is None and bool(present), apply


def rundir_config(run_dir: Path) -> dict:
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"{run_dir / 'config.yaml'}: not a readable config ({preflight._first_line(e)})") from None
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
    if cfg.cluster.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("cluster.backend=ray needs Ray: pip install 'twinplane[cluster]'")
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
        mc = preflight.model_config(cfg.model.path)
        preflight.check_weight_files(cfg.model.path)
        tokenizer = preflight.open_tokenizer(cfg.model.path)
        preflight.check_tools(cfg.rollout.tools, tokenizer, cfg.model.path)
        prompt_tokens = cfg.data.max_prompt_tokens
    else:
        tokenizer = build_char_tokenizer(ALPHABET)
        mc = demo_model_config(cfg, tokenizer)
        prompt_tokens = 2 * cfg.task.digits + 2
    for key, on in (("rollout.record_routing", cfg.rollout.record_routing),
                    ("train.router_aux_loss_coef", cfg.train.router_aux_loss_coef > 0)):
        if on and not mc.num_experts:
            raise ConfigError(f"{key}: needs a mixture-of-experts model, {mc.model_type} is dense")
    device = platform.resolve_device(cfg.device) if cfg.cluster.backend == "local" else torch.device("cpu")
    if cfg.cluster.backend == "local":
        memory = platform.device_memory(device)
        preflight.check_memory(cfg, mc, prompt_tokens, memory, f"this {device.type} device")
    try:  # the template, rendered once on a sample: a missing or broken one fails before the model is loaded
        formatter(cfg).format(Record("What is 1+1?", "2"))
    except InputError:
        raise
    except Exception as e:  # jinja2 raises its own types for a template that does not render
        raise InputError(f"data.template: the prompt template of {cfg.model.path or 'the config'} fails on a sample "
                         f"prompt ({preflight._first_line(e)})") from None
    resume_from, restart, claim = claim_run_dir(cfg, run_dir, resume, overwrite, delete_old, log) if own_run_dir \
        else (None, False, lambda: None)
    platform.setup(cfg.seed, cfg.threads or None)
    dtype = platform.resolve_dtype(cfg.model.dtype)
    faults("load")
    if cfg.model.path:
        model = preflight.open_model(cfg.model.path, device, dtype)
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
    scorer = RewardRunner(r.name, r.options, r.timeout_s, r.format_weight, r.model, r.model_weight,
                          step_timeout_s=r.step_timeout_s, sandbox=cfg.sandbox, partial=r.partial)
    claim()
    return Setup(cfg, device, tokenizer, model, train_prompts, val_prompts, task, scorer, stats, run_dir,
                 resume_from, stop, faults, restart)


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


class Faults:
    """TWINPLANE_FAULT="phase@step[xN],..." sends this process N (default 1) SIGTERMs when `phase` starts at
    `step`: deterministic preemption points for tests. Phases: load (model loading, step 0), warmstart (at
    warm-start step K), eval (a validation at step K, 0 = before RL), rollout, reward, train, weight_sync,
    checkpoint, ... (RL step K), final (saving final/). "kill:WORKER@phase@step" instead kills a cluster worker
    (e.g. kill:rollout engine 0@rollout@2). With TWINPLANE_FAULT_ONCE=FILE a fault fires only if FILE does not
    exist yet (and creates it), so a relaunched run is not preempted again at the same point.
    TWINPLANE_FAULT_SIGNAL=INT sends SIGINT (Ctrl-C) instead."""

    def __init__(self, spec: str | None):
        self.points, self.kills, self.step, self.planes = {}, {}, 0, None
        for p in filter(None, (spec or "").split(",")):
            if p.startswith("kill:"):
                worker, phase, at = p[5:].split("@")
                self.kills[(phase, at)] = worker
                continue
            where, _, count = p.partition("x")
            self.points[tuple(where.split("@"))] = int(count or 1)
        self.once = os.environ.get("TWINPLANE_FAULT_ONCE")
        self.signal = getattr(signal, "SIG" + os.environ.get("TWINPLANE_FAULT_SIGNAL", "TERM"))  # TERM | INT

    def __call__(self, phase: str, step: int | None = None) -> None:
        at = str(self.step if step is None else step)
        worker = self.kills.get((phase, at))
        if worker is not None and self.planes is not None:
            self.planes.kill(worker)
        count = self.points.get((phase, at), 0)
        if count and self.once:
            if os.path.exists(self.once):
                return
            Path(self.once).touch()
        for i in range(count):
            if i:
                time.sleep(1.1)  # a separate request, not a duplicate delivery of the first
            os.kill(os.getpid(), self.signal)


def train(s: Setup, console: Console | None = None) -> dict:
    """Run (or continue) the job. Raises `Preempted` after a handled SIGTERM/SIGINT (state saved: a checkpoint
    once the warm start is done; before that the warm start is short and reruns on resume)."""
    cfg, tokenizer, model, run_dir = s.cfg, s.tokenizer, s.model, s.run_dir
    console = console or Console(stderr=True)
    own_stop = s.stop is None  # called from Python rather than the CLI: handle signals for this call only
    stop = (s.stop or StopRequests(log=console.print)).install()
    faults = s.faults or Faults(os.environ.get("TWINPLANE_FAULT"))
    live = LiveLine(console, cfg.log.progress and "console" in cfg.log.backends, cfg.log.every)
    t_start = time.perf_counter()
    dtype = platform.resolve_dtype(cfg.model.dtype)
    rollout_dtype = platform.resolve_dtype(cfg.model.rollout_dtype or cfg.model.dtype)
    if s.resume_from is None:  # on resume, written once the checkpoint has loaded (a bad one changes nothing)
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

        def on_step(i: int, loss: float) -> bool:  # live progress with an ETA; True stops (a signal arrived)
            elapsed = time.perf_counter() - t0
            live.update(i, ws.steps, f"warm start {i}/{ws.steps}  loss={loss:.3f}  "
                        f"{elapsed:.0f}s, eta {elapsed / i * (ws.steps - i):.0f}s")
            faults("warmstart", i)
            return stop.requested

        losses = warm_start(model, prompts, answers, ws.steps, ws.batch_size, ws.lr, tokenizer.pad_token_id, cfg.seed,
                            on_step=on_step)
        live.done()
        stop.check(f"the warm start (step {len(losses)}/{ws.steps}, {time.perf_counter() - t0:.0f}s: a resume "
                   "reruns it)")
        console.print(f"warm start: {ws.steps} steps on imperfect-teacher answers, loss "
                      f"{losses[0]:.3f} -> {losses[-1]:.3f} ({time.perf_counter() - t0:.1f}s)")

    r = cfg.rollout
    lora_base = attach_lora(s, console) if cfg.train.lora.rank > 0 else None
    # Taken before a restore, so without a warm start the reference is the unchanged source; after a warm start
    # its weights are in the checkpoint. With LoRA the reference is the policy's own base (adapters off).
    algo = build_algorithm(cfg)
    reference = copy.deepcopy(model) if algo.needs_reference and lora_base is None else None
    stream = PromptStream(s.train_prompts, cfg.seed)
    summary: dict = {"heldout_size": len(s.val_prompts)}
    phase_sums: dict[str, float] = {}
    start, state = 1, None
    if s.resume_from is not None:
        state = run_state.restore(s.resume_from, policy=model, reference=reference, stream=stream)
        try:
            start, summary, phase_sums = state["step"] + 1, dict(state["summary"]), dict(state["phase_sums"])
        except (KeyError, TypeError, ValueError) as e:
            raise checkpoint.CheckpointError(f"{s.resume_from / 'state.json'}: wrong shape ({e!r})") from None
    planes = build_planes(cfg, model, reference, tokenizer, log=console.print)
    faults.planes = planes
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens, n=r.n)
    controller = Controller(planes.engine, planes.trainer, planes.reference, s.scorer, tokenizer, sampling,
                            cfg.train.mini_batches, cfg.algo.recompute_old_logprobs or rollout_dtype != dtype,
                            algo=algo, critic=planes.critic, critic_warmup=cfg.critic.warmup_steps,
                            more_prompts=lambda: stream.next_batch(r.prompts_per_step), rollout=planes.rollout,
                            on_phase=faults,
                            peak_flops=platform.detect().peak_flops, sync=planes.sync, async_=cfg.cluster.async_,
                            devices=(planes.train_devices, planes.rollout_devices))
    log, sinks = None, []

    def record(step: int, metrics: dict) -> None:
        log.write({"step": step, **metrics})
        for sink in sinks:
            sink.log(step, metrics)

    def validate(step: int) -> dict:
        faults("eval", step)
        ev = {f"val/{k}": v for k, v in run_eval(s, planes.rollout, cfg.eval.n, cfg.eval.temperature).items()}
        live.print(f"validation at step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in ev.items()))
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
        extra = {"summary": summary, "phase_sums": phase_sums, "pending": controller.pending_state(),
                 "controller": controller.state_dict()}
        path = checkpoint.save(run_dir, step, lambda out: run_state.write(
            out, config=cfg.to_dict(), policy=model, save_policy_extras=lambda m, d: save_hf_folder(m, tokenizer, d),
            reference=reference if warm else None, planes_state=planes_state, stream=stream, step=step,
            extra=extra, lora_base=lora_base), cfg.checkpoint.keep, before_manifest=lambda: faults("checkpoint"))
        live.print(f"checkpoint {path} ({time.perf_counter() - t0:.2f}s)")

    try:
        if state is not None:
            try:
                planes.load_state(state["optimizer"], state["scheduler"], state["engine_rng"],
                                  state["weight_version"], critic=state.get("critic"))
                controller.version = state["weight_version"]
                controller.load_state_dict(state.get("controller", {}))
                controller.load_pending(state.get("pending"))
            except Exception as e:  # any failure here is the checkpoint's content (torch/numpy raise many types)
                raise checkpoint.CheckpointError(f"{s.resume_from}: optimizer, scheduler or rollout state has "
                                                 f"the wrong shape ({type(e).__name__})") from None
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            console.print(f"resumed from {s.resume_from} (step {state['step']})")
        log = MetricsLog(run_dir / "metrics.jsonl", keep_through_step=start - 1 if s.resume_from else None)
        sinks = build_loggers(cfg.log.backends, run_dir, cfg.to_dict(), cfg.log.wandb_project, cfg.log.wandb_mode)
        if s.resume_from is None:
            if cfg.eval.before and s.val_prompts:
                ev = validate(0)
                record(0, ev)  # step 0: the policy before any RL update
                summary["warmstart_accuracy"] = ev["val/accuracy"]
            if stop.requested and cfg.train.steps > 0:  # the warm start is done: keep it
                save_checkpoint(0)
                raise Preempted("preempted before the first RL step; resume with --resume auto")
        for step in range(start, cfg.train.steps + 1):
            faults.step = step
            prompts = controller.pending[0] if controller.pending else stream.next_batch(r.prompts_per_step)
            upcoming = stream.next_batch(r.prompts_per_step) if cfg.cluster.async_ and step < cfg.train.steps \
                else None
            m = controller.step(prompts, upcoming)
            for k, v in m.items():
                if k.startswith("time/"):
                    phase_sums[k] = phase_sums.get(k, 0.0) + v
            live.update(step, cfg.train.steps, progress_line(step, cfg.train.steps, m))
            if due(step):
                m |= validate(step)
                if step == cfg.train.steps:
                    summary["final_accuracy"] = m["val/accuracy"]
            record(step, m)
            periodic = cfg.checkpoint.every > 0 and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps)
            if periodic or stop.requested:
                save_checkpoint(step)
            if stop.requested:
                raise Preempted(f"preempted at step {step}; resume with --resume auto")
        live.done()
        if cfg.eval.after and s.val_prompts and cfg.train.steps == 0:
            summary["final_accuracy"] = validate(0)["val/accuracy"]
        if cfg.cluster.backend != "local":
            pull_policy()
    except WorkerError as e:
        done = checkpoint.list_checkpoints(run_dir)
        last = f"last complete checkpoint {done[-1]} (continue with --resume auto)" if done else "no checkpoint yet"
        raise WorkerError(f"{e}; {last}") from None
    finally:
        live.done()
        planes.close()
        if log is not None:
            log.close()
        for sink in sinks:
            sink.close()
        s.scorer.close()
        if own_stop:
            stop.restore()
    # The run is complete: a stop request from here on only lets these few writes finish.
    faults("final", cfg.train.steps)
    if lora_base is None:
        save_hf_folder(model, tokenizer, run_dir / "final")
    else:  # final/ is the merged model (loads anywhere); final_adapter/ the adapters alone (PEFT)
        save_hf_folder(merge_lora(copy.deepcopy(model)), tokenizer, run_dir / "final")
        save_adapter(model, run_dir / "final_adapter", lora_base["path"], cfg.train.lora.dropout)
    steps = max(cfg.train.steps, 1)
    summary.update(steps=cfg.train.steps, wall_seconds=time.perf_counter() - t_start,
                   phase_seconds_mean={k[5:]: v / steps for k, v in phase_sums.items()})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(summary_table(summary, run_dir))
    if stop.requested:
        console.print("a stop request arrived while saving final/: the run had finished, so it completed")
    return summary

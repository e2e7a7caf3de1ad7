"""`twinplane train` and `twinplane eval` once `twinplane.run.prepare` has checked the input: warm-start, run RL through
the controller, validate, checkpoint, save; evaluate.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import yaml
from rich.console import Console

from twinplane.cluster import WorkerError, build_algorithm, build_planes
from twinplane.config import ConfigError
from twinplane.controller import Controller
from twinplane.data import PromptStream
from twinplane.errors import Preempted
from twinplane.model import iter_safetensors, load_weights
from twinplane.model.lora import adapter_numel, apply_lora, merge_lora
from twinplane.model.lora_io import base_sha256, save_adapter
from twinplane.platform import platform
from twinplane.rollout import SamplingParams
from twinplane.run import checkpoint, run_state
from twinplane.run.evaluation import evaluate
from twinplane.run.loggers import build_loggers
from twinplane.run.metrics import LiveLine, MetricsLog, progress_line, summary_table
from twinplane.run.prepare import Setup, save_hf_folder
from twinplane.run.signals import Faults, StopRequests
from twinplane.train.sft import warm_start


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


def train(s: Setup, console: Console | None = None) -> dict:
    """Run (or continue) the job. Raises `Preempted` after a handled SIGTERM/SIGINT (state saved: a checkpoint
    once the warm start is done; before that the warm start is short and reruns on resume)."""
    cfg, tokenizer, model, run_dir = s.cfg, s.tokenizer, s.model, s.run_dir
    console = console or Console(stderr=True)
    own_stop = s.stop is None  # called from Python rather than the CLI: handle signals for this call only
    stop = (s.stop or StopRequests(log=console.print)).install()
    faults = s.faults or Faults(os.environ.get("TWINPLANE_FAULT"))
    live = LiveLine(console, cfg.log.progress and "console" in cfg.log.backends, cfg.log.every)
    stop.log = live.print  # a stop request's message starts on a line of its own, not after the live line
    t_start = time.perf_counter()
    dtype = platform.resolve_dtype(cfg.model.dtype)
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
    start, state, wall_before = 1, None, 0.0  # the run's wall time in earlier invocations (each checkpoint holds it)
    if s.resume_from is not None:
        state = run_state.restore(s.resume_from, policy=model, reference=reference, stream=stream)
        try:
            start, summary, phase_sums = state["step"] + 1, dict(state["summary"]), dict(state["phase_sums"])
            wall_before = float(summary.get("wall_seconds", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            raise checkpoint.CheckpointError(f"{s.resume_from / 'state.json'}: wrong shape ({e!r})") from None
    planes = build_planes(cfg, model, reference, tokenizer, log=console.print)
    faults.planes = planes
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens, n=r.n)
    controller = Controller(planes.engine, planes.trainer, planes.reference, s.scorer, tokenizer, sampling,
                            cfg.train.mini_batches, cfg.algo.recompute_old_logprobs or planes.engine.dtype != dtype,
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
        summary["wall_seconds"] = wall_before + time.perf_counter() - t_start
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
    summary.update(steps=cfg.train.steps, wall_seconds=wall_before + time.perf_counter() - t_start,
                   phase_seconds_mean={k[5:]: v / steps for k, v in phase_sums.items()})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(summary_table(summary, run_dir))
    if stop.requested:
        console.print("a stop request arrived while saving final/: the run had finished, so it completed")
    return summary

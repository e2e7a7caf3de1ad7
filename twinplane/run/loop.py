"""`twinplane train` and `twinplane eval` once `twinplane.run.prepare` has checked the input: a `Run` warm-starts,
runs RL through the controller, validates, checkpoints and saves; `run_eval` evaluates.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import yaml
from rich.console import Console

from twinplane.agents.runner import build_agent_rollout
from twinplane.cluster import WorkerError, build_algorithm, build_planes
from twinplane.cluster.planes import sharded_checkpoints
from twinplane.config import ConfigError
from twinplane.controller import Controller
from twinplane.data import PromptStream
from twinplane.errors import Preempted
from twinplane.model import iter_safetensors, load_weights
from twinplane.model.lora import adapter_numel, apply_lora, merge_lora
from twinplane.model.lora_io import base_sha256, save_adapter
from twinplane.platform import hardware, runtime
from twinplane.producer import Producer
from twinplane.rollout import SamplingParams
from twinplane.run import checkpoint, run_state
from twinplane.run.evaluation import evaluate
from twinplane.run.loggers import build_loggers
from twinplane.run.metrics import LiveLine, MetricsLog, progress_line, summary_table
from twinplane.run.prepare import Setup, save_hf_folder
from twinplane.run.signals import Faults, StopRequests
from twinplane.train.sft import greedy_match, warm_start


def data_note(stats: dict) -> str:
    """What loading the data files left out, for the start-up line ("" when nothing was)."""
    parts = [f"{split}: " + ", ".join(f"{n} {what}" for n, what in ((st.get("skipped", 0), "unreadable records "
             "skipped (data.on_error=skip)"), (st.get("too_long", 0), "prompts over data.max_prompt_tokens left out"))
             if n) for split, st in stats.items() if st.get("skipped") or st.get("too_long")]
    return f" ({'; '.join(parts)})" if parts else ""


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


def train(s: Setup, console: Console | None = None) -> dict:
    """Run (or continue) the job; returns its summary. Raises `Preempted` after a handled SIGTERM/SIGINT (state
    saved: a checkpoint once the warm start is done; before that the warm start is short and reruns on resume)."""
    run = Run(s, console or Console(stderr=True))
    try:
        run.start()
        with run.naming_last_checkpoint():
            if s.resume_from is not None:
                run.restore()
            else:
                run.begin()
            for step in range(run.first_step, s.cfg.train.steps + 1):
                run.step(step)
            run.end()
    finally:
        run.close()
    return run.finish()


class Run:
    """One training job on a prepared `Setup` and the state it carries from step to step (the summary, the phase
    times, the prompt stream, the planes and the controller). `train` calls, in order: `start` (everything before
    the first RL step), `restore` (a checkpoint's) or `begin` (validation at step 0), `step` for each RL step,
    `end`, `close` (always), `finish` (final/ and summary.json). A stop request is looked at between steps: a
    checkpoint, then `Preempted`."""

    def __init__(self, s: Setup, console: Console):
        cfg = s.cfg
        self.s, self.cfg, self.console, self.run_dir = s, cfg, console, s.run_dir
        self.own_stop = s.stop is None  # called from Python rather than the CLI: handle signals for this call only
        self.stop = (s.stop or StopRequests(log=console.print)).install()
        self.faults = s.faults or Faults(os.environ.get("TWINPLANE_FAULT"))
        self.live = LiveLine(console, cfg.log.progress and "console" in cfg.log.backends, cfg.log.every)
        self.stop.log = self.live.print  # a stop request's message starts on a line of its own, not after the live line
        self.t_start = time.perf_counter()
        self.warm = s.task is not None and cfg.warmstart.steps > 0
        self.stream = PromptStream(s.train_prompts, cfg.seed)
        self.summary: dict = {"heldout_size": len(s.val_prompts)}
        self.phase_sums: dict[str, float] = {}
        self.first_step, self.wall_before = 1, 0.0  # the wall time of earlier invocations (checkpoints hold it)
        self.state: dict | None = None  # the checkpoint resumed from, until `restore` has put it back
        self.lora_base: dict | None = None
        self.reference = self.planes = self.controller = self.log = self.agents = None
        self.sinks: list = []

    # --- before the first RL step -------------------------------------------------------------------------------
    def start(self) -> None:
        """The run dir's config, the warm start, LoRA, the reference, a checkpoint's weights and data position,
        then the planes (which copy the weights) and the controller."""
        s, cfg, r = self.s, self.cfg, self.cfg.rollout
        dtype = runtime.resolve_dtype(cfg.model.dtype)
        if s.resume_from is None:  # on resume, written once the checkpoint has loaded (a bad one changes nothing)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.write_config()
        self.console.print(f"[bold]twinplane[/] run dir {self.run_dir} | device {s.device} | model "
                           f"{s.model.config.model_type} {s.model.config.num_params / 1e6:.2f}M params | {dtype} | "
                           f"{len(s.train_prompts)} train prompts, {len(s.val_prompts)} validation prompts"
                           f"{data_note(s.data_stats)}")
        if self.warm and s.resume_from is None:
            self.warm_start()
        self.lora_base = attach_lora(s, self.console) if cfg.train.lora.rank > 0 else None
        # Taken before a restore, so without a warm start the reference is the unchanged source; after a warm start
        # its weights are in the checkpoint. With LoRA the reference is the policy's own base (adapters off).
        algo = build_algorithm(cfg)  # the run's one algorithm: the planes, the producer and the controller share it
        self.reference = copy.deepcopy(s.model) if algo.needs_reference and self.lora_base is None else None
        if s.resume_from is not None:
            self.read_checkpoint()
        self.planes = build_planes(cfg, s.model, self.reference, s.tokenizer, log=self.console.print, algo=algo)
        self.faults.planes = self.planes
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens, n=r.n)
        recompute_old = cfg.algo.recompute_old_logprobs
        if recompute_old is None:
            recompute_old = self.planes.rollout_dtype != dtype or cfg.cluster.max_staleness > 0
        c = cfg.cluster
        if cfg.agent.entrypoint is not None:
            self.agents = build_agent_rollout(cfg, self.planes, s.tokenizer, sampling, self.console.print)
        producer = None if not c.max_staleness else Producer(
            self.planes, self.stream, s.scorer, s.tokenizer, sampling, algo, r.prompts_per_step, c.max_staleness,
            c.async_schedule, r.partial, cfg.seed,
            streams=[self.agents.stream(r.prompts_per_step)] if self.agents is not None else None)
        self.controller = Controller(self.planes, s.scorer, s.tokenizer, sampling, cfg.train.mini_batches,
                                     recompute_old, algo=algo, critic_warmup=cfg.critic.warmup_steps,
                                     more_prompts=lambda: self.stream.next_batch(r.prompts_per_step),
                                     on_phase=self.faults, peak_flops=hardware.detect().peak_flops,
                                     producer=producer, agents=self.agents)

    def warm_start(self) -> None:
        """Supervised steps on the built-in task's imperfect-teacher answers, with live progress; the decay of its
        rate waits for greedy answers to carry-free training problems to be right (`train.sft`). A stop request
        leaves at once (a resume reruns it)."""
        s, ws, live, tok = self.s, self.cfg.warmstart, self.live, self.s.tokenizer
        pairs = s.task.teacher_data(ws.steps * ws.batch_size, self.cfg.task.teacher_carry_error, self.cfg.seed + 1)
        prompts = [tok.encode(p) for p, _ in pairs]
        answers = [tok.encode(a) + [tok.eos_token_id] for _, a in pairs]
        probe = s.task.carry_free(256, self.cfg.seed + 2)
        probe_ids = [tok.encode(p.prompt) for p in probe], [tok.encode(p.answer) + [tok.eos_token_id] for p in probe]
        t0 = time.perf_counter()

        def on_step(i: int, loss: float) -> bool:  # live progress with an ETA; True stops (a signal arrived)
            elapsed = time.perf_counter() - t0
            live.update(i, ws.steps, f"warm start {i}/{ws.steps}  loss={loss:.3f}  "
                        f"{elapsed:.0f}s, eta {elapsed / i * max(ws.steps - i, 0):.0f}s")
            self.faults("warmstart", i)
            return self.stop.requested

        out = warm_start(s.model, prompts, answers, ws.steps, ws.batch_size, ws.lr, tok.pad_token_id, self.cfg.seed,
                         on_step=on_step, check=lambda: greedy_match(s.model, *probe_ids, tok.pad_token_id),
                         target=ws.target, max_steps=ws.max_steps or 4 * ws.steps)
        live.done()
        self.stop.check(f"the warm start (step {out.steps}, {time.perf_counter() - t0:.0f}s: a resume reruns it)")
        self.summary.update(warmstart_steps=out.steps, warmstart_carry_free=out.progress)
        held = f" (its decay waited {out.held} steps for them)" if out.held else ""
        self.console.print(f"warm start: {out.steps} steps on imperfect-teacher answers, loss {out.losses[0]:.3f} -> "
                           f"{out.losses[-1]:.3f} ({time.perf_counter() - t0:.1f}s); {out.progress:.0%} of "
                           f"{len(probe)} carry-free training problems right{held}")
        if not out.learned:
            self.console.print(f"[yellow]warning:[/] the warm start ended below warmstart.target={ws.target} after "
                               f"{out.steps} steps (warmstart.max_steps): RL starts from a model that has barely "
                               "learned the task's answers; a higher warmstart.max_steps or another warmstart.lr "
                               "may help")

    def read_checkpoint(self) -> None:
        """The checkpoint's weights (policy, reference), data position and counters; the rest waits for `restore`."""
        self.state = run_state.restore(self.s.resume_from, policy=self.s.model, reference=self.reference,
                                       stream=self.stream)
        try:
            self.first_step = self.state["step"] + 1
            self.summary, self.phase_sums = dict(self.state["summary"]), dict(self.state["phase_sums"])
            self.wall_before = float(self.summary.get("wall_seconds", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            raise checkpoint.CheckpointError(f"{self.s.resume_from / 'state.json'}: wrong shape ({e!r})") from None

    def restore(self) -> None:
        """The checkpoint's optimizer, scheduler, engine RNGs, weight version, the algorithm's state and any
        rollout in flight; then the run dir's config and metrics continue from it."""
        state, c = self.state, self.controller
        try:
            self.planes.load_state(state["optimizer"], state["scheduler"], state["engine_rng"],
                                   state["weight_version"], critic=state.get("critic"), shards=state["shards"])
            c.version = state["weight_version"]
            if state.get("pending"):
                raise ValueError("a rollout in flight of an earlier version's asynchronous mode")
            c.load_state_dict(state.get("controller", {}))
        except Exception as e:  # any failure here is the checkpoint's content (torch/numpy raise many types)
            raise checkpoint.CheckpointError(f"{self.s.resume_from}: optimizer, scheduler or rollout state has "
                                             f"the wrong shape ({type(e).__name__})") from None
        self.write_config()
        self.console.print(f"resumed from {self.s.resume_from} (step {state['step']})")
        self.state = None
        self.open_logs()

    def begin(self) -> None:
        """A fresh run: validation at step 0 (the policy before any RL update), and a checkpoint of the warm start
        if a stop was requested by now."""
        self.open_logs()
        if self.cfg.eval.before and self.s.val_prompts:
            ev = self.validate(0)
            self.record(0, ev)
            self.summary["warmstart_accuracy"] = ev["val/accuracy"]
        if self.stop.requested and self.cfg.train.steps > 0:  # the warm start is done: keep it
            self.checkpoint(0)
            raise Preempted("preempted before the first RL step; resume with --resume auto")

    def open_logs(self) -> None:
        """metrics.jsonl (on resume, cut back to the checkpoint's step) and the configured logger backends."""
        cfg = self.cfg
        kept = self.first_step - 1 if self.s.resume_from is not None else None
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", keep_through_step=kept)
        self.sinks = build_loggers(cfg.log.backends, self.run_dir, cfg.to_dict(), cfg.log.wandb_project,
                                   cfg.log.wandb_mode)

    # --- RL steps -----------------------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """RL step `step` through the controller, its metrics, validation and a checkpoint when due. A stop request
        gets a checkpoint at once, then `Preempted`."""
        cfg, c, r = self.cfg, self.controller, self.cfg.rollout
        self.faults.step = step
        m = c.step(() if c.producer else self.stream.next_batch(r.prompts_per_step))
        if c.producer:  # which prompts of the data order trained (and were filtered): in metrics.jsonl only
            m |= {"data/draws": c.draws["trained"], "data/draws_filtered": c.draws["filtered"]}
        for k, v in m.items():
            if k.startswith("time/"):
                self.phase_sums[k] = self.phase_sums.get(k, 0.0) + v
        self.live.update(step, cfg.train.steps, progress_line(step, cfg.train.steps, m))
        if self.validation_due(step):
            m |= self.validate(step)
            if step == cfg.train.steps:
                self.summary["final_accuracy"] = m["val/accuracy"]
        self.record(step, m)
        periodic = cfg.checkpoint.every > 0 and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps)
        if periodic or self.stop.requested:
            self.checkpoint(step)
        if self.stop.requested:
            raise Preempted(f"preempted at step {step}; resume with --resume auto")

    def validation_due(self, step: int) -> bool:
        last = step == self.cfg.train.steps and self.cfg.eval.after
        return bool(self.s.val_prompts) and (last or (self.cfg.eval.every > 0 and step % self.cfg.eval.every == 0))

    def engine_lent(self):
        """The engine for validation or a checkpoint: an asynchronous run's episodes wait meanwhile."""
        return self.agents.held() if self.agents is not None else nullcontext()

    def validate(self, step: int) -> dict:
        self.faults("eval", step)
        with self.engine_lent():
            ev = {f"val/{k}": v for k, v in run_eval(self.s, self.planes.rollout, self.cfg.eval.n,
                                                     self.cfg.eval.temperature).items()}
        self.live.print(f"validation at step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in ev.items()))
        return ev

    def record(self, step: int, metrics: dict) -> None:
        self.log.write({"step": step, **metrics})
        scalars = {k: v for k, v in metrics.items() if not isinstance(v, list)}
        for sink in self.sinks:
            sink.log(step, scalars)

    def checkpoint(self, step: int) -> None:
        """A checkpoint after `step`: weights, optimizer and engine state from the planes, the data position, the
        summary so far, the controller's state and any rollout in flight."""
        t0 = time.perf_counter()
        cfg, s, c = self.cfg, self.s, self.controller
        shards = sharded_checkpoints(cfg, self.planes.train_devices)  # else full tensors, gathered here first
        self.summary["wall_seconds"] = self.wall_before + time.perf_counter() - self.t_start
        extra = {"summary": self.summary, "phase_sums": self.phase_sums, "controller": c.state_dict()}

        def write(out: Path) -> None:  # sharded: the ranks write theirs into the temp folder, sealed with the rest
            run_state.write(
                out, config=cfg.to_dict(), policy=s.model,
                save_policy_extras=lambda m, d, weights: save_hf_folder(m, s.tokenizer, d, weights),
                reference=self.reference if self.warm else None, planes_state=planes_state or self.planes.state(out),
                stream=self.stream, step=step, extra=extra, lora_base=self.lora_base)

        with self.engine_lent():  # (the engine's random state, settled)
            planes_state = None if shards else self.pull_policy()
            path = checkpoint.save(self.run_dir, step, write, cfg.checkpoint.keep,
                                   before_manifest=lambda: self.faults("checkpoint"))
        self.live.print(f"checkpoint {path} ({time.perf_counter() - t0:.2f}s)")

    def pull_policy(self) -> dict:
        """The planes' state; when the trainer is elsewhere, its weights are brought into `s.model` first."""
        planes_state = self.planes.state()
        if planes_state["policy"] is not None:
            load_weights(self.s.model, planes_state["policy"].items(), strict=self.lora_base is None)  # LoRA: adapters
        return planes_state

    def end(self) -> None:
        """After the last step: the final validation of a run without RL steps; the trained weights in `s.model`."""
        self.live.done()
        if self.cfg.eval.after and self.s.val_prompts and self.cfg.train.steps == 0:
            self.summary["final_accuracy"] = self.validate(0)["val/accuracy"]
        if self.cfg.cluster.backend != "local":
            self.pull_policy()

    @contextmanager
    def naming_last_checkpoint(self) -> Iterator[None]:
        """A worker's failure says where the run can continue from."""
        try:
            yield
        except WorkerError as e:
            done = checkpoint.list_checkpoints(self.run_dir)
            last = f"last complete checkpoint {done[-1]} (continue with --resume auto)" if done else "no checkpoint yet"
            raise WorkerError(f"{e}; {last}") from None

    # --- after the last step ------------------------------------------------------------------------------------
    def close(self) -> None:
        """The planes, the logs, the reward workers and the signal handlers this call installed."""
        self.live.done()
        if self.agents is not None:
            self.agents.close()
        if self.planes is not None:
            self.planes.close()
        if self.log is not None:
            self.log.close()
        for sink in self.sinks:
            sink.close()
        self.s.scorer.close()
        if self.own_stop:
            self.stop.restore()

    def finish(self) -> dict:
        """final/ (with LoRA: merged, and final_adapter/) and summary.json; a stop request from here on only lets
        these few writes finish: the run is complete."""
        cfg, s = self.cfg, self.s
        self.faults("final", cfg.train.steps)
        if self.lora_base is None:
            save_hf_folder(s.model, s.tokenizer, self.run_dir / "final")
        else:  # final/ is the merged model (loads anywhere); final_adapter/ the adapters alone (PEFT)
            save_hf_folder(merge_lora(copy.deepcopy(s.model)), s.tokenizer, self.run_dir / "final")
            save_adapter(s.model, self.run_dir / "final_adapter", self.lora_base["path"], cfg.train.lora.dropout)
        steps = max(cfg.train.steps, 1)
        self.summary.update(steps=cfg.train.steps, wall_seconds=self.wall_before + time.perf_counter() - self.t_start,
                            phase_seconds_mean={k[5:]: v / steps for k, v in self.phase_sums.items()})
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        self.console.print(summary_table(self.summary, self.run_dir))
        if self.stop.requested:
            self.console.print("a stop request arrived while saving final/: the run had finished, so it completed")
        return self.summary

    def write_config(self) -> None:
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))

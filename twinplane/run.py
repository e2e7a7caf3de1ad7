"""`twinplane train`: build the planes from a config, warm-start, run GRPO, evaluate, save."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console

from twinplane import platform
from twinplane.config import Config
from twinplane.controller import Controller
from twinplane.evaluation import evaluate
from twinplane.metrics import MetricsLog, progress_line
from twinplane.model import ModelConfig, Transformer, load_model, save_pretrained
from twinplane.rewards import exact_int
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.tasks import ALPHABET, ArithmeticTask, PromptStream
from twinplane.tokenizer import Tokenizer, build_char_tokenizer, load_tokenizer
from twinplane.train import Reference, Trainer
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
        for _name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.02)
    return model.to(device)


def save_hf_folder(model: Transformer, tokenizer: Tokenizer, out: Path) -> None:
    save_pretrained(model, out)
    tokenizer.save(out)
    c = model.config
    gen = {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def train(cfg: Config, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    t_start = time.perf_counter()
    platform.setup(cfg.seed, cfg.threads or None)
    device = platform.resolve_device(cfg.device)
    dtype = platform.resolve_dtype(cfg.model.dtype)
    rollout_dtype = platform.resolve_dtype(cfg.model.rollout_dtype or cfg.model.dtype)
    run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    if cfg.model.path:
        tokenizer = load_tokenizer(cfg.model.path)
        model = load_model(cfg.model.path, device=device, dtype=dtype)
    else:
        tokenizer = build_char_tokenizer(ALPHABET)
        model = build_demo_model(cfg, tokenizer, device).to(dtype)
    console.print(f"[bold]twinplane[/] run dir {run_dir} | device {device} | model {model.config.model_type} "
                  f"{model.config.num_params / 1e6:.2f}M params | {dtype}")

    task = ArithmeticTask(cfg.task.digits, cfg.task.heldout_size, cfg.seed)
    heldout = task.heldout()
    max_new = cfg.rollout.max_new_tokens
    if cfg.warmstart.steps > 0:
        pairs = task.teacher_data(cfg.warmstart.steps * cfg.warmstart.batch_size, cfg.task.teacher_carry_error,
                                  cfg.seed + 1)
        eos = [tokenizer.eos_token_id]
        t0 = time.perf_counter()
        prompts = [tokenizer.encode(p) for p, _ in pairs]
        answers = [tokenizer.encode(a) + eos for _, a in pairs]
        ws = cfg.warmstart
        losses = warm_start(model, prompts, answers, ws.steps, ws.batch_size, ws.lr, tokenizer.pad_token_id, cfg.seed)
        console.print(f"warm start: {cfg.warmstart.steps} steps on imperfect-teacher answers, loss "
                      f"{losses[0]:.3f} -> {losses[-1]:.3f} ({time.perf_counter() - t0:.1f}s)")

    engine = RolloutEngine(copy.deepcopy(model).to(rollout_dtype), tokenizer.eos_token_id, tokenizer.pad_token_id,
                           cfg.rollout.max_num_seqs, seed=cfg.seed)
    summary: dict = {"heldout_size": len(heldout)}
    if cfg.eval.before:
        ev = evaluate(engine, tokenizer, heldout, exact_int, max_new)
        summary["warmstart_accuracy"] = ev["accuracy"]
        console.print(f"held-out greedy accuracy before RL: {ev['accuracy']:.3f} ({len(heldout)} problems)")

    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=max_new,
                              min_new_tokens=r.min_new_tokens, n=r.n)
    trainer = Trainer(model, cfg.train, cfg.algo, r.temperature, total_steps=cfg.train.steps * cfg.train.mini_batches)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = Reference(copy.deepcopy(model), r.temperature, cfg.train.micro_batch_size)
    controller = Controller(engine, trainer, reference, exact_int, tokenizer, sampling, cfg.train.mini_batches,
                            cfg.algo.recompute_old_logprobs or rollout_dtype != dtype, cfg.algo.norm_adv_by_std)
    stream = PromptStream(task.train_problems(), cfg.seed)
    log = MetricsLog(run_dir / "metrics.jsonl")
    phase_sums: dict[str, float] = {}
    try:
        for step in range(1, cfg.train.steps + 1):
            m = controller.step(stream.next_batch(r.prompts_per_step))
            log.write({"step": step, **m})
            for k, v in m.items():
                if k.startswith("time/"):
                    phase_sums[k] = phase_sums.get(k, 0.0) + v
            if cfg.log.progress:
                console.print(progress_line(step, cfg.train.steps, m), highlight=False, markup=False, soft_wrap=True)
    finally:
        log.close()

    if cfg.eval.after:
        ev = evaluate(engine, tokenizer, heldout, exact_int, max_new)
        summary["final_accuracy"] = ev["accuracy"]
        console.print(f"held-out greedy accuracy after RL: {ev['accuracy']:.3f}")
    save_hf_folder(model, tokenizer, run_dir / "final")
    steps = max(cfg.train.steps, 1)
    summary.update(steps=cfg.train.steps, wall_seconds=time.perf_counter() - t_start,
                   phase_seconds_mean={k[5:]: v / steps for k, v in phase_sums.items()})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"summary: {json.dumps(summary)}", highlight=False)
    return summary

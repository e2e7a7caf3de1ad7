"""Capacity planner: memory per device for both planes, feasible layouts, a recommendation, and its cost.

`twinplane plan --model DIR|config.json|PRESET --gpu mi300x --gpus 8 [--nodes K] [--price-per-gpu-hour P]`
(PRESET: a published model by name, e.g. Qwen2.5-7B, Qwen3-30B-A3B, Llama-3.1-8B; see `twinplane.model.presets`)

Only layouts that `train` accepts are ranked: each layout's overrides, on top of the run's config (or the defaults)
and the step's shape, go through the same validation as `twinplane train`; the others (tensor-parallel engines,
which this version does not have, or more training ranks than samples) are listed apart with `train`'s reason.

The estimate (its assumptions in full) is `twinplane.tools.layouts`; memory comes from `twinplane.model.memory`,
the model `train`'s memory gate reads too.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

from twinplane.config import load_config
from twinplane.data.tasks import ALPHABET
from twinplane.errors import InputError
from twinplane.model import ModelConfig
from twinplane.model.memory import (
    Dtypes,
    Workload,
    checkpoint_bytes,
    lora_params,
    rollout_memory,
    training_memory,
)
from twinplane.model.presets import PRESETS, preset, preset_name
from twinplane.platform import backends, devices
from twinplane.run.preflight import memory_inputs
from twinplane.run.prepare import demo_model_config
from twinplane.tokenizer import build_char_tokenizer
from twinplane.tools.layouts import (
    CPU,
    GB,
    MFU,
    Cluster,
    Layout,
    TrainCheck,
    layouts,
    recommend,
    refusal_reason,
)


def _unit(largest: float) -> tuple[float, str]:
    """MB for small models (the demo's whole run is a few MB), GB otherwise."""
    return (1e6, "MB") if largest < GB else (GB, "GB")


def _switches(best: dict | None) -> str:
    """The recommended layout's memory switches, which the memory tables are computed with."""
    on = [name for key, name in (("checkpointing", "activation checkpointing"), ("offload", "AdamW moments offloaded "
                                 "to host memory")) if best and best[key]]
    return "".join(f", {x}" for x in on)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def plan(cfg: ModelConfig, cluster: Cluster, w: Workload, check: TrainCheck | None = None, name: str = "") -> dict:
    """Everything `format_plan` prints, as plain data (what `--json` writes): `layouts` are those `train` accepts,
    ranked; `refused_layouts` the feasible ones it refuses, each with its reason."""
    dev = cluster.device
    g = cluster.total
    options = layouts(cfg, cluster, w, check)
    best, why = recommend(cfg, cluster, w, options)
    fsdp = best.train_gpus if best else g
    tp = best.tp if best else 1
    dt = Dtypes.for_device(dev)
    tm = training_memory(cfg, dt, w, fsdp, best.checkpointing if best else False, best.offload if best else False)
    rm = rollout_memory(cfg, dt, w, tp, best.seqs_in_flight if best else None)
    ckpt = checkpoint_bytes(cfg, dt, w)
    return {
        "model": {"name": name, "params": cfg.num_params, "active_params": cfg.active_params,
                  "layers": cfg.num_layers, "hidden": cfg.hidden_size,
                  "trainable_params": lora_params(cfg, w.lora_rank, w.lora_targets) if w.lora_rank else cfg.num_params},
        "cluster": {"device": dev.key, "memory_gb": dev.memory_gb, "gpus": g, "price_per_gpu_hour":
                    cluster.price_per_gpu_hour},
        "workload": asdict(w),
        "training_memory": asdict(tm) | {"total": tm.total, "fsdp": fsdp},
        "checkpoint": {"total": ckpt, "per_rank": ckpt / fsdp, "ranks": fsdp},
        "rollout_memory": asdict(rm) | {"total": rm.total, "tp": tp},
        "layouts": [asdict(x) | {"dp": x.dp} for x in options if not x.refused],
        "refused_layouts": [asdict(x) | {"dp": x.dp} for x in options if x.refused],
        "recommended": None if best is None else asdict(best) | {"dp": best.dp, "overrides": best.overrides()},
        "reason": why,
    }


def _row(rank: str, x: dict, div: float) -> str:
    mode = "colocated" if x["colocated"] else "split"
    return (f"  {rank:>4} {mode:<10}{x['train_gpus']:6d}{x['rollout_gpus']:8d}{x['tp']:4d}{x['dp']:4d}"
            f"{'yes' if x['checkpointing'] else 'no':>5}{'yes' if x['offload'] else 'no':>5}"
            f"{x['train_mem'] / div:10.1f}{x['rollout_mem'] / div:9.1f}{x['seqs_in_flight']:10d}"
            f"{x['step_s']:8.1f}{x['resharding_bytes'] / div:9.1f}{x['cost_per_m_tokens']:10.3f}")


def _layout_table(p: dict, div: float, unit: str, max_rows: int, max_refused: int = 4) -> list[str]:
    """The layouts `train` accepts, ranked, then (unranked, marked) those it refuses that the model prices faster
    than rank 1 (all of them when it accepts none), with `train`'s reason once per refused key."""
    ok, no = p["layouts"], p["refused_layouts"]
    if not (ok or no):
        return ["feasible layouts: none"]
    shown = ok[:max_rows]
    faster = [x for x in no if not ok or x["step_s"] < ok[0]["step_s"]][:max_refused]
    head = (f"feasible layouts: {len(ok)} that `train` accepts, ranked"
            + (f" (the fastest {len(shown)} shown)" if len(shown) < len(ok) else "")
            + (f", and {len(no)} it refuses" if no else "") + f"; memory = peak per device, {unit}:")
    lines = [head, f"  rank mode        train rollout  TP  DP ckpt offl train_mem roll_mem in_flight  step_s  "
                   f"sync_{unit}  $/1M tok"]
    lines += [_row(str(i), x, div) for i, x in enumerate(shown, 1)]
    reasons = {x["refused"].split(":")[0]: refusal_reason(x["refused"]) for x in faster}
    lines += [_row("-", x, div) + f"  not yet supported ({x['refused'].split(':')[0]})" for x in faster]
    lines += [f"  not yet supported: `train` refuses {r}" for r in reasons.values()]
    return lines


def format_plan(cfg: ModelConfig, cluster: Cluster, w: Workload, max_rows: int = 12, check: TrainCheck | None = None,
                name: str = "") -> str:
    """The terminal report: memory per plane, the layouts table, the recommendation and its overrides."""
    dev = cluster.device
    p = plan(cfg, cluster, w, check, name)
    tm, rm, best = p["training_memory"], p["rollout_memory"], p["recommended"]
    div, unit = _unit(max(tm["total"], rm["total"]))
    moe = (f", {_params(cfg.active_params)} active: top-{cfg.num_experts_per_tok} of {cfg.num_experts} experts"
           if cfg.num_experts else "")
    lines = [f"model: {name + ', ' if name else ''}{_params(cfg.num_params)} params{moe} ({cfg.num_layers} layers, "
             f"hidden {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size})",
             f"cluster: {cluster.nodes} x {cluster.gpus} {dev.key} ({dev.memory_gb:g} GB, {dev.hbm_tb_s:g} TB/s, "
             f"{dev.bf16_tflops:g} TFLOP/s bf16)",
             f"step: {w.prompts_per_step} prompts x {w.n} samples, prompt {w.prompt_len} + response "
             f"{w.response_len} tokens, micro-batch {w.micro_batch_size}",
             (f"LoRA r={w.lora_rank} on every attention/MLP linear: {p['model']['trainable_params'] / 1e6:.1f}M "
              f"trainable params ({100 * p['model']['trainable_params'] / cfg.num_params:.2f}%); frozen bf16 base; "
              "no reference copy (the base with adapters off); adapter-only sync" if w.lora_rank else
              "full fine-tuning" + (", with the KL term's reference copy" if w.reference else
                                    " (a KL term's reference copy would hold the weights once more)")),
             "PPO's critic (a policy-sized value model with its own AdamW) is not counted: it shares the training "
             "devices (cluster.critic_devices=0) or takes K more (cluster.critic_devices=K)",
             f"training at {MFU:.0%} MFU (measured on one GPU eagerly, and compiled where Inductor's cache was "
             "warm; compiled into a fresh cache it reached 51%)",
             "",
             f"training memory per device ({unit}, FSDP={tm['fsdp']}{_switches(best)}):"]
    for k in ("params", "grads", "master", "moments", "reference", "activations", "logits", "total"):
        lines.append(f"  {k:<12}{tm[k] / div:8.2f}")
    ck = p["checkpoint"]
    lines.append(f"checkpoint: {ck['per_rank'] / div:.2f} {unit} per training rank with checkpoint.format=sharded "
                 f"(model + AdamW state {ck['total'] / div:.2f} {unit} / {ck['ranks']} ranks; the full format gathers "
                 "it all in the driver)")
    lines.append(f"rollout memory per device ({unit}, TP={rm['tp']}):")
    for k in ("weights", "kv_cache", *(("states",) if rm["states"] else ()), "workspace", "total"):
        lines.append(f"  {k:<12}{rm[k] / div:8.2f}")  # (states: a hybrid's recurrent states)
    lines += ["", *_layout_table(p, div, unit, max_rows), ""]
    if best is None:
        lines.append(f"recommendation: none. {p['reason']}")
    else:
        lines += [f"recommendation: {'colocated' if best['colocated'] else 'disaggregated'}, "
                  f"train on {best['train_gpus']} (FSDP={best['train_gpus']}), rollout on {best['rollout_gpus']} "
                  f"(TP={best['tp']} x DP={best['dp']})",
                  f"  why: {p['reason']}",
                  f"  step {best['step_s']:.1f} s (rollout {best['rollout_s']:.1f} + train {best['train_s']:.1f} "
                  f"+ sync {best['sync_s']:.1f}), {w.trained_tokens} trained tokens/step, "
                  f"resharding {best['resharding_bytes'] / div:.1f} {unit}/step",
                  f"  cost: ${best['cost_per_m_tokens']:.3f} per 1M trained tokens at "
                  f"${cluster.price_per_gpu_hour:g}/GPU-hour",
                  f"  overrides: {best['overrides']}{' cluster.max_staleness=1' if cluster.overlap else ''} "
                  f"rollout.prompts_per_step={w.prompts_per_step} "
                  f"rollout.n={w.n} rollout.max_new_tokens={w.response_len} "
                  f"train.micro_batch_size={w.micro_batch_size}"
                  + (f" train.lora.rank={w.lora_rank}" if w.lora_rank else "")]
    return "\n".join(lines)


def load_model_config(path: str) -> ModelConfig:
    """A model folder or config.json, else a preset's name (`twinplane.model.presets`)."""
    if Path(path).exists():
        return ModelConfig.from_file(path)
    if preset_name(path):
        return preset(path)
    raise FileNotFoundError(f"{path}: no such model folder or config.json, and no preset of that name "
                            f"(presets: {', '.join(PRESETS)})")


def model_name(spec: str) -> str:
    """A model folder's name, or the published model a preset name stands for."""
    return Path(spec).name if Path(spec).exists() else preset_name(spec) or spec


# The planner reads no data: a config's data files (and the ${VAR}s they name) are left out of its view of the run.
NO_DATA = ("data.train_file=null", "data.val_file=null")


def from_run_config(path: Path, model: str | None = None, device: devices.DeviceSpec = CPU, saved: bool = False,
                    demo: bool = True) -> tuple[ModelConfig, Workload, str]:
    """The model, the step's shape of a twinplane run on `device` and the model's name, from its config (`saved`:
    the run's own config.yaml). Without model.path the model is the demo's built-in one, or with `demo=False` an
    error (a config written for a model given on the command line)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such config file")
    cfg = load_config(path, [*NO_DATA, *([f"model.path={model}"] if model else [])], saved=saved)
    if cfg.model.path:
        mc, name = load_model_config(cfg.model.path), model_name(cfg.model.path)
    elif demo:
        mc, name = demo_model_config(cfg, build_char_tokenizer(ALPHABET)), "the demo's built-in model"
    else:
        raise InputError(f"{path}: model.path is not set: give --model (a model folder, its config.json, or a "
                         "published model by name) to plan this config")
    w = memory_inputs(cfg)[1]  # (the step's shape as `train`'s memory gate sees it)
    return mc, replace(w, logprob_chunk_tokens=chunk_tokens(device, cfg.train.logprob_chunk_tokens)), name


def chunk_tokens(device: devices.DeviceSpec, requested: int) -> int:
    """`train.logprob_chunk_tokens` as a run on `device` resolves it (0 = the platform's choice)."""
    return backends.logprob_chunk_tokens("cpu" if device is CPU else "cuda", requested)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="twinplane plan", description="Memory, layouts and cost of a GRPO run.")
    ap.add_argument("--model", help="HF model folder, its config.json, or a published model by name (presets: "
                    f"{', '.join(PRESETS)}; -Instruct and Qwen/ or meta-llama/ optional); or take it from "
                    "--run-dir / --config")
    ap.add_argument("--run-dir", help="a run dir: its config.yaml gives the model, lengths and batch sizes")
    ap.add_argument("--config", help="a twinplane config YAML: the model, lengths and batch sizes of that run")
    ap.add_argument("--gpu", required=True, help=f"device key: cpu, {', '.join(devices.BY_KEY)}")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=1, help="nodes (TP stays within a node)")
    ap.add_argument("--price-per-gpu-hour", type=float, default=2.0, help="$ per GPU-hour (default 2.0)")
    ap.add_argument("--prompts-per-step", type=int, default=32, help="rollout.prompts_per_step")
    ap.add_argument("--n", type=int, default=8, help="rollout.n, samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (data.max_prompt_tokens)")
    ap.add_argument("--response-len", type=int, default=1024, help="response tokens (rollout.max_new_tokens)")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="train.micro_batch_size, sequences")
    ap.add_argument("--logprob-chunk-tokens", type=int, default=0,
                    help="train.logprob_chunk_tokens (0 = auto: what a run on --gpu picks)")
    ap.add_argument("--overlap", action="store_true",
                    help="price disaggregated layouts as overlapping (one step off-policy) instead of alternating")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="LoRA adapters of this rank on every attention/MLP linear (train.lora.rank; 0 = full)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ns = ap.parse_args(argv)
    device = CPU if ns.gpu.lower() == "cpu" else devices.BY_KEY.get(ns.gpu.lower())
    if device is None:
        raise InputError(f"unknown --gpu {ns.gpu!r} (known: cpu, {', '.join(devices.BY_KEY)})")
    counts = ("gpus", "nodes", "prompts_per_step", "n", "prompt_len", "response_len", "micro_batch_size")
    bad = [f"--{k.replace('_', '-')} {getattr(ns, k)}: must be >= 1" for k in counts if getattr(ns, k) < 1]
    if ns.logprob_chunk_tokens < 0:
        bad.append(f"--logprob-chunk-tokens {ns.logprob_chunk_tokens}: must be >= 0 (0 = auto)")
    if ns.lora < 0:
        bad.append(f"--lora {ns.lora}: the rank must be >= 0 (0 = full fine-tuning)")
    if not (math.isfinite(ns.price_per_gpu_hour) and ns.price_per_gpu_hour >= 0):
        bad.append(f"--price-per-gpu-hour {ns.price_per_gpu_hour}: must be a finite number >= 0")
    if bad:
        raise InputError(bad[0])
    w = Workload(ns.prompts_per_step, ns.n, ns.prompt_len, ns.response_len, ns.micro_batch_size,
                 chunk_tokens(device, ns.logprob_chunk_tokens), ns.lora)
    run_config, extra = None, [*NO_DATA, *(["cluster.max_staleness=1"] if ns.overlap else [])]
    saved = bool(ns.run_dir) and not ns.config
    try:
        if ns.run_dir or ns.config:
            run_config = str(Path(ns.config) if ns.config else Path(ns.run_dir) / "config.yaml")
            cfg, w, name = from_run_config(Path(run_config), ns.model, device, saved, demo=saved)
            w = replace(w, lora_rank=ns.lora or w.lora_rank)
            extra += [f"model.path={ns.model}"] if ns.model else []
        elif ns.model:
            cfg, name = load_model_config(ns.model), model_name(ns.model)
        else:
            raise InputError("give --model, --run-dir or --config")
    except (FileNotFoundError, ValueError) as e:
        raise InputError(str(e)) from None
    cluster = Cluster(device, ns.gpus, ns.nodes, ns.price_per_gpu_hour, ns.overlap)
    check = TrainCheck.for_workload(w, run_config, tuple(extra), saved)
    print(json.dumps(plan(cfg, cluster, w, check, name), indent=2) if ns.json
          else format_plan(cfg, cluster, w, check=check, name=name))
    return 0


__all__ = ["CPU", "Cluster", "Layout", "TrainCheck", "format_plan", "layouts", "load_model_config", "main", "plan",
           "recommend"]

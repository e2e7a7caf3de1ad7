"""The transformers fallback (`model.impl=hf`) in `twinplane train`: a GRPO run on an architecture with no native
family (OLMo), its rollout-vs-trainer log-prob gap (`actor/logprob_gap`, mean and max over the steps), and the step
time of one Llama folder run through transformers' code against the native decoder and engine.

Random-weight models with the demo's character tokenizer on the built-in addition task (no warm start: the point is
the machinery, not learning). Step time: the mean of `time/step` over steps 2.. (step 1 pays one-off work).

    python benchmarks/hf_fallback.py [--steps 20] [--rollout-dtype bfloat16] [--csv benchmarks/results/hf_fallback.csv]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from twinplane.tokenizer import build_char_tokenizer

SIZES = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def folder(path: Path, kind: str) -> Path:
    tok = build_char_tokenizer("0123456789+=")
    ids = dict(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    cls = {"olmo": transformers.OlmoConfig, "llama": transformers.LlamaConfig}[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**SIZES, **ids))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    tok.save(path)
    return path


def run(model: Path, impl: str, steps: int, rollout_dtype: str | None, work: Path) -> dict:
    run_dir = work / f"{model.name}-{impl}"
    cmd = [sys.executable, "-m", "twinplane.cli", "train", f"model.path={model}", f"model.impl={impl}",
           "warmstart.steps=0", f"train.steps={steps}", "rollout.prompts_per_step=8", "rollout.n=4",
           "rollout.max_new_tokens=8", "eval.before=false", "eval.after=false", "log.progress=false",
           "checkpoint.every=0", "threads=2", "--run-dir", str(run_dir)]
    if rollout_dtype:
        cmd.append(f"model.rollout_dtype={rollout_dtype}")
    subprocess.run(cmd, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 1 and "actor/logprob_gap" in r]
    gaps = [r["actor/logprob_gap"] for r in rows]
    return {"gap_mean": statistics.mean(gaps), "gap_max": max(gaps),
            "step_s": statistics.mean(r["time/step"] for r in rows[1:]), "steps": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rollout-dtype", default=None, help="model.rollout_dtype (default: the training dtype)")
    ap.add_argument("--csv", default=None, help="append the numbers to this CSV (benchmarks/results/ format)")
    ap.add_argument("--machine", default="epyc-2c")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        olmo, llama = folder(work / "olmo", "olmo"), folder(work / "llama", "llama")
        out = {"olmo_hf": run(olmo, "hf", ns.steps, ns.rollout_dtype, work),
               "llama_hf": run(llama, "hf", ns.steps, ns.rollout_dtype, work),
               "llama_native": run(llama, "native", ns.steps, ns.rollout_dtype, work)}
    print(json.dumps(out, indent=2))
    if ns.csv:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        command = "python benchmarks/hf_fallback.py " + " ".join(sys.argv[1:])
        head = [datetime.date.today().isoformat(), commit, ns.machine, torch.__version__, command]
        ratio = out["llama_hf"]["step_s"] / out["llama_native"]["step_s"]
        rows = [("olmo_hf_logprob_gap_mean", out["olmo_hf"]["gap_mean"], "nats", f"{ns.steps} GRPO steps"),
                ("olmo_hf_logprob_gap_max", out["olmo_hf"]["gap_max"], "nats", f"{ns.steps} GRPO steps"),
                ("olmo_hf_step_s", out["olmo_hf"]["step_s"], "s", "mean of steps 2.."),
                ("llama_hf_step_s", out["llama_hf"]["step_s"], "s", "mean of steps 2.."),
                ("llama_native_step_s", out["llama_native"]["step_s"], "s", "mean of steps 2.."),
                ("llama_hf_vs_native_step", ratio, "x", "hf step time / native step time")]
        path = Path(ns.csv)
        new = not path.exists()
        with path.open("a") as f:
            if new:
                f.write("date,commit,machine,torch,command,metric,value,unit,note\n")
            for metric, value, unit, note in rows:
                f.write(",".join([*head, metric, f"{value:.4g}", unit, note]) + "\n")


if __name__ == "__main__":
    main()

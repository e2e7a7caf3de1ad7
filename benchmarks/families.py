"""One row per architecture family: what `model.impl=auto` picks for it and whether that implementation is the model.

Each family is a tiny random-weight model built from transformers' config class with its distinguishing features on
(windows, soft-capping, biases, rope scaling, experts...), saved with the demo's character tokenizer. Per family:
- impl: what `auto` chose (native = twinplane's decoder, hf = transformers' modeling code);
- logit gap: max |logits - transformers'| over a padded batch (fp32);
- greedy: the rollout engine's greedy tokens equal transformers' `generate` (do_sample=False);
- round trip: what twinplane saves loads in transformers with the same logits;
- train: a 3-step `twinplane train model.path=...` run exits 0.

    python benchmarks/families.py [--only gemma2,olmo2] [--csv benchmarks/results/families.csv]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import transformers

from twinplane.model.impl import choose
from twinplane.rollout.sampling import SamplingParams
from twinplane.tokenizer import build_char_tokenizer

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=128)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
# family -> (transformers config class, its features on)
FAMILIES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(attention_bias=True, use_sliding_window=True, sliding_window=6,
                                  max_window_layers=2)),  # windows on the last two layers
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, shared_expert_intermediate_size=48, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE, norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", dict(MOE, sliding_window=6)),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", dict(sliding_window=6)),
    "glm": ("GlmConfig", dict(partial_rotary_factor=0.5, attention_bias=True)),
    "glm4": ("Glm4Config", dict(partial_rotary_factor=0.5, attention_bias=True)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 10,
        "short_factor": [1.0 + i / 20 for i in range(6)], "long_factor": [2.0 + i / 10 for i in range(6)]})),
    "gemma2": ("Gemma2Config", dict(sliding_window=6, attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=6, sliding_window_pattern=2)),
    "gpt_oss": ("GptOssConfig", dict(MOE, sliding_window=6, rope_parameters=YARN)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=12, head_dim=8, num_key_value_heads=4,
        rope_parameters=YARN | {"mscale": 1.0, "mscale_all_dim": 1.0})),
    "qwen3_next": ("Qwen3NextConfig", dict(MOE, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2,
                                           shared_expert_intermediate_size=32)),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(linear_num_key_heads=2, linear_num_value_heads=4,
                                               linear_key_head_dim=8, linear_value_head_dim=8)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(MOE, linear_num_key_heads=2, linear_num_value_heads=4,
                                                      linear_key_head_dim=8, linear_value_head_dim=8,
                                                      shared_expert_intermediate_size=32)),
    "granite": ("GraniteConfig", dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5,
                                      attention_multiplier=0.2)),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),
    "ernie4_5": ("Ernie4_5Config", {}),
    "exaone4": ("Exaone4Config", dict(sliding_window=6)),
    "ministral": ("MinistralConfig", dict(sliding_window=6)),
    "llama4_text": ("Llama4TextConfig", dict(MOE, num_local_experts=4, intermediate_size_mlp=96)),
    "granitemoe": ("GraniteMoeConfig", dict(MOE, logits_scaling=4.0)),
    "nemotron_h": ("NemotronHConfig", dict(hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                                           ssm_state_size=16, n_groups=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(MOE, moe_num_experts=4, moe_k=2)),
    "olmoe": ("OlmoeConfig", dict(MOE)),
}
TOKENS = "0123456789+="


def build(name: str, folder: Path) -> torch.nn.Module:
    cls_name, features = FAMILIES[name]
    tok = build_char_tokenizer(TOKENS)
    ids = dict(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**{**BASE, **ids, **features})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # weights large enough that greedy has clear winners; norms and biases off their init
        for n, p in model.named_parameters():
            p.normal_(0, 0.2 if (p.ndim == 1 or "bias" in n) else 0.08)
    model.save_pretrained(folder)
    tok.save(folder)
    return model


def load(folder: Path, impl: str):
    if impl == "native":
        from twinplane.model import load_model
        return load_model(folder, device="cpu", dtype=torch.float32)
    from twinplane.model.hf import load_hf
    return load_hf(folder, "cpu", torch.float32)


def engine_for(model, impl: str, eos: int | None, pad: int):
    if impl == "native":
        from twinplane.rollout.engine import RolloutEngine
        return RolloutEngine(model, eos, pad, max_num_seqs=8, graphs=False)
    from twinplane.rollout.hf_engine import HFEngine
    return HFEngine(model, eos, pad, max_num_seqs=8)


def row(name: str, work: Path) -> dict:
    out = {"family": name}
    folder = work / name
    try:
        ref = build(name, folder)
    except Exception as e:  # transformers itself cannot build the config
        return out | {"impl": f"not built ({type(e).__name__})"}
    try:
        out["impl"] = choose(folder, "auto").impl
    except Exception as e:  # a refusal: one line
        return out | {"impl": f"refused: {str(e).splitlines()[0][:80]}"}
    tok = build_char_tokenizer(TOKENS)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, tok.vocab_size, (3, 20), generator=g)
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # one left-padded row
    try:
        model = load(folder, out["impl"])
        with torch.no_grad():
            ours, theirs = model(x, attention_mask=mask), ref(x, attention_mask=mask).logits
        out["loads"] = "yes"
        out["logit_gap"] = f"{(ours - theirs)[mask.bool()].abs().max().item():.1e}"
        prompts = [x[i, :6].tolist() for i in range(3)]
        samples = engine_for(model, out["impl"], tok.eos_token_id, tok.pad_token_id).generate(
            prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
        with torch.no_grad():
            expected = ref.generate(torch.tensor(prompts), max_new_tokens=10, do_sample=False,
                                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, 6:]
        same = all(s.token_ids == e.tolist()[:len(s.token_ids)] for s, e in zip(samples, expected, strict=True))
        out["greedy"] = "equal" if same else "differs"
        saved = work / f"{name}-saved"
        model.save_pretrained(saved) if out["impl"] == "hf" else __import__("twinplane").save_pretrained(model, saved)
        back = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
        with torch.no_grad():
            gap = (back(x, attention_mask=mask).logits - theirs)[mask.bool()].abs().max().item()
        out["round_trip"] = "equal" if gap < 1e-5 else f"gap {gap:.1e}"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        traceback.print_exc()
        return out
    cmd = [sys.executable, "-m", "twinplane.cli", "train", f"model.path={folder}", "train.steps=3",
           "warmstart.steps=0", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=6",
           "eval.before=false", "eval.after=false", "log.progress=false", "checkpoint.every=0",
           "--run-dir", str(work / f"{name}-run")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    out["train_3_steps"] = "exit 0" if done.returncode == 0 else f"exit {done.returncode}: " + (
        done.stderr.strip().splitlines() or [""])[-1][:100]
    return out


COLUMNS = ("family", "impl", "loads", "logit_gap", "greedy", "round_trip", "train_3_steps", "error")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated families (default: all)")
    ap.add_argument("--csv", default=None, help="append the rows to this CSV (benchmarks/results/ format)")
    ap.add_argument("--machine", default="epyc-2c")
    ns = ap.parse_args()
    names = ns.only.split(",") if ns.only else list(FAMILIES)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            rows.append(row(name, Path(d)))
            print(" | ".join(str(rows[-1].get(c, "")) for c in COLUMNS), flush=True)
    print("\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |")
    if ns.csv:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        head = [datetime.date.today().isoformat(), commit, ns.machine, torch.__version__, transformers.__version__]
        path = Path(ns.csv)
        new = not path.exists()
        with path.open("a") as f:
            if new:
                f.write("date,commit,machine,torch,transformers," + ",".join(COLUMNS) + "\n")
            for r in rows:
                f.write(",".join(head + [str(r.get(c, "")).replace(",", ";") for c in COLUMNS]) + "\n")


if __name__ == "__main__":
    main()

"""Rollout engine vs Hugging Face `generate` on RL-shaped sampling, same weights.

The work (issue 10): a random Qwen2-shaped model (6 layers x 512 hidden, GQA 8/2 heads of 64, ffn 1536, vocab
4096, fp32), 16 prompts (random ids, 16-128 tokens) x 8 samples, temperature 1, no top-k/top-p, 64 of the 4096
ids as stop tokens (so with near-uniform random logits, lengths are geometric with mean ~64) and at most 256 new
tokens. HF gets the 16 prompts left-padded with `num_return_sequences=8`; twinplane gets them as requests with n=8.
Reported: median over `--runs` of generated tokens/s (stop tokens included) for each, run side by side.

`--quarter-kv` adds the same work with the twinplane KV budget at a quarter of what a static cache would allocate
for it (128 rows x (longest prompt + 256) tokens): it checks that the greedy outputs and the seeded samples equal
an unconstrained run's, and reports the preemptions.

    python benchmarks/engine_vs_hf.py --runs 3 --quarter-kv
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import twinplane  # noqa: E402
from twinplane import platform  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402

VOCAB, STOPS = 4096, 64


def build(args, out: str) -> list[list[int]]:
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                                   max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0,
                                   eos_token_id=VOCAB - 1)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 129, (args.prompts,), generator=g).tolist()
    return [torch.randint(STOPS + 1, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


def stop_ids() -> list[int]:
    return list(range(VOCAB - STOPS, VOCAB))  # includes the EOS id (VOCAB - 1)


def run_hf(model, prompts, args, seed: int) -> tuple[int, float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=args.new_tokens, num_return_sequences=args.samples, eos_token_id=stop_ids(),
                         pad_token_id=0)
    seconds = time.perf_counter() - t0
    stops, seqs = set(stop_ids()), []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        seqs.append(row[:cut])
    return sum(map(len, seqs)), seconds, seqs


def run_twinplane(engine, prompts, args, seed: int, temperature: float = 1.0):
    sp = SamplingParams(temperature=temperature, max_new_tokens=args.new_tokens, n=args.samples,
                        stop_token_ids=stop_ids(), seed=seed)
    engine.pop_metrics()
    t0 = time.perf_counter()
    samples = engine.generate(prompts, sp)
    seconds = time.perf_counter() - t0
    return sum(len(s.token_ids) for s in samples), seconds, samples, engine.pop_metrics()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("layers", 6), ("hidden", 512), ("intermediate", 1536), ("prompts", 16), ("samples", 8),
                          ("new-tokens", 256), ("runs", 3), ("threads", 2), ("max-num-batched-tokens", 4096)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--quarter-kv", action="store_true", help="also run with a quarter of the static cache's bytes")
    p.add_argument("--only", choices=("both", "twinplane", "hf"), default="both")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    platform.tune_host_allocator()  # what `twinplane train` does on CPU; process-wide, so HF runs with it too
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = build(args, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        model = twinplane.load_model(tmp, device="cpu")
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=None, max_num_seqs=512,
                           max_num_batched_tokens=args.max_num_batched_tokens)
    res = {"twinplane": [], "hf": [], "twinplane_metrics": []}
    for r in range(args.runs):  # alternate, so both see the same machine load
        if args.only in ("both", "twinplane"):
            n, s, _, m = run_twinplane(engine, prompts, args, seed=r)
            res["twinplane"].append(n / s)
            res["twinplane_metrics"].append(m)
            print(f"run {r}: twinplane {n} tokens in {s:.2f} s = {n / s:.0f} tok/s (running mean "
                  f"{m['rollout/running_seqs_mean']:.1f}, KV peak {m['rollout/kv_cache_usage_peak']:.2f})")
        if args.only in ("both", "hf"):
            n, s, _ = run_hf(hf, prompts, args, seed=r)
            res["hf"].append(n / s)
            print(f"run {r}: HF        {n} tokens in {s:.2f} s = {n / s:.0f} tok/s")
    out = {"shapes": vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__}
    for k in ("twinplane", "hf"):
        if res[k]:
            out[f"{k}_tokens_per_s_median"] = statistics.median(res[k])
            out[f"{k}_tokens_per_s"] = res[k]
    if res["twinplane"] and res["hf"]:
        out["ratio"] = out["twinplane_tokens_per_s_median"] / out["hf_tokens_per_s_median"]
        print(f"median tokens/s: twinplane {out['twinplane_tokens_per_s_median']:.0f}, "
              f"HF {out['hf_tokens_per_s_median']:.0f}, ratio {out['ratio']:.2f}x")
    if args.quarter_kv:
        out["quarter_kv"] = quarter_kv(model, prompts, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def quarter_kv(model, prompts, args) -> dict:
    cfg = model.config
    static = (len(prompts) * args.samples * (max(map(len, prompts)) + args.new_tokens) * cfg.num_layers * 2
              * cfg.num_kv_heads * cfg.head_dim * 4)
    full = RolloutEngine(copy.deepcopy(model), eos_token_id=None,
                         max_num_batched_tokens=args.max_num_batched_tokens)
    small = RolloutEngine(copy.deepcopy(model), eos_token_id=None, kv_cache_bytes=static // 4,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    out = {"static_cache_bytes": static, "kv_cache_bytes": static // 4}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        _, s_full, a, _ = run_twinplane(full, prompts, args, seed=0, temperature=temperature)
        n, s_small, b, m = run_twinplane(small, prompts, args, seed=0, temperature=temperature)
        same = [x.token_ids for x in a] == [y.token_ids for y in b]
        out[name] = {"identical": same, "preemptions": m["rollout/preemptions"],
                     "kv_cache_usage_peak": m["rollout/kv_cache_usage_peak"], "seconds_full": s_full,
                     "seconds_quarter": s_small, "tokens": n}
        print(f"quarter KV ({static // 4 / 2**20:.0f} MiB of {static / 2**20:.0f}), {name}: outputs identical to "
              f"the unconstrained run: {same}; preemptions {m['rollout/preemptions']}; {s_small:.2f} s vs "
              f"{s_full:.2f} s unconstrained")
    return out


if __name__ == "__main__":
    main()

"""Training cost of a long-tail batch vs a uniform one with the same real tokens, and the peak memory one
`Trainer.train_step` adds, on a Qwen2-shaped model with a 32k vocabulary (random weights, CPU or GPU).

`python benchmarks/long_tail.py speed [--runs 3]`: tokens/s (real prompt + response tokens per second) of
`train_step` on (a) responses drawn from a geometric distribution with mean ~64 and one at the 512 cap, (b) the
same number of sequences and real tokens at uniform length; padded and packed (`train.packing`), without and
with `train.max_tokens_per_micro_batch=4096`. Runs are interleaved; the median of `--runs` is reported.
`python benchmarks/long_tail.py memory`: peak memory added by one train_step with 8 x 512 response tokens, each
configuration in a fresh subprocess (CPU: peak RSS over the steady state after a warm-up step; GPU: peak
allocated), as a multiple of one fp32 [tokens, vocab] logits copy; the last one with activation checkpointing.
`python benchmarks/long_tail.py prompts [--runs 3]`: train_step time on GRPO-shaped batches (4 prompts x 8 samples,
the long-tail responses above, prompts of 32 and of 512 tokens) with and without `train.share_prompts`,
interleaved; the median of `--runs`.
`python benchmarks/long_tail.py varlen [--against REV]`: forward + backward time of the portable varlen attention
(`sdpa_varlen`) on the demo's lengths and on a long tail; with `--against`, the same calls through
twinplane/model/attention.py as of git revision REV, interleaved in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from twinplane.config import AlgoSection, TrainSection
from twinplane.model import ModelConfig, Transformer
from twinplane.train import Batch, Trainer

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(vocab_size=32768, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=64, tie_word_embeddings=False, qkv_bias=True)  # Qwen2's shape, scaled to 2 CPU cores
SEQS, PROMPT, MEAN, CAP = 32, 32, 64, 512


def lengths(kind: str, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    geo = torch.distributions.Geometric(probs=torch.tensor(1.0 / MEAN))
    torch.manual_seed(seed)
    tail = (geo.sample((SEQS,)).long() + 1).clamp(max=CAP).tolist()
    tail[int(torch.randint(SEQS, (1,), generator=g))] = CAP  # one response at the cap
    if kind == "long_tail":
        return tail
    total = sum(tail)
    return [total // SEQS + (i < total % SEQS) for i in range(SEQS)]


def make_batch(resp_lens: list[int], vocab: int, prompt: int = PROMPT) -> Batch:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (len(resp_lens), prompt), generator=g).tolist()
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in resp_lens]
    b = Batch.collate(prompts, responses, 0)
    b.rollout_logprobs = torch.full(b.response_mask.shape, -3.0) * b.response_mask
    b.advantages = torch.randn(len(resp_lens), 1, generator=g) * b.response_mask
    return b


def trainer(device: torch.device, **train) -> Trainer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL)).to(device)
    return Trainer(model, TrainSection(lr=1e-5, **train), AlgoSection(), 1.0, 100)


def timed_step(tr: Trainer, batch: Batch, device: torch.device) -> float:
    t0 = time.perf_counter()
    tr.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def speed(runs: int, device: torch.device, only: list[str] | None = None) -> dict:
    batches = {k: make_batch(lengths(k), MODEL["vocab_size"]) for k in ("long_tail", "uniform")}
    real = {k: int(b.attention_mask.sum()) for k, b in batches.items()}
    assert real["long_tail"] == real["uniform"]
    configs = {"padded": dict(packing=False, micro_batch_size=8), "packed": dict(packing=True, micro_batch_size=8),
               "padded_4096": dict(packing=False, micro_batch_size=SEQS, max_tokens_per_micro_batch=4096),
               "packed_4096": dict(packing=True, micro_batch_size=SEQS, max_tokens_per_micro_batch=4096)}
    configs = {k: v for k, v in configs.items() if not only or k in only}
    trainers = {name: trainer(device, **c) for name, c in configs.items()}
    for tr in trainers.values():  # warm-up
        tr.train_step(batches["uniform"].select(slice(0, 2)))
    times = {(n, k): [] for n in configs for k in batches}
    for _ in range(runs):
        for name, tr in trainers.items():
            for k, b in batches.items():
                times[(name, k)].append(timed_step(tr, b, device))
    out = {"real_tokens": real["uniform"], "response_lengths_long_tail": lengths("long_tail"), "runs": runs}
    for name in configs:
        tps = {k: real[k] / statistics.median(times[(name, k)]) for k in batches}
        out[name] = {"long_tail_tok_s": round(tps["long_tail"], 1), "uniform_tok_s": round(tps["uniform"], 1),
                     "ratio": round(tps["long_tail"] / tps["uniform"], 3),
                     "seconds_long_tail": [round(t, 3) for t in times[(name, "long_tail")]],
                     "seconds_uniform": [round(t, 3) for t in times[(name, "uniform")]]}
    return out


def prompts(runs: int, device: torch.device) -> dict:
    """Shared prompts vs one copy per sample: the same GRPO batch, one micro-batch (groups stay whole)."""
    resp, groups, n = lengths("long_tail"), 4, SEQS // 4
    g = torch.Generator().manual_seed(2)
    out = {"runs": runs, "groups": groups, "samples": n}
    for plen in (32, 512):
        batch = make_batch(resp, MODEL["vocab_size"], prompt=plen)
        for i in range(SEQS):  # rows i..i+n-1 of a group share its first row's prompt
            batch.input_ids[i, :plen] = batch.input_ids[i - i % n, :plen]
        batch.advantages = torch.randn(SEQS, 1, generator=g) * batch.response_mask
        trainers = {share: trainer(device, micro_batch_size=SEQS, share_prompts=share) for share in (True, False)}
        for tr in trainers.values():  # warm-up
            tr.train_step(batch.select(slice(0, 2)))
        times = {share: [] for share in trainers}
        for _ in range(runs):
            for share, tr in trainers.items():
                times[share].append(timed_step(tr, batch, device))
        real = int(batch.attention_mask.sum())
        med = {share: statistics.median(t) for share, t in times.items()}
        out[f"prompt_{plen}"] = {"tokens": real, "tokens_computed_shared": real - (n - 1) * groups * plen,
                                 "seconds_shared": round(med[True], 3), "seconds_unshared": round(med[False], 3),
                                 "speedup": round(med[False] / med[True], 2)}
    return out


def measure_memory(packing: bool, chunk: int, device: str, checkpointing: bool = False) -> float:
    """Bytes one train_step (8 x 512 response tokens) adds over the steady state (weights, grads, Adam)."""
    import resource

    dev = torch.device(device)
    tr = trainer(dev, packing=packing, micro_batch_size=8, logprob_chunk_tokens=chunk,
                 activation_checkpointing=checkpointing)
    tr.train_step(make_batch([4] * 8, MODEL["vocab_size"], prompt=4))  # creates grads and Adam state
    batch = make_batch([512] * 8, MODEL["vocab_size"])
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tr.train_step(batch)
        return torch.cuda.max_memory_allocated() - base
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tr.train_step(batch)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base


def memory(device: str) -> dict:
    logits_copy = 8 * 512 * MODEL["vocab_size"] * 4
    out = {"fp32_logits_copy_mb": logits_copy / 1e6}
    for packing, chunk, ckpt in ((True, 512, False), (True, 4096, False), (False, 512, False), (True, 512, True)):
        code = (f"from benchmarks.long_tail import measure_memory; "
                f"print(measure_memory({packing}, {chunk}, {device!r}, {ckpt}))")
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        added = float(res.stdout.strip().splitlines()[-1])
        name = f"{'packed' if packing else 'padded'}_chunk{chunk}{'_ckpt' if ckpt else ''}"
        out[name] = {"added_mb": round(added / 1e6, 1), "x_logits_copy": round(added / logits_copy, 3)}
    return out


def varlen(runs: int, against: str) -> dict:
    import importlib
    import importlib.util
    import tempfile

    impls = {"current": importlib.import_module("twinplane.model.attention")}
    if against:
        src = subprocess.run(["git", "show", f"{against}:twinplane/model/attention.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        path = Path(tempfile.mkdtemp()) / "attention_old.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("attention_old", path)
        impls[against] = sys.modules["attention_old"] = importlib.util.module_from_spec(spec)  # dataclasses need it
        spec.loader.exec_module(impls[against])
    g = torch.Generator().manual_seed(0)
    shapes = {"demo_128x11-17": torch.randint(11, 18, (128,), generator=g).tolist(),
              "tail_64x100+geo64": [100 + n for n in lengths("long_tail")] * 2}
    out = {}
    for name, lens in shapes.items():
        T = sum(lens)
        q, k, v = (torch.randn(1, h, T, 64, generator=g).requires_grad_() for h in (8, 2, 2))
        times = {impl: [] for impl in impls}
        for _ in range(runs + 1):  # the first round warms up
            for impl, mod in impls.items():
                t0 = time.perf_counter()
                mod.sdpa_varlen(q, k, v, mod.AttentionMetadata.packed(lens)).sum().backward()
                times[impl].append(time.perf_counter() - t0)
        out[name] = {impl: round(statistics.median(t[1:]), 4) for impl, t in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["speed", "memory", "varlen", "prompts"])
    ap.add_argument("--against", default="", help="varlen: a git revision to compare with")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--configs", default="", help="comma-separated subset of padded,packed,padded_4096,packed_4096")
    ns = ap.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    only = [c for c in ns.configs.split(",") if c]
    if ns.what == "varlen":
        res = varlen(ns.runs, ns.against)
    elif ns.what == "prompts":
        res = prompts(ns.runs, torch.device(ns.device))
    else:
        res = speed(ns.runs, torch.device(ns.device), only) if ns.what == "speed" else memory(ns.device)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA vs full fine-tuning: trainable parameters, AdamW state bytes, and weight-sync bytes/time (in process).

  python benchmarks/lora_sync.py [--hidden 1024 --layers 12 --rank 16 --repeats 5]

Builds a Llama-shaped model (vocab 32000, intermediate 4 x hidden), one trainer per mode, takes one optimizer step
each (so the AdamW state exists) and times `sync_in_process` (trainer -> engine copy, re-packing of the engine's
CPU GEMM weights, and the verification: bitwise comparison of full weights, checksums for adapters) for: full weights
(no LoRA), adapters only (LoRA, engine holds the base) and merged (LoRA, `rollout.lora_merge`), interleaved, median
of `--repeats` syncs after a warm-up. "transfer" is the copy and re-packing alone.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from twinplane.cluster.sync import sync_in_process
from twinplane.config import AlgoSection, TrainSection
from twinplane.model import ModelConfig, Transformer
from twinplane.model.lora import adapter_numel, apply_lora, merge_lora
from twinplane.rollout import RolloutEngine
from twinplane.train import Batch, Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_layers=a.layers,
                     num_heads=a.hidden // 64, num_kv_heads=a.hidden // 128, head_dim=64, tie_word_embeddings=False)
    base = Transformer(mc).eval()
    lora = copy.deepcopy(base)
    apply_lora(lora, a.rank, 2.0 * a.rank)
    batch = Batch.collate([[1, 2, 3, 4]] * 2, [[5, 6, 7]] * 2, 0, [[-1.0] * 3] * 2)
    batch.advantages = torch.tensor([[1.0], [-1.0]]) * batch.response_mask
    modes = {}
    for name, model in (("full", base), ("lora", lora)):
        tr = Trainer(model, TrainSection(lr=1e-4), AlgoSection(), 1.0, 10)
        tr.train_step(batch)
        state_bytes = sum(v.numel() * v.element_size() for st in tr.opt.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"{name}: {trainable / 1e6:.2f}M trainable of {mc.num_params / 1e6:.1f}M params, "
              f"AdamW state {state_bytes / 1e6:.1f} MB")
        modes[name] = tr
    engines = {"full": RolloutEngine(copy.deepcopy(base), None), "adapters": RolloutEngine(copy.deepcopy(lora), None),
               "merged": RolloutEngine(merge_lora(copy.deepcopy(lora)), None)}
    trainers = {"full": modes["full"], "adapters": modes["lora"], "merged": modes["lora"]}
    times = {k: [] for k in engines}
    copies = {k: [] for k in engines}
    sizes = {}
    for i in range(a.repeats + 1):  # interleaved, the first round is a warm-up (and the base checksum cache)
        for k, eng in engines.items():
            t0 = time.perf_counter()
            rep = sync_in_process(eng, trainers[k], version=i + 1)
            dt = time.perf_counter() - t0
            assert rep.mismatched() == [], k
            sizes[k] = rep.bytes
            if i:
                times[k].append(dt)
                copies[k].append(rep.seconds)
    print(f"adapters: {adapter_numel(lora) / 1e6:.2f}M params (rank {a.rank}, every attention/MLP linear)")
    for k in engines:
        med = statistics.median(times[k])
        runs = " ".join(f"{t * 1e3:.0f}" for t in times[k])
        print(f"sync {k:<9} {sizes[k] / 1e6:9.2f} MB  median {med * 1e3:8.1f} ms with verification, "
              f"{statistics.median(copies[k]) * 1e3:8.1f} ms transfer  runs {runs}")


if __name__ == "__main__":
    main()

"""Training-plane throughput: tokens/s and MFU of `Trainer.train_step` under FSDP2 on N local ranks.

  python benchmarks/fsdp_throughput.py --shape qwen2-0.5b --ranks 1 --batch 8 --prompt 256 --response 768
  python benchmarks/fsdp_throughput.py --shape tiny --ranks 2        # a CPU smoke run (gloo)

The model is built from a Qwen2-shaped config with random weights (nothing downloaded); each step is the real GRPO
update (clipped loss, micro-batches, clipping, AdamW) on random tokens of fixed length. Prints one JSON line: the
median over the measured steps of tokens/s (all ranks) and MFU against the device's peak (`twinplane doctor`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {  # Qwen2-0.5B's published config.json shape; tiny for CPU smoke runs
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                       num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True, rope_theta=1e6,
                       tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(model_type="qwen2", vocab_size=1000, hidden_size=128, intermediate_size=512, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True, tie_word_embeddings=True),
}


def worker(rank: int, a: argparse.Namespace, rdzv: str) -> None:
    from twinplane.config import AlgoSection, TrainSection
    from twinplane.model import ModelConfig, Transformer
    from twinplane.model.flops import train_flops
    from twinplane.platform import hardware, runtime
    from twinplane.train import Batch, Trainer
    from twinplane.train.fsdp import shard_model

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(runtime.dist_backend(device), init_method=f"file://{rdzv}", rank=rank,
                            world_size=a.ranks, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[a.shape])
    model = shard_model(Transformer(cfg).to(device))  # fp32 master weights, bf16 compute on GPU
    if a.checkpointing:
        model.activation_checkpointing = True
    train = TrainSection(micro_batch_size=a.micro_batch, lr=1e-6)
    trainer = Trainer(model, train, AlgoSection(), 1.0, a.steps + a.warmup, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    n = a.batch  # rows per rank
    prompts = torch.randint(0, cfg.vocab_size, (n, a.prompt), generator=g).tolist()
    responses = torch.randint(0, cfg.vocab_size, (n, a.response), generator=g).tolist()
    batch = Batch.collate(prompts, responses, 0, [[-1.0] * a.response] * n)
    batch.advantages = torch.randn(n, 1, generator=g) * batch.response_mask
    times = []
    for i in range(a.warmup + a.steps):
        hardware.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(batch)
        hardware.synchronize(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        info = hardware.detect()
        tokens = a.ranks * n * (a.prompt + a.response)
        step = statistics.median(times)
        flops = train_flops(cfg, tokens, a.prompt + a.response, a.ranks * n * a.response) / step
        print(json.dumps({"shape": a.shape, "params_M": round(cfg.num_params / 1e6, 1), "ranks": a.ranks,
                          "device": info.device_name, "tokens_per_step": tokens, "step_s_median": round(step, 4),
                          "tokens_per_s": round(tokens / step, 1),
                          "tflops_per_device": round(flops / a.ranks / 1e12, 2),
                          "mfu": None if not info.peak_flops else round(flops / a.ranks / info.peak_flops, 4),
                          "peak_source": info.peak_source, "torch": torch.__version__}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=768)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--checkpointing", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(a, f"{d}/rdzv"), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()

"""Check `twinplane.tools.plan`'s memory estimates against measured peaks on the CPU (fp32, no sharding).

Each measurement runs in a fresh subprocess and reports the increase of the process's peak RSS
(`ru_maxrss`) over its baseline after imports: building the model, then either two training steps (Adam state
exists in the second, as in steady state; two micro-batches so grads are live during a micro-batch's backward)
or one `RolloutEngine.generate`. Usage: `python benchmarks/plan_memory_check.py [demo|100m ...]`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from twinplane.model import ModelConfig
from twinplane.model.memory import Dtypes, Workload, rollout_memory, training_memory
from twinplane.tools.plan import CPU

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "demo": dict(vocab_size=15, hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=32, tie_word_embeddings=True),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                 num_kv_heads=12, head_dim=64, tie_word_embeddings=False),
}
WORKLOADS = {  # batch shapes that keep each run to seconds on 2 cores but make the activations count
    "demo": Workload(prompts_per_step=8, n=8, prompt_len=64, response_len=64, micro_batch_size=32),
    "100m": Workload(prompts_per_step=4, n=2, prompt_len=128, response_len=128, micro_batch_size=4),
}


def measure(name: str, plane: str, warmup: bool = True) -> float:
    """Peak RSS increase in bytes of one run in this process (call it in a fresh subprocess). A first run on a
    tiny model faults in the code pages and allocator arenas the kernels use, so the baseline excludes them."""
    import resource

    import torch

    from twinplane.config import AlgoSection, TrainSection
    from twinplane.model import Transformer
    from twinplane.rollout import RolloutEngine, SamplingParams
    from twinplane.train import Batch, Trainer

    if warmup:
        tiny = dict(MODELS["demo"], hidden_size=32, intermediate_size=64, head_dim=8, num_layers=1)
        MODELS["_warmup"], WORKLOADS["_warmup"] = tiny, Workload(2, 2, 4, 4, 2)
        measure("_warmup", plane, warmup=False)
    torch.manual_seed(0)
    w = WORKLOADS[name]
    cfg = ModelConfig(**MODELS[name])
    v = cfg.vocab_size
    prompts = torch.randint(1, v, (w.sequences, w.prompt_len)).tolist()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = Transformer(cfg)
    if plane == "rollout":
        engine = RolloutEngine(model, eos_token_id=None, max_num_seqs=w.sequences)
        engine.generate(prompts[:w.prompts_per_step], SamplingParams(max_new_tokens=w.response_len, n=w.n, seed=0))
    else:
        trainer = Trainer(model, TrainSection(micro_batch_size=w.micro_batch_size), AlgoSection(), 1.0, 10)
        responses = torch.randint(1, v, (w.sequences, w.response_len)).tolist()
        for _ in range(2):
            batch = Batch.collate(prompts, responses, 0)
            batch.rollout_logprobs = torch.full(batch.response_mask.shape, -1.0) * batch.response_mask
            batch.advantages = torch.randn(w.sequences, 1) * batch.response_mask
            trainer.train_step(batch)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base


def estimate(name: str, plane: str) -> float:
    w, cfg = WORKLOADS[name], ModelConfig(**MODELS[name])
    if plane == "rollout":
        return rollout_memory(cfg, Dtypes.for_device(CPU), w).total
    return training_memory(cfg, Dtypes.for_device(CPU), w).total


def check(name: str, plane: str) -> dict:
    """Estimate, measurement (fresh subprocess) and their ratio."""
    code = f"from benchmarks.plan_memory_check import measure; print(measure({name!r}, {plane!r}))"
    # Fixed mmap threshold: large tensors are mmap'd and returned on free, so the RSS peak tracks live tensors
    # rather than glibc's heap retention (its dynamic threshold otherwise keeps freed 1-32 MB blocks resident).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    measured = float(out.stdout.strip().splitlines()[-1])
    est = estimate(name, plane)
    return {"model": name, "plane": plane, "estimate_mb": est / 1e6, "measured_mb": measured / 1e6,
            "ratio": est / measured}


def main(argv: list[str]) -> int:
    ok = True
    for name in argv or list(MODELS):
        for plane in ("train", "rollout"):
            r = check(name, plane)
            ok &= 0.75 <= r["ratio"] <= 1.25
            print(json.dumps(r))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Weight sync into a running vLLM engine (`rollout.backend=vllm`): bytes and seconds per sync, each verified by the
checksum the engine computes of what it loaded.

Models: `demo` is `twinplane train`'s default model (1.05M parameters, tied embeddings); `250m` a Llama-shaped
model of 251M parameters (13 layers x 1024 hidden, 16 heads, ffn 4096, vocabulary 32000, tied), random weights,
fp32 (the CPU engine's dtype). Each sync sends new weights (the previous ones plus noise) through
`VllmEngine.load_weights` (vLLM's in-place reload plus the in-engine checksum), then the sender's checksum of what it
sent, as `cluster.sync.sync_in_process` does; the two must be equal.

    python benchmarks/vllm_sync.py --model demo --syncs 3
    python benchmarks/vllm_sync.py --model 250m --syncs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from twinplane.config import Config
from twinplane.data.tasks import ALPHABET
from twinplane.model import ModelConfig, Transformer
from twinplane.model.checksum import weights_checksum
from twinplane.run.prepare import demo_model_config
from twinplane.tokenizer import build_char_tokenizer

MODELS = {
    "demo": lambda: demo_model_config(Config(), build_char_tokenizer(ALPHABET)),
    "250m": lambda: ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_layers=13,
                                num_heads=16, num_kv_heads=16, head_dim=64, max_position_embeddings=2048,
                                tie_word_embeddings=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, default="demo")
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from twinplane.rollout.vllm_backend import VllmEngine

    torch.manual_seed(0)
    model = Transformer(MODELS[args.model]()).eval().requires_grad_(False)
    t0 = time.perf_counter()
    engine = VllmEngine(model, eos_token_id=None)
    start = time.perf_counter() - t0
    rows = []
    for i in range(args.syncs):
        with torch.no_grad():
            for w in model.parameters():
                w.add_(torch.randn_like(w), alpha=1e-3)
        named = list(model.named_parameters())
        t0 = time.perf_counter()
        held = engine.load_weights(named, version=i + 1)
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        sent = weights_checksum(named)
        check = time.perf_counter() - t0
        assert held == sent, f"sync {i}: engine checksum {held} != sender's {sent}"
        rows.append({"bytes": sum(t.nbytes for _, t in named), "load_s": load, "sender_checksum_s": check})
        print(f"sync {i}: {rows[-1]['bytes'] / 2**20:.1f} MiB loaded in {load:.3f} s (the engine's checksum "
              f"included), sender's checksum {check:.3f} s; checksums equal", flush=True)
    import vllm

    out = {"model": args.model, "params": model.config.num_params, "engine_start_s": start, "syncs": rows,
           "bytes": rows[0]["bytes"], "load_s_median": statistics.median(r["load_s"] for r in rows),
           "sender_checksum_s_median": statistics.median(r["sender_checksum_s"] for r in rows),
           "torch": torch.__version__, "vllm": vllm.__version__, "threads": args.threads}
    print(f"{args.model} ({out['params'] / 1e6:.1f}M params): {out['bytes'] / 2**20:.1f} MiB per sync, "
          f"median {out['load_s_median']:.3f} s into vLLM + {out['sender_checksum_s_median']:.3f} s sender checksum; "
          f"engine start {start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

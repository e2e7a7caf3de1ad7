"""Rollout routing replay on CPU: engine in bf16, trainer in fp32, log-prob gap and routing agreement with and
without replay, on a random-weight Qwen3-MoE-shaped model (not trained: router near-ties are what bf16 flips).

    python benchmarks/moe_replay.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from twinplane.config import AlgoSection, TrainSection
from twinplane.model import ModelConfig, Transformer
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.train import Batch, Trainer


def model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=32, model_type="qwen3_moe", qk_norm=True, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.1)
    return m.eval()


def measure(seed: int) -> dict:
    policy = model(seed)
    engine = RolloutEngine(copy.deepcopy(policy).to(torch.bfloat16), eos_token_id=None, seed=seed, record_routing=True)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 64, (int(n),), generator=g).tolist() for n in torch.randint(4, 24, (16,), generator=g)]
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32, n=4))
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0,
                          [s.logprobs for s in samples], routing=[s.routing for s in samples])
    batch.advantages = torch.zeros_like(batch.response_mask)
    out = {}
    for replay in (False, True):
        trainer = Trainer(copy.deepcopy(policy), TrainSection(micro_batch_size=16), AlgoSection(routing_replay=replay),
                          temperature=1.0, total_steps=1)
        m = trainer.train_step(batch)
        key = "replay" if replay else "no_replay"
        out[key] = {"logprob_gap": m["actor/logprob_gap"], "routing_agreement": m["rollout/routing_agreement"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    runs = [measure(s) for s in range(ns.seeds)]
    for r in runs:
        print(json.dumps(r))
    med = {k: {m: statistics.median(r[k][m] for r in runs) for m in runs[0][k]} for k in runs[0]}
    print("median", json.dumps(med))


if __name__ == "__main__":
    main()

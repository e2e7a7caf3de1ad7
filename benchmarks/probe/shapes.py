"""The model shapes the probe measures, and an RL batch's lengths."""

from __future__ import annotations

import math

import torch

# Qwen2.5-0.5B and -1.5B's published shapes; "tiny" for --smoke
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, qkv_bias=True, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, tie_word_embeddings=True,
                 max_position_embeddings=2048),
}


def rl_lengths(n: int, prompt: tuple[int, int], mean: int, cap: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt lengths uniform in `prompt`, response lengths geometric with `mean`, capped at `cap` (an RL batch)."""
    g = torch.Generator().manual_seed(seed)
    ps = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g).tolist()
    u = torch.rand(n, generator=g).clamp_min(1e-9)
    rs = [min(cap, max(1, int(-mean * math.log(x)))) for x in u.tolist()]
    return ps, rs

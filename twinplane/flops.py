"""FLOPs per token from the model config: dense matmuls plus the attention quadratic term.

Forward FLOPs per token = 2 * (matmul parameters) + 2 * 2 * L * H * hd * context (QK^T and AV over the keys the
token attends to; `context` is the mean number of visible keys: about T/2 for causal training over T tokens).
Training (forward + backward) is 3x the forward. Embedding lookups are not matmuls and are not counted; the LM
head is. This is the PaLM-appendix accounting, without activation recomputation.
"""

from __future__ import annotations

from twinplane.model import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    d, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    attn = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * d * cfg.intermediate_size
    return L * (attn + mlp) + d * cfg.vocab_size  # + LM head


def forward_flops_per_token(cfg: ModelConfig, context: float) -> float:
    return 2.0 * matmul_params(cfg) + 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


def train_flops_per_token(cfg: ModelConfig, seq_len: float) -> float:
    """Forward + backward per token of a causal training pass over sequences of `seq_len` tokens."""
    return 3.0 * forward_flops_per_token(cfg, seq_len / 2)

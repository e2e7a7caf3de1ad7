"""FLOPs per token from the model config: dense matmuls plus the attention quadratic term.

Forward FLOPs per token = 2 * (matmul parameters) + 2 * 2 * L * H * hd * context (QK^T and AV over the keys the
token attends to; `context` is the mean number of visible keys: about T/2 for causal training over T tokens), L the
attention layers. A hybrid's linear-attention (Gated DeltaNet) layers count their projections and convolution as
matmul parameters and the chunked delta rule per token instead (`deltanet_flops_per_token`), whatever the context.
Training (forward + backward) is 3x the forward. Embedding lookups are not matmuls and are not counted. The LM head
counts only for the tokens whose logits are computed: every decoded token, but in a training pass only the response
tokens (the trainer's log-probs) and in a prefill only the last prompt token. This is the PaLM-appendix accounting,
without activation recomputation (nor the chunked log-probs' recomputed LM-head GEMM).
MoE: a token runs its top-k experts (plus any shared expert and the router), so FLOPs count active parameters;
memory (`ModelConfig.num_params`) counts every expert.
"""

from __future__ import annotations

from twinplane.model.config import ModelConfig
from twinplane.model.params import counts

# the chunk length of the delta rule's chunked form (twinplane.model.deltanet.chunked's default)
DELTANET_CHUNK = 64


def attention_layer_count(cfg: ModelConfig) -> int:
    """Layers that attend: all but a hybrid's linear-attention ones (a transformers model's config: all)."""
    return cfg.num_layers - len(getattr(cfg, "linear_layers", ()))


def deltanet_flops_per_token(cfg: ModelConfig, chunk: int = DELTANET_CHUNK) -> float:
    """The gated delta rule's forward FLOPs per token and linear layer, in its chunked form (training, prefill),
    per value head (keys repeated to the value heads), C the chunk length:
      within a chunk: K K^T and Q K^T (2 C d_k each), the two unit-triangular solves for the deltas' parts (C d_v
      and C d_k: C^2 per right-hand column, per chunk), the scores times the deltas (2 C d_v): C (5 d_k + 3 d_v);
      across chunks: the chunk's initial state read by the queries and by w (2 d_k d_v each) and updated by
      K^T D (2 d_k d_v): 6 d_k d_v.
    The recurrent form a one-token decode runs costs about the second part alone; elementwise decays, gates and
    norms are not counted (as for attention's softmax)."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return float(cfg.linear_num_value_heads) * (chunk * (5 * dk + 3 * dv) + 6 * dk * dv)


def matmul_params(cfg: ModelConfig) -> int:
    """Matmul parameters one token runs through (active experts only): the decoder layers' weights, counted
    exactly (`twinplane.model.params`: a Gated DeltaNet layer's projections and its depthwise convolution's taps,
    one multiply-add per tap and channel, included), and the LM head. A transformers model's config: its layers'
    2-D weights as counted on the meta device."""
    d = cfg.hidden_size
    if isinstance(cfg, ModelConfig):
        return counts(cfg).layer_matmul + d * cfg.vocab_size
    mlp = sum(cfg.mlp_params(i, cfg.num_experts_per_tok) for i in range(cfg.num_layers))
    return cfg.num_layers * cfg.attn_params + mlp + d * cfg.vocab_size


def mlp_width(cfg: ModelConfig) -> float:
    """Per-token MLP hidden width, mean over layers: intermediate_size for dense layers, top-k x the expert's
    width (+ the shared expert's) for sparse ones. What activation memory scales with."""
    widths = [cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
              if cfg.is_moe_layer(i) else cfg.intermediate_size for i in range(cfg.num_layers)]
    return sum(widths) / cfg.num_layers


def decode_read_params(cfg: ModelConfig, batch: int) -> float:
    """Parameters one decode step over `batch` sequences reads: everything but the routed experts, plus the
    experts at least one of the batch's tokens picks (expected E * (1 - (1 - k/E)^batch) per sparse layer,
    assuming balanced independent routing). Active parameters at batch 1, every parameter at large batch."""
    if not cfg.num_experts:
        return float(cfg.num_params)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    expert = sum(counts(cfg).expert)  # one routed expert of every sparse layer
    return cfg.num_params - E * expert + E * (1 - (1 - k / E) ** batch) * expert


def lm_head_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs of the LM head for one token's logits."""
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def forward_flops_per_token(cfg: ModelConfig, context: float, lm_head: bool = True) -> float:
    """One token's forward over `context` visible keys, its logits included or not (`lm_head`)."""
    # QK^T over the q/k width, AV over the values' (latent attention: they differ)
    qk, v = (cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim) if cfg.kv_lora_rank else (cfg.head_dim,) * 2
    flops = 2.0 * matmul_params(cfg) + 2.0 * attention_layer_count(cfg) * cfg.num_heads * (qk + v) * context
    if getattr(cfg, "linear_layers", ()):
        flops += len(cfg.linear_layers) * deltanet_flops_per_token(cfg)
    return flops if lm_head else flops - lm_head_flops(cfg)


def train_flops(cfg: ModelConfig, tokens: float, seq_len: float, logit_tokens: float) -> float:
    """Forward + backward of a causal training pass over `tokens` tokens in sequences of `seq_len` tokens, of which
    `logit_tokens` go through the LM head (the response tokens)."""
    return 3.0 * (tokens * forward_flops_per_token(cfg, seq_len / 2, lm_head=False) + logit_tokens * lm_head_flops(cfg))

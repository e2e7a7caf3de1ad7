"""Published model shapes by name, so `twinplane plan --model Qwen2.5-7B` needs no local config.json.

Each preset is the `config.json` of the named Hugging Face checkpoint (the base model where there is one; the
-Instruct checkpoint has the same shape, only its context length and EOS token may differ), reduced to the keys
that set the shape: sizes, heads, vocabulary, tied embeddings, experts, context length, rope and norm constants.
Names match case-insensitively, with or without the organisation (`Qwen/`, `meta-llama/`) and an `-Instruct`
suffix.
"""

from __future__ import annotations

from twinplane.model.config import ModelConfig

# Llama 3.1 and 3.2 scale rope by `factor` over an 8192-token original context
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_LLAMA32_ROPE = _LLAMA31_ROPE | {"factor": 32.0}


def _hf(model_type: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
        tie: bool, max_pos: int, theta: float, eps: float, head_dim: int | None = None, **extra) -> dict:
    return {"model_type": model_type, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim or hidden // heads, "vocab_size": vocab, "tie_word_embeddings": tie,
            "max_position_embeddings": max_pos, "rope_theta": theta, "rms_norm_eps": eps, **extra}


def _qwen25(hidden, intermediate, layers, heads, kv_heads, tie, max_pos, eps) -> dict:
    return _hf("qwen2", hidden, intermediate, layers, heads, kv_heads, 151936 if tie else 152064, tie, max_pos,
               1e6, eps)


def _qwen3(hidden, intermediate, layers, heads, kv_heads, tie) -> dict:
    return _hf("qwen3", hidden, intermediate, layers, heads, kv_heads, 151936, tie, 40960, 1e6, 1e-6, head_dim=128)


def _llama(hidden, intermediate, layers, heads, tie, rope, head_dim=None) -> dict:
    return _hf("llama", hidden, intermediate, layers, heads, 8, 128256, tie, 131072, 500000.0, 1e-5,
               head_dim=head_dim, rope_scaling=rope)


# name -> config.json keys; the comment is the checkpoint the values were read from
PRESETS: dict[str, dict] = {
    "Qwen2.5-0.5B": _qwen25(896, 4864, 24, 14, 2, True, 32768, 1e-6),  # Qwen/Qwen2.5-0.5B
    "Qwen2.5-1.5B": _qwen25(1536, 8960, 28, 12, 2, True, 131072, 1e-6),  # Qwen/Qwen2.5-1.5B
    "Qwen2.5-3B": _qwen25(2048, 11008, 36, 16, 2, True, 32768, 1e-6),  # Qwen/Qwen2.5-3B
    "Qwen2.5-7B": _qwen25(3584, 18944, 28, 28, 4, False, 131072, 1e-6),  # Qwen/Qwen2.5-7B
    "Qwen2.5-14B": _qwen25(5120, 13824, 48, 40, 8, False, 131072, 1e-5),  # Qwen/Qwen2.5-14B
    "Qwen2.5-32B": _qwen25(5120, 27648, 64, 40, 8, False, 131072, 1e-5),  # Qwen/Qwen2.5-32B
    "Qwen2.5-72B": _qwen25(8192, 29568, 80, 64, 8, False, 131072, 1e-5),  # Qwen/Qwen2.5-72B
    "Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, 8, True),  # Qwen/Qwen3-0.6B
    "Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, 8, True),  # Qwen/Qwen3-1.7B
    "Qwen3-4B": _qwen3(2560, 9728, 36, 32, 8, True),  # Qwen/Qwen3-4B
    "Qwen3-8B": _qwen3(4096, 12288, 36, 32, 8, False),  # Qwen/Qwen3-8B
    "Qwen3-14B": _qwen3(5120, 17408, 40, 40, 8, False),  # Qwen/Qwen3-14B
    "Qwen3-32B": _qwen3(5120, 25600, 64, 64, 8, False),  # Qwen/Qwen3-32B
    "Qwen3-30B-A3B": _qwen3(2048, 6144, 48, 32, 4, False) | {  # Qwen/Qwen3-30B-A3B
        "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "Llama-3.2-1B": _llama(2048, 8192, 16, 32, True, _LLAMA32_ROPE, head_dim=64),  # meta-llama/Llama-3.2-1B
    "Llama-3.2-3B": _llama(3072, 8192, 28, 24, True, _LLAMA32_ROPE, head_dim=128),  # meta-llama/Llama-3.2-3B
    "Llama-3.1-8B": _llama(4096, 14336, 32, 32, False, _LLAMA31_ROPE),  # meta-llama/Llama-3.1-8B
    "Llama-3.1-70B": _llama(8192, 28672, 80, 64, False, _LLAMA31_ROPE),  # meta-llama/Llama-3.1-70B
}
ALIASES = {"Meta-Llama-3.1-8B": "Llama-3.1-8B", "Meta-Llama-3.1-70B": "Llama-3.1-70B",
           "Llama-3.3-70B": "Llama-3.1-70B"}  # (3.3 is the 70B's later post-training, the same shape)
_BY_KEY = {k.lower(): k for k in PRESETS} | {a.lower(): k for a, k in ALIASES.items()}


def preset_name(name: str) -> str | None:
    """The preset `name` refers to, or None: case-insensitive, organisation prefix and -Instruct suffix optional."""
    key = name.strip().rsplit("/", 1)[-1].lower()
    return _BY_KEY.get(key.removesuffix("-instruct"))


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a published model by name; ValueError naming the known presets when there is none."""
    found = preset_name(name)
    if found is None:
        raise ValueError(f"no model preset named {name!r} (presets: {', '.join(PRESETS)})")
    return ModelConfig.from_hf(PRESETS[found])


__all__ = ["ALIASES", "PRESETS", "preset", "preset_name"]

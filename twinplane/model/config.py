"""Model configuration, read from and written to HF `config.json`.

What every family shares is read here; what differs by family (biases, norms, windows, experts, the options it does
not implement) is in its declaration (twinplane/model/families/). Both config forms that exist in the wild are
accepted:
- transformers 4.x (what published checkpoints carry): `rope_theta` + `rope_scaling`;
- transformers 5.x: `rope_parameters` holding theta, type and scaling together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from twinplane.model.families import family
from twinplane.model.params import counts
from twinplane.model.rope import check_scaling, finite, read_rope, rope_limits

# Sizes that must be positive integers (JSON lets them be strings or floats), as fields and as config.json keys.
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
         "max_position_embeddings")
HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")
# config.json keys read here or by some family's `read` (what is left over is kept and written back on save)
KNOWN = {
    *HF_SIZES, "model_type", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "qkv_bias", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "bos_token_id", "eos_token_id", "pad_token_id", "architectures", "hidden_act", "num_experts",
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "partial_rotary_factor",
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq",
    "hidden_activation", "sliding_window_pattern", "_sliding_window_pattern",
    "quantization_config",  # (dequantized on load where accepted: saved weights are plain)
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "full_attention_interval",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # rope on the first `rotary_dim` = int(head_dim * factor) dims of each head, the rest passed through (GLM, Phi)
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Mixture of experts (0 experts = dense). A layer is sparse unless listed in `mlp_only_layers`, and only
    # every `decoder_sparse_step`-th layer is (Qwen-MoE's two ways of keeping some layers dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's hidden size (dense layers use intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k gate weights to sum to 1 (always on in Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate (0 = none)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # DeepSeek-V3's routing (`moe_scoring="sigmoid"`): sigmoid scores plus a score-correction bias choose the top-k
    # among the `topk_group` best of `n_group` expert groups; the weights (the scores alone) are scaled by
    # `routed_scaling_factor`; the shared experts have no gate; the first `first_k_dense_replace` layers are dense.
    moe_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0 = none): keys and values from a compressed latent
    # of kv_lora_rank dims plus one shared rope key of head_dim dims (transformers' qk_rope_head_dim); a head's q/k
    # are qk_nope_head_dim + head_dim wide, its values v_head_dim; q_lora_rank: q through a low-rank latent too.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Per-layer attention (Gemma): `layer_types` says which layers slide (None: all alike, `sliding_window` on
    # every layer); scores scaled by 1/sqrt(query_pre_attn_scalar) (None: 1/sqrt(head_dim)); tanh soft-capping of
    # attention scores and of the final logits (None: none); sliding layers' own rope base (None: the global rope).
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    # Gated DeltaNet (Qwen3-Next): the layers in `linear_layers` mix tokens by the gated delta rule
    # (twinplane.model.gated_deltanet) instead of attention, with these head counts and sizes and a causal
    # depthwise convolution of `linear_conv_kernel_dim` taps
    linear_layers: list[int] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    extra: dict = field(default_factory=dict)  # unknown HF keys, written back on save

    def __post_init__(self):
        for name in SIZES:
            _positive_int(name, getattr(self, name))
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window, " or null")
        family(self.model_type)  # (raises for one without a native implementation)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if not (finite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if not (finite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        if not (finite(self.partial_rotary_factor) and 0 < self.partial_rotary_factor <= 1
                and self.rotary_dim >= 2 and self.rotary_dim % 2 == 0):
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1] and leave an "
                             f"even rotary size (head_dim {self.head_dim})")
        check_scaling(self.rope_scaling, self.rotary_dim)
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                             or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name {self.num_layers} layers, each one of {LAYER_TYPES}, got "
                             f"{self.layer_types!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (finite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 or null, got {value!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                             f"{self.num_experts}")
        if self.num_experts and (self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1):
            raise ValueError("an MoE config needs moe_intermediate_size >= 1 and decoder_sparse_step >= 1")
        if self.moe_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_scoring must be softmax or sigmoid, got {self.moe_scoring!r}")
        if self.num_experts and self.moe_scoring == "sigmoid" and not (
                self.num_experts % self.n_group == 0 and self.num_experts // self.n_group >= 2
                and 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.num_experts} into groups of "
                             f"2 or more, and topk_group={self.topk_group} be in 1..n_group")
        if self.kv_lora_rank:
            for name in ("v_head_dim", "qk_nope_head_dim") + (("q_lora_rank",) if self.q_lora_rank is not None else ()):
                _positive_int(name, getattr(self, name))
            if self.head_dim % 2:
                raise ValueError(f"qk_rope_head_dim={self.head_dim} must be even")

        if self.linear_layers:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                _positive_int(name, getattr(self, name))
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                                 f"linear_num_key_heads={self.linear_num_key_heads}")

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rope rotates (transformers' `int(head_dim * partial_rotary_factor)`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def longrope_limit(self) -> int | None:
        """longrope's pretraining length (None: another rope): a token predicted from more tokens than this takes
        the long factors, with every position of its context rotated by them, as transformers' `generate` does (it
        re-encodes the whole sequence where it crosses); within it, the short ones."""
        return rope_limits(self.rope_scaling, self.max_position_embeddings)[0]

    @property
    def dynamic_rope_limit(self) -> int | None:
        """Dynamic NTK's length, max_position_embeddings (None: another rope). Within it the frequencies are plain
        rope's; past it transformers rescales them per forward from the longest sequence it has run so far, which
        depends on the batch and on earlier calls: neither plane follows that, so sequences past it are refused."""
        return rope_limits(self.rope_scaling, self.max_position_embeddings)[1]

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: full causal attention)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_attention(self, layer: int) -> tuple[int | None, float | None, float | None] | None:
        """(window, score scale, score soft-cap) of `layer` where layers differ from the forward's metadata
        (`AttentionMetadata.for_layer`), None where every layer attends as the metadata says."""
        if self.layer_types is None and self.query_pre_attn_scalar is None and self.attn_logit_softcapping is None:
            return None
        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5
        return self.layer_window(layer), scale, self.attn_logit_softcapping

    @property
    def attention_layers(self) -> list[int]:
        """The layers that attend (and hold KV in the engine): all but the linear-attention ones."""
        return [i for i in range(self.num_layers) if i not in self.linear_layers]

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers and layer >= self.first_k_dense_replace
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(pools, heads, dim) of the engine's KV cache per layer and token: keys and values per KV head; with
        latent attention one pool of the compressed latent + rope key, which attention reads as keys and values."""
        if self.kv_lora_rank:
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the sparse layers; the routing record's layer axis runs over these, in order."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def num_params(self) -> int:
        """Every parameter (what memory holds), counted exactly (`twinplane.model.params`)."""
        return counts(self).total

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: the top-k experts of each sparse layer (what FLOPs count)."""
        return counts(self).active

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        fam = family(model_type)  # first: another family's keys mean nothing here
        quant = hf.get("quantization_config")  # (GPTQ/AWQ/FP8 weights are packed integers plus scales)
        method = (quant.get("quant_method", "?") if isinstance(quant, dict) else quant) if quant else None
        if quant and method not in fam.dequantize:  # (a family's own methods are made plain weights on load)
            raise ValueError(f"quantized checkpoints are not supported (quantization_config: {method}); use the "
                             "unquantized model")
        act = hf.get("hidden_act", "silu")  # (transformers: "swish" is silu too)
        if fam.activation_key == "hidden_act" and act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported ({model_type} is implemented with silu)")
        fam.check(hf)
        theta, scaling = read_rope(hf)
        for key in HF_SIZES:  # by the file's names, and before any arithmetic on them
            if hf.get(key) is not None:
                _positive_int(key, hf[key])
        heads = hf["num_attention_heads"]
        return cls(**dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size"),  # (a family without dense layers reads its own)
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            model_type=model_type,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            extra={k: v for k, v in hf.items() if k not in KNOWN and k not in fam.unsupported},
        ) | fam.read(hf))  # (a family's reading wins: its own defaults, its rope)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from None
        try:
            return cls.from_hf(hf)
        except KeyError as e:
            raise ValueError(f"{path}: missing key {e}") from None
        except (ValueError, TypeError, AttributeError) as e:  # an unsupported or mistyped value: name the file
            raise ValueError(f"{path}: {e}") from None

    def to_hf(self) -> dict:
        """The transformers 4.x form, which both transformers 4.x and 5.x read."""
        fam = family(self.model_type)
        hf = dict(self.extra)
        hf.update(
            architectures=[fam.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        hf.update(fam.write(self))
        return hf


def _positive_int(name: str, value, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer{alternative}, got {value!r}")

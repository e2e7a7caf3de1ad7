"""The transformers fallback's model config: a transformers `PretrainedConfig` seen through the fields the rest of
twinplane reads of a `ModelConfig` (sizes for the memory model and FLOP counts, token ids, tying, the MoE fields
as a dense model's), plus the HF config itself for saving.

Parameter counts are exact: they are counted on the model built on the meta device (no memory, no weights read).
The per-layer split between attention and the rest is derived from those counts and the attention sizes, so FLOP
counts hold for dense decoders of any layout; an MoE model's every expert counts as active (its FLOPs are
over-estimated), and activation and KV-cache sizes assume a standard decoder (`estimated` says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from twinplane.model.rope import read_rope, rope_limits


def _get(hf, *names, default=None):
    """The first of `names` the HF config sets (families name the same size differently)."""
    for name in names:
        value = getattr(hf, name, None)
        if value is not None:
            return value
    return default


@dataclass
class HFConfig:
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int  # every parameter, tied ones once
    layer_matmul_params: int  # 2-D (and stacked) weights of one decoder layer, mean over layers
    tie_word_embeddings: bool
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    hf_dict: dict = field(default_factory=dict, repr=False)  # the HF config as config.json holds it
    impl: str = "hf"
    estimated: tuple[str, ...] = ("activation memory", "KV cache per token", "MoE FLOPs (every expert counted)")
    # twinplane's own MoE machinery (routing record/replay, its load-balancing loss) is not used: dense to it
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # (transformers' attention applies the model's own windows)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    final_logit_softcapping: float | None = None  # (set by the model adapter from the HF config)
    kv_lora_rank: int = 0  # (latent attention's caches are transformers' own here)

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        return 2, self.num_kv_heads, self.head_dim

    @property
    def longrope_limit(self) -> int | None:
        """longrope's pretraining length, as transformers reads it (see `ModelConfig.longrope_limit`)."""
        return rope_limits(read_rope(self.hf_dict)[1], self.max_position_embeddings)[0]

    @property
    def dynamic_rope_limit(self) -> int | None:
        """Dynamic NTK's length, as transformers reads it (see `ModelConfig.dynamic_rope_limit`)."""
        return rope_limits(read_rope(self.hf_dict)[1], self.max_position_embeddings)[1]

    @property
    def attn_params(self) -> int:
        return self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)

    @property
    def active_params(self) -> int:
        return self.num_params

    @property
    def moe_layers(self) -> list[int]:
        return []

    def is_moe_layer(self, layer: int) -> bool:
        return False

    def mlp_params(self, layer: int, experts: int) -> int:
        """A layer's matmul parameters outside q/k/v/o (what FLOP counts add to attention's)."""
        return max(self.layer_matmul_params - self.attn_params, 0)

    def to_hf(self) -> dict:
        return dict(self.hf_dict)

    @classmethod
    def from_model(cls, model: nn.Module, layers: nn.ModuleList) -> HFConfig:
        """From a built transformers model (on any device, the meta device included) and its decoder layers."""
        hf = model.config
        heads = _get(hf, "num_attention_heads", "n_head", "num_heads")
        hidden = _get(hf, "hidden_size", "n_embd", "d_model")
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        tied = out is not None and out.weight is inp.weight
        matmul = sum(p.numel() for layer in layers for p in layer.parameters() if p.ndim >= 2)
        d = hf.to_dict()
        d.pop("transformers_version", None)
        return cls(
            model_type=hf.model_type, architecture=type(model).__name__, vocab_size=inp.weight.shape[0],
            hidden_size=hidden, intermediate_size=_get(hf, "intermediate_size", "n_inner", "ffn_dim",
                                                       default=4 * hidden),
            num_layers=len(layers), num_heads=heads,
            num_kv_heads=_get(hf, "num_key_value_heads", "num_kv_heads", default=heads),
            head_dim=_get(hf, "head_dim", default=hidden // heads),
            num_params=sum(p.numel() for p in model.parameters()), layer_matmul_params=matmul // max(len(layers), 1),
            tie_word_embeddings=tied, max_position_embeddings=_get(hf, "max_position_embeddings", "n_positions",
                                                                   default=2048),
            bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
            hf_dict=d)

    @classmethod
    def from_folder(cls, path) -> HFConfig:
        """Without loading weights: the model built on the meta device from `path/config.json`."""
        model = build_meta(path)
        return cls.from_model(model, decoder_layers(model))


def build_meta(path) -> nn.Module:
    """The transformers model of `path/config.json` on the meta device (no memory, no weights)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers model: the module list of its `_no_split_modules` class (what
    transformers itself keeps whole when it splits a model), else the longest module list."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for m in lists:
        if type(m[0]).__name__ in names:
            return m
    if not lists:
        raise ValueError(f"{type(model).__name__}: no decoder layers found")
    return max(lists, key=len)

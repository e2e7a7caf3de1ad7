"""Gemma 3 (text; `Gemma3ForCausalLM`): Gemma 2's layer (twinplane.model.families.gemma2) with a per-head
Gemma RMSNorm on q and k, five sliding layers to one global (`layer_types`, else `sliding_window_pattern`), and two
ropes: the sliding layers' own base (`rope_local_base_freq`, 4.x; `rope_parameters.sliding_attention`, 5.x), the
global layers' `rope_theta` with its scaling (`rope_parameters.full_attention`). Soft-capping only of the final
logits, when set. The multimodal `gemma3` (`Gemma3ForConditionalGeneration`) is not native: it runs through
transformers (model.impl=hf)."""

from __future__ import annotations

from twinplane.model.blocks import Attention
from twinplane.model.families.gemma2 import BIDIRECTIONAL, GemmaDecoderLayer, GemmaRMSNorm, gemma_mlp, read_common
from twinplane.model.families.gemma2 import write as gemma2_write
from twinplane.model.family import DROPOUT, Family, Option
from twinplane.model.rope import read_rope


class Gemma3Attention(Attention):
    def __init__(self, cfg, layer: int):
        super().__init__(cfg, layer)  # (cfg.qk_norm: q and k normed per head before rope)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention = Gemma3Attention


def read_ropes(hf: dict) -> dict:
    """The global and the sliding layers' rope, as transformers' Gemma3TextConfig reads either form: 5.x keeps one
    entry per layer type in `rope_parameters` (other keys there, which transformers ignores, are refused); 4.x has
    `rope_theta` and `rope_scaling` for the global layers and `rope_local_base_freq` for the sliding ones. The
    sliding layers' rope is never scaled here; one that is, is refused."""
    params = hf.get("rope_parameters") or {}
    loose = sorted(set(params) - {"full_attention", "sliding_attention"})
    if loose:  # (transformers' Gemma 3 would ignore them)
        raise ValueError(f"{hf['model_type']}: rope_parameters {loose} outside full_attention / sliding_attention "
                         "apply to no layer")
    full = dict(params.get("full_attention") or {"rope_type": "default"}) | dict(hf.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local_theta = local.pop("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    if (local.pop("type", None) or local.get("rope_type", "default")) != "default":
        raise ValueError(f"{hf['model_type']}: rope scaling on the sliding layers (rope_parameters.sliding_attention "
                         f"{local.get('rope_type', local)!r}) is not implemented")
    theta, scaling = read_rope({"rope_parameters": full, "max_position_embeddings": hf.get("max_position_embeddings",
                                                                                            131_072)})
    return dict(rope_theta=float(theta), rope_scaling=scaling, rope_local_theta=float(local_theta))


def read(hf: dict) -> dict:
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return read_common(hf, pattern, (None, None)) | read_ropes(hf) | dict(qk_norm=True)


def write(cfg) -> dict:
    return gemma2_write(cfg) | dict(rope_local_base_freq=cfg.rope_local_theta)


# transformers' Gemma 3 reads `attn_logit_softcapping` but never applies it: a value would mean nothing
NOT_APPLIED = {"attn_logit_softcapping": Option(None, "attention soft-capping, which transformers' Gemma 3 ignores")}

FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", read, write, mlp=gemma_mlp, decoder_layer=Gemma3DecoderLayer,
                unsupported=DROPOUT | BIDIRECTIONAL | NOT_APPLIED, activation_key=None, norm=GemmaRMSNorm,
                scale_embeddings=True)

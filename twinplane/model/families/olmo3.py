"""OLMo-3: OLMo-2's layer (twinplane.model.families.olmo2) with sliding-window attention on three layers of every four
(`layer_types`) and a rope per layer kind (`rope_parameters.sliding_attention` / `.full_attention`); only the full
layers' rope may be scaled."""

from __future__ import annotations

from twinplane.model.families.gemma3_text import read_ropes
from twinplane.model.families.olmo2 import Olmo2Layer, Olmo2RMSNorm
from twinplane.model.families.olmo2 import read as olmo2_read
from twinplane.model.family import DROPOUT, Family

DEFAULT_THETA = 500_000.0  # transformers' Olmo3Config.default_theta


def read(hf: dict) -> dict:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    # A 4.x-form config's `rope_theta` reaches the full layers only: transformers' conversion pops it once, so the
    # sliding layers keep the default base unless `rope_parameters` names theirs.
    sliding = (params.get("sliding_attention") or {}).get("rope_theta", DEFAULT_THETA)
    ropes = read_ropes(hf | dict(rope_theta=hf.get("rope_theta", DEFAULT_THETA), rope_local_base_freq=sliding))
    return olmo2_read(hf) | ropes | dict(layer_types=list(types), sliding_window=hf.get("sliding_window", 4096))


def write(cfg) -> dict:
    full = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    return dict(attention_bias=cfg.qkv_bias, layer_types=cfg.layer_types, sliding_window=cfg.sliding_window,
                rope_parameters={"full_attention": full,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}})


FAMILY = Family("olmo3", "Olmo3ForCausalLM", read, write, decoder_layer=Olmo2Layer, norm=Olmo2RMSNorm,
                unsupported=DROPOUT)

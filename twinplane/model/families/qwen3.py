"""Qwen3: Llama's layer with a per-head RMSNorm on q and k before rope; `attention_bias` puts biases on q/k/v and
o. Windows as in Qwen2 (twinplane.model.families.qwen2)."""

from twinplane.model.families import qwen2
from twinplane.model.family import DROPOUT, Family


def read(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return qwen2.read(hf) | dict(qkv_bias=bias, o_bias=bias, qk_norm=True)


FAMILY = Family("qwen3", "Qwen3ForCausalLM", read, write=lambda cfg: qwen2.write(cfg) | dict(
    attention_bias=cfg.qkv_bias), unsupported=DROPOUT)

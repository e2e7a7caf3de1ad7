"""Llama (2, 3, 3.1, 3.2 and the many models built on its layout): the reference decoder."""

from twinplane.model.family import DROPOUT, Family


def read(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))  # on q/k/v and o alike
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


FAMILY = Family("llama", "LlamaForCausalLM", read,
                write=lambda cfg: dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias), unsupported=DROPOUT)

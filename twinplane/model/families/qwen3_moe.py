"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, routed experts only; its window, when used, slides on
every layer."""

from twinplane.model import moe
from twinplane.model.family import DROPOUT, Family


def read(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, **moe.read_moe(hf),
                sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window") else None)


def write(cfg) -> dict:
    return dict(attention_bias=cfg.qkv_bias, use_sliding_window=cfg.sliding_window is not None,
                sliding_window=cfg.sliding_window, **moe.write_moe(cfg))


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", read, write, mlp=moe.sparse_mlp, unsupported=DROPOUT,
                from_checkpoint=moe.expert_from_checkpoint, to_checkpoint=moe.expert_to_checkpoint)

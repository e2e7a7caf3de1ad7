"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, routed experts plus one always-on shared expert
behind a sigmoid gate. With `use_sliding_window`, transformers' windows slide on every other layer below
`max_window_layers` (or as 5.x's `layer_types` says)."""

from twinplane.model import moe
from twinplane.model.family import DROPOUT, Family, layer_windows


def read(hf: dict) -> dict:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    end = hf.get("max_window_layers", 28)
    return dict(qkv_bias=bool(hf.get("qkv_bias", True)),
                **layer_windows(hf, window, lambda i: (i + 1) % 2 == 1 and i < end),
                **moe.read_moe(hf), shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0))


def write(cfg) -> dict:
    return dict(qkv_bias=cfg.qkv_bias, use_sliding_window=cfg.sliding_window is not None,
                sliding_window=cfg.sliding_window, max_window_layers=cfg.num_layers,
                layer_types=cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"]
                * cfg.num_layers,
                **moe.write_moe(cfg), shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)


FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", read, write, mlp=moe.sparse_mlp_shared, unsupported=DROPOUT,
                from_checkpoint=moe.expert_from_checkpoint, to_checkpoint=moe.expert_to_checkpoint)

"""Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini (all `phi3`): Llama's pre-norm layer with q/k/v fused in `qkv_proj`
(q, then k, then v rows) and gate/up in `gate_up_proj`, no biases; rope partial (`partial_rotary_factor`, Phi-4-mini
0.75: the first dims of each head, rotate-half layout) and, in the long-context models, longrope (short and long
factors, picked per forward as transformers does; twinplane.model.rope).

The fused weights stay fused parameters under their published names: checkpoints load as they are, LoRA targets
`qkv_proj` / `gate_up_proj` as PEFT does for Phi-3, and the engine's CPU path runs each as one prepacked GEMM."""

from __future__ import annotations

import torch
from torch import nn

from twinplane.model.blocks import Attention, gate_up_mlp
from twinplane.model.family import DROPOUT, Family, Option
from twinplane.model.layer import DecoderLayer
from twinplane.model.rope import read_partial_rotary


class Phi3Attention(Attention):
    def __init__(self, cfg, layer: int):
        nn.Module.__init__(self)  # (no separate q/k/v projections)
        self.layer, self.cfg = layer, cfg
        hd = cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        return self.qkv_proj(x).unflatten(-1, (-1, c.head_dim)).split((c.num_heads, c.num_kv_heads, c.num_kv_heads),
                                                                       dim=-2)


class Phi3Layer(DecoderLayer):
    attention = Phi3Attention


def read(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in ("su", "yarn"):  # (transformers' Phi-3 runs both as longrope)
        raise ValueError(f"phi3: rope type {kind!r} is an old name of longrope; rename it to 'longrope'")
    if kind == "longrope" and hf.get("original_max_position_embeddings") is None:
        raise ValueError("phi3: longrope needs original_max_position_embeddings at the config's top level "
                         "(transformers' Phi-3 takes 4096 without it)")
    return dict(sliding_window=hf.get("sliding_window"), partial_rotary_factor=read_partial_rotary(hf))


def write(cfg) -> dict:
    longrope = (cfg.rope_scaling or {}).get("rope_type") == "longrope"
    return dict(sliding_window=cfg.sliding_window, partial_rotary_factor=cfg.partial_rotary_factor,
                **({"original_max_position_embeddings": cfg.rope_scaling["original_max_position_embeddings"]}
                   if longrope else {}))


NO_DROPOUT = Option(lambda v: not v, "dropout in training")
FAMILY = Family("phi3", "Phi3ForCausalLM", read, write, mlp=gate_up_mlp, decoder_layer=Phi3Layer,
                unsupported=DROPOUT | {"resid_pdrop": NO_DROPOUT, "embd_pdrop": NO_DROPOUT})

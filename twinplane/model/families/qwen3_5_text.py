"""Qwen3.5 (text; `Qwen3_5ForCausalLM`): Qwen3-Next's hybrid layers (twinplane.model.families.qwen3_next) with
Gated DeltaNet's projections apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and a dense SwiGLU MLP.
Its rope is multimodal (`mrope_section`: time, height and width positions per frequency band); for text every band
takes the token's position, which is the plain rope, so the sections do not change what text computes. The
multimodal `qwen3_5` (a vision tower, `model.language_model.*` names) is not native. `mtp.*` tensors are skipped
on load, as for Qwen3-Next."""

from __future__ import annotations

from twinplane.model.blocks import dense_mlp
from twinplane.model.families.gemma2 import GemmaRMSNorm
from twinplane.model.families.qwen3_next import MTP, HybridLayer, read_hybrid, write_hybrid
from twinplane.model.family import DROPOUT, Family
from twinplane.model.gated_deltanet import SplitGatedDeltaNet


class Qwen35Layer(HybridLayer):
    linear = SplitGatedDeltaNet


def layer(cfg, index: int, mlp=dense_mlp):
    return Qwen35Layer(cfg, index, mlp)


FAMILY = Family("qwen3_5_text", "Qwen3_5ForCausalLM", read_hybrid, write_hybrid, mlp=dense_mlp,
                decoder_layer=layer, unsupported=DROPOUT, norm=GemmaRMSNorm, ignored=MTP)

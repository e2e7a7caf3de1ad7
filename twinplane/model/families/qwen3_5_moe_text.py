"""Qwen3.5-MoE (text; `Qwen3_5MoeForCausalLM`): Qwen3.5's hybrid layers (twinplane.model.families.qwen3_5_text:
Gated DeltaNet with its projections apart, gated attention with partial rotary, (1 + weight) RMSNorms) with
Qwen3-Next's MoE on every layer: routed experts (top-k of a softmax, always renormalised) plus a shared expert
behind a sigmoid gate. Its transformers config has no dense MLP: no `intermediate_size`, `mlp_only_layers`,
`decoder_sparse_step` or `norm_topk_prob`, which its model code would ignore, so they are ignored here too.
The multimodal `qwen3_5_moe` (a vision tower, `model.language_model.*` names) is not native. `mtp.*` tensors are
skipped on load, as for Qwen3-Next."""

from __future__ import annotations

from twinplane.model import moe
from twinplane.model.families import qwen3_5_text
from twinplane.model.families.gemma2 import GemmaRMSNorm
from twinplane.model.families.qwen3_next import MTP, read_hybrid, write_hybrid
from twinplane.model.family import DROPOUT, Family


def read(hf: dict) -> dict:
    experts = hf.get("num_experts", 256)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise ValueError(f"qwen3_5_moe_text: num_experts must be an integer >= 1 (every layer is sparse), got "
                         f"{experts!r}")
    moe_size = hf.get("moe_intermediate_size", 512)
    shared = hf.get("shared_expert_intermediate_size", 512)
    # no dense layer: `intermediate_size` (which ModelConfig requires) is the shared expert's width, unused
    return read_hybrid(hf) | dict(
        num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 8), moe_intermediate_size=moe_size,
        shared_expert_intermediate_size=shared, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        intermediate_size=shared or moe_size)


def write(cfg) -> dict:
    return write_hybrid(cfg) | dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                                    moe_intermediate_size=cfg.moe_intermediate_size,
                                    shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)


FAMILY = Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", read, write, mlp=moe.sparse_mlp_shared,
                decoder_layer=qwen3_5_text.layer, unsupported=DROPOUT, norm=GemmaRMSNorm, ignored=MTP,
                from_checkpoint=moe.expert_from_checkpoint, to_checkpoint=moe.expert_to_checkpoint)

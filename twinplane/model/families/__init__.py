"""Every model family twinplane runs natively, by `model_type`: one file each (see twinplane.model.family for what a
declaration holds, docs/models.md for how to add one)."""

from __future__ import annotations

from twinplane.model.families import (
    deepseek_v3,
    gemma2,
    gemma3_text,
    glm,
    glm4,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmo2,
    olmo3,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5_moe_text,
    qwen3_5_text,
    qwen3_moe,
    qwen3_next,
)
from twinplane.model.family import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY,
    olmo2.FAMILY, olmo3.FAMILY, glm.FAMILY, glm4.FAMILY, phi3.FAMILY, gemma2.FAMILY, gemma3_text.FAMILY,
    deepseek_v3.FAMILY, gpt_oss.FAMILY, qwen3_next.FAMILY, qwen3_5_text.FAMILY, qwen3_5_moe_text.FAMILY)}


def family(model_type: str) -> Family:
    """The declaration of `model_type`; ValueError naming the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} has no native implementation (native: "
                         f"{', '.join(FAMILIES)})") from None


__all__ = ["FAMILIES", "family"]

"""Mistral: Llama's layer with a sliding window on every layer (`sliding_window`, null = full attention)."""

from twinplane.model.family import DROPOUT, Family

FAMILY = Family("mistral", "MistralForCausalLM", read=lambda hf: dict(sliding_window=hf.get("sliding_window")),
                write=lambda cfg: dict(sliding_window=cfg.sliding_window), unsupported=DROPOUT)

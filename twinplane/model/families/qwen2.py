"""Qwen2 / Qwen2.5: Llama's layer with biases on q/k/v; with `use_sliding_window`, a window on the layers from
`max_window_layers` on (or as 5.x's `layer_types` says)."""

from twinplane.model.family import DROPOUT, Family, layer_windows


def read(hf: dict) -> dict:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    start = hf.get("max_window_layers", 28)
    return dict(qkv_bias=True, **layer_windows(hf, window, lambda i: i >= start))


def write(cfg) -> dict:
    """Windows as both forms read them: 5.x takes `layer_types`; 4.x slides from `max_window_layers` on."""
    types = cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.num_layers
    first = next((i for i, t in enumerate(types) if t == "sliding_attention"), cfg.num_layers)
    return dict(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                max_window_layers=first, layer_types=types)


FAMILY = Family("qwen2", "Qwen2ForCausalLM", read, write, unsupported=DROPOUT)

"""Qwen2 / Qwen2.5: Llama's layer with biases on q/k/v. The window that transformers puts on the layers from
`max_window_layers` on is implemented where it covers every layer or none."""

from twinplane.model.family import DROPOUT, Family, uniform_window


def read(hf: dict) -> dict:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    start = hf.get("max_window_layers", 28)
    return dict(qkv_bias=True, sliding_window=uniform_window(hf, window, lambda i: i >= start))


def write(cfg) -> dict:
    window = cfg.sliding_window is not None
    return dict(use_sliding_window=window, sliding_window=cfg.sliding_window, max_window_layers=0, layer_types=None)


FAMILY = Family("qwen2", "Qwen2ForCausalLM", read, write, unsupported=DROPOUT)

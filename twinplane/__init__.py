"""twinplane: RL post-training of LLMs (GRPO and relatives) on CUDA, ROCm and CPU with the same code."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["build_char_tokenizer", "load_model", "load_tokenizer", "save_pretrained"]
# Imported on first use, so that `import twinplane.<light module>` (the CLI before its signal handlers are
# installed, the reward worker on every restart) does not pay for torch.
_LAZY = {"load_model": "twinplane.model", "save_pretrained": "twinplane.model",
         "load_tokenizer": "twinplane.tokenizer", "build_char_tokenizer": "twinplane.tokenizer"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'twinplane' has no attribute {name!r}")

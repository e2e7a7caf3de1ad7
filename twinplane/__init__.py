"""twinplane: RL post-training of LLMs (GRPO and relatives) on CUDA, ROCm and CPU with the same code."""

from twinplane.model import load_model, save_pretrained
from twinplane.tokenizer import build_char_tokenizer, load_tokenizer

__version__ = "0.1.0"
__all__ = ["build_char_tokenizer", "load_model", "load_tokenizer", "save_pretrained"]

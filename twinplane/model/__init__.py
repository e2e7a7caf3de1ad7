from twinplane.model.attention import AttentionMetadata, attention
from twinplane.model.config import ModelConfig
from twinplane.model.paged_attention import PagedKV
from twinplane.model.transformer import Transformer
from twinplane.model.weights import iter_safetensors, load_model, load_weights, save_pretrained

__all__ = ["AttentionMetadata", "PagedKV", "ModelConfig", "Transformer", "attention", "iter_safetensors", "load_model",
           "load_weights", "save_pretrained"]

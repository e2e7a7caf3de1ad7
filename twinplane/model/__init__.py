from twinplane.model.attention import AttentionMetadata, attention
from twinplane.model.config import ModelConfig
from twinplane.model.transformer import Transformer
from twinplane.model.weights import iter_safetensors, load_model, load_weights, save_config, save_pretrained

__all__ = ["AttentionMetadata", "ModelConfig", "Transformer", "attention", "iter_safetensors", "load_model",
           "load_weights", "save_config", "save_pretrained"]

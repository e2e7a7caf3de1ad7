import pytest
import torch

from twinplane.model import ModelConfig, Transformer


def tiny_model(seed: int = 0, **over) -> Transformer:
    cfg = dict(vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**cfg, **over}))
    with torch.no_grad():  # larger-than-default weights so distributions are peaked and sampling is varied
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.15)
    return model.eval()


@pytest.fixture
def model():
    return tiny_model()

"""The vLLM rollout backend for a model without a native family (model.impl=hf): OLMo through transformers' code on
the training side, vLLM's own OLMo on the rollout side, against the hf engine and the trainer's scoring.

Skipped where vLLM is not importable (its own environment: see docs/vllm.md)."""

import copy

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from twinplane.model.checksum import weights_checksum  # noqa: E402
from twinplane.model.hf import load_hf  # noqa: E402
from twinplane.rollout import SamplingParams  # noqa: E402
from twinplane.rollout.hf_engine import HFEngine  # noqa: E402
from twinplane.rollout.vllm_backend import VllmEngine  # noqa: E402

EOS = 95
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


def olmo_folder(path, seed: int = 0):
    """Head size 32 (vLLM's CPU attention takes multiples of 32), weights wide enough for clear greedy winners."""
    cfg = transformers.OlmoConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return load_hf(path, "cpu", torch.float32)


def scored(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_vllm_serves_an_hf_model(tmp_path):
    model = olmo_folder(tmp_path / "a")
    vllm, own = VllmEngine(copy.deepcopy(model), EOS, seed=0), HFEngine(copy.deepcopy(model), EOS)
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    a, b = own.generate(PROMPTS, greedy), vllm.generate(PROMPTS, greedy)
    assert [s.token_ids for s in b] == [s.token_ids for s in a]
    for s in vllm.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=2, seed=1)):
        assert torch.allclose(torch.tensor(s.logprobs), scored(model, s.prompt_ids, s.token_ids), atol=1e-4)
    # a weight sync by transformers' names: the engine's checksum is the sender's, and outputs follow the weights
    new = olmo_folder(tmp_path / "b", seed=1)
    sent = list(new.named_parameters())
    assert vllm.load_weights(sent, version=3) == weights_checksum(sent)
    own.load_weights(sent, version=3)
    a, b = own.generate(PROMPTS, greedy), vllm.generate(PROMPTS, greedy)
    assert [s.token_ids for s in b] == [s.token_ids for s in a] and {s.weight_version for s in b} == {3}


def test_an_architecture_vllm_does_not_serve_is_refused():
    from twinplane.config import ConfigError
    from twinplane.run.preflight import check_vllm_serves

    check_vllm_serves("OlmoForCausalLM")
    with pytest.raises(ConfigError, match="this vLLM does not serve NoSuchForCausalLM; use rollout.backend=twinplane"):
        check_vllm_serves("NoSuchForCausalLM")

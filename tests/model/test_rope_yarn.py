"""YaRN rope against transformers: frequencies, the cos/sin attention factor, and whole-model logits; dynamic NTK
within its limit, and refused past it."""

import pytest
import torch

import twinplane
from twinplane.model import ModelConfig
from twinplane.model.rope import rope_attention_factor, rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
YARN = [
    dict(factor=4.0, original_max_position_embeddings=64),
    dict(factor=8.0, original_max_position_embeddings=32, beta_fast=16, beta_slow=2, truncate=False),
    dict(factor=40.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek's form
    dict(factor=2.0, original_max_position_embeddings=128, attention_factor=1.3),
    dict(factor=4.0),  # original_max_position_embeddings from max_position_embeddings
]


def hf_config(family, yarn, **over):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    return cls(**BASE, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn}, **over)


@pytest.mark.parametrize("yarn", YARN)
def test_yarn_frequencies_and_factor_match_transformers(yarn):
    hf = hf_config("llama", yarn)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = ModelConfig.from_hf(hf.to_dict())
    torch.testing.assert_close(rope_inv_freq(cfg), want, atol=0, rtol=0)
    assert rope_attention_factor(cfg) == pytest.approx(factor, abs=1e-12)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("yarn", YARN[:3])
def test_yarn_logits_match_transformers(family, yarn, tmp_path):
    torch.manual_seed(0)
    ref = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family])(
        hf_config(family, yarn)).eval()
    ref.save_pretrained(tmp_path)
    ours = twinplane.load_model(tmp_path)
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)


def test_yarn_legacy_form_and_round_trip():
    legacy = dict(BASE, model_type="llama", rope_theta=10000.0, original_max_position_embeddings=32,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    cfg = ModelConfig.from_hf(legacy)  # the top-level value wins, as in transformers
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32
    assert ModelConfig.from_hf(cfg.to_hf()).rope_scaling == cfg.rope_scaling
    with pytest.raises(ValueError, match="yarn rope scaling needs factor"):
        ModelConfig.from_hf(dict(legacy, rope_scaling={"type": "yarn"}))


def test_dynamic_ntk_within_its_limit_is_transformers_and_refused_past_it(tmp_path):
    """Within max_position_embeddings dynamic NTK is plain rope (logits, engine greedy == `generate`); past it
    transformers rescales per batch: a request or a run that can pass it is refused in one line."""
    from twinplane.config import ConfigError, load_config
    from twinplane.errors import InputError
    from twinplane.rollout import RolloutEngine, SamplingParams
    from twinplane.run import preflight

    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, "max_position_embeddings": 24},
                                        rope_parameters={"rope_type": "dynamic", "rope_theta": 10.0, "factor": 4.0},
                                        eos_token_id=None)).eval()
    ref.save_pretrained(tmp_path)
    ours = twinplane.load_model(tmp_path)
    assert ours.config.dynamic_rope_limit == 24
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)
    engine = RolloutEngine(ours, eos_token_id=None)
    prompts = [x[0, :6].tolist(), x[1, :3].tolist()]
    for prompt, s in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=18)),
                         strict=True):
        assert s.token_ids == ref.generate(torch.tensor([prompt]), max_new_tokens=18, do_sample=False,
                                           pad_token_id=0)[0, len(prompt):].tolist()
    with pytest.raises(InputError, match="^request 0: 6 prompt tokens \\+ up to 19 new ones pass the dynamic rope"):
        engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=19))
    mc = preflight.model_config(str(tmp_path))
    preflight.check_rope_limits(load_config(None, ["data.max_prompt_tokens=8", "rollout.max_new_tokens=16"]), mc)
    with pytest.raises(ConfigError, match="= 25 pass llama's dynamic rope limit, max_position_embeddings=24"):
        preflight.check_rope_limits(load_config(None, ["data.max_prompt_tokens=9", "rollout.max_new_tokens=16"]), mc)
    with pytest.raises(ConfigError, match="^rollout.backend=vllm: vLLM's dynamic rope"):
        preflight.check_rope_limits(load_config(None, ["data.max_prompt_tokens=8", "rollout.max_new_tokens=16",
                                                       "rollout.backend=vllm"]), mc)
    assert preflight.model_config(str(tmp_path), "hf").dynamic_rope_limit == 24

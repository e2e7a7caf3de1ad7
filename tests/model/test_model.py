"""The model against transformers' implementations: logits on random weights, both config forms, both directions."""

import json

import pytest
import torch
from conftest import saved_and_reloaded

import twinplane

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, rms_norm_eps=1e-6)

CASES = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "llama_tied_bias": ("LlamaConfig", "LlamaForCausalLM",
                        dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32)),
}


def hf_model(case, **over):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra, **over})
    m = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # random biases / norm weights so those paths are exercised
        for n, p in m.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(0, 0.2)
    return m


def ids(batch=3, t=11, vocab=97):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, t), generator=g)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    ref = hf_model(case)
    ref.save_pretrained(tmp_path)  # transformers 5.x writes the `rope_parameters` form
    ours = twinplane.load_model(tmp_path)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama3_rope", "qwen2"])
def test_legacy_4x_config_form(case, tmp_path):
    ref = hf_model(case)
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        rope["type"] = rope.pop("rope_type")  # the oldest spelling
        cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = twinplane.load_model(tmp_path)
    assert ours.config.rope_theta == ref.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids()), ref(ids()).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama_gqa", "qwen2", "qwen3"])
def test_padded_batch_matches_transformers(case, tmp_path):
    ref = hf_model(case)
    ref.save_pretrained(tmp_path)
    ours = twinplane.load_model(tmp_path)
    x = ids()
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    with torch.no_grad():
        a = ours(x, attention_mask=mask)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        b = ref(x, attention_mask=mask, position_ids=pos).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-4, rtol=0)
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("case", ["llama_tied_bias", "qwen3"])
def test_saved_weights_load_in_transformers(case, tmp_path):
    ours, back, again = saved_and_reloaded(hf_model(case), tmp_path, max_shard_bytes=20_000)  # sharded index
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-4, rtol=0)
        assert torch.equal(again(x), ours(x))


def test_bad_checkpoint_errors(tmp_path):
    ref = hf_model("llama_gqa")
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 32
    cfg["head_dim"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        twinplane.load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        twinplane.load_model(tmp_path / "nowhere")

"""Nothing silent: every option transformers' config defines for a native family, turned on one at a time, either gives
transformers' logits or is refused with one line. A model never runs as a slightly different one, and its
parameter counts (memory, MFU, `plan`) are those of transformers' model."""

import copy

import pytest
import torch

import twinplane
from twinplane.model import ModelConfig, Transformer
from twinplane.model.families import FAMILIES

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
           "olmo2": "Olmo2Config", "olmo3": "Olmo3Config", "deepseek_v3": "DeepseekV3Config", "glm": "GlmConfig",
           "glm4": "Glm4Config", "phi3": "Phi3Config"}
CONFIGS.update(gemma2="Gemma2Config", gemma3_text="Gemma3TextConfig")
CONFIGS.update(gpt_oss="GptOssConfig")
CONFIGS.update(qwen3_next="Qwen3NextConfig", qwen3_5_text="Qwen3_5TextConfig", qwen3_5_moe_text="Qwen3_5MoeTextConfig")
# Keys that do not describe the model (labels, output switches, bookkeeping), or that the sweep can't turn alone.
SKIP = {"model_type", "architectures", "transformers_version", "dtype", "_name_or_path", "id2label", "label2id",
        "return_dict", "output_hidden_states", "output_attentions", "problem_type", "is_encoder_decoder",
        "chunk_size_feed_forward", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"}
T = 16  # tokens: longer than every window the sweep sets
WINDOW = 5
HEAD_DIM = 12  # not hidden_size / heads: an explicit head_dim is exercised too


def rope_cases(max_pos: int) -> dict:
    """One `rope_parameters` per scaling type transformers knows, with the numbers each needs."""
    half = HEAD_DIM // 2
    return {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": max_pos // 4},
        "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(half)],
                     "long_factor": [2.0 + i / 10 for i in range(half)],
                     "original_max_position_embeddings": max_pos // 4},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16},
        "proportional": {"rope_type": "proportional", "factor": 2.0},
    }


def changed(key: str, value, n_layers: int):
    """A value other than the default that a config could hold, or None when there is nothing to try."""
    if isinstance(value, bool):
        return not value
    if key.endswith("_token_id"):
        return 3
    if isinstance(value, int):
        return value + 2 if key == "head_dim" else value + 1  # (rope needs an even head size)
    if isinstance(value, float):
        return value * 1.5 if value else 0.1
    if key == "hidden_act":
        return "gelu_pytorch_tanh"
    if key == "layer_types":
        return ["sliding_attention"] + ["full_attention"] * (n_layers - 1)
    if key == "mlp_only_layers":
        return [0]
    if key == "sliding_window":
        return WINDOW
    return None


# sizes a family needs beyond BASE and MOE (DeepSeek-V3: latent attention, a key per head, expert groups)
FAMILY_SETTINGS = {"deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                       head_dim=8, qk_nope_head_dim=10, v_head_dim=12, n_group=2, topk_group=1,
                                       first_k_dense_replace=1)}
FAMILY_SETTINGS.update(glm=dict(pad_token_id=0), glm4=dict(pad_token_id=0), phi3=dict(pad_token_id=0))  # (their
# default padding token is past the sweep's vocabulary)
FAMILY_SETTINGS.update(qwen3_next=dict(  # both layer kinds, value heads sharing key heads, an even rotary part
    head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3))
FAMILY_SETTINGS["qwen3_5_text"] = FAMILY_SETTINGS["qwen3_5_moe_text"] = FAMILY_SETTINGS["qwen3_next"]


def settings(model_type: str) -> dict:
    return {**BASE, "head_dim": HEAD_DIM, **(MOE if FAMILIES[model_type].mlp is not FAMILIES["llama"].mlp else {}),
            **FAMILY_SETTINGS.get(model_type, {})}


def cases(model_type: str, config_cls) -> dict[str, dict]:
    """name -> overrides: every option alone, each rope type, and the windows a family can ask for."""
    base = config_cls(**settings(model_type)).to_dict()
    out = {}
    for key, value in base.items():
        if key in SKIP or key == "rope_parameters":
            continue
        new = changed(key, value, BASE["num_hidden_layers"])
        if new is not None:
            out[key] = {key: new}
    for name, params in rope_cases(BASE["max_position_embeddings"]).items():
        out[f"rope:{name}"] = {"rope_parameters": {"rope_theta": 10000.0, **params}}
    if "use_sliding_window" in base:  # every layer, no layer, some layers
        for start in (0, 1, 3):
            out[f"window from layer {start}"] = dict(use_sliding_window=True, sliding_window=WINDOW,
                                                     max_window_layers=start)
    return out


def build(model_type, config_cls, model_cls, over):
    torch.manual_seed(0)
    cfg = config_cls(**{**settings(model_type), **over})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random biases / norm weights so those paths are exercised
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(0, 0.2)
    return model


def held_by(model) -> tuple[int, int]:
    """(every tensor a transformers model holds: its parameters, tied ones once, and persistent buffers such as
    DeepSeek-V3's correction bias; the same with each sparse layer's routed experts counted k of E)."""
    persistent = set(model.state_dict())
    total = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n in persistent)
    routed = [p for n, p in model.named_parameters() if "experts" in n.split(".")]  # stacked [E, ...]
    if not routed:
        return total, total
    E = routed[0].shape[0]
    return total, total - sum(p.numel() for p in routed) // E * (E - model.config.num_experts_per_tok)


def counts_differ(ours: ModelConfig, ref) -> str | None:
    """How twinplane's parameter counts differ from what transformers' model holds (None: they agree)."""
    want = held_by(ref)
    got = (ours.num_params, ours.active_params)
    return None if got == want else f"counts (total, active) {got}, transformers holds {want}"


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_option_matches_transformers_or_is_refused(model_type, tmp_path):
    config_cls = getattr(transformers, CONFIGS[model_type])
    model_cls = getattr(transformers, FAMILIES[model_type].architecture)
    x = torch.randint(0, BASE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    wrong, outcome = [], {}
    for name, over in cases(model_type, config_cls).items():
        try:
            ref = build(model_type, config_cls, model_cls, copy.deepcopy(over))
            with torch.no_grad():
                expected = ref(x, use_cache=False).logits
        except Exception:  # a value transformers itself rejects (or can't run) is not an option to sweep
            outcome[name] = "invalid"
            continue
        folder = tmp_path / name.replace(":", "_").replace(" ", "_")
        ref.save_pretrained(folder)
        try:
            ModelConfig.from_file(folder)
        except ValueError as e:
            msg = str(e)
            assert "\n" not in msg and str(folder) in msg, f"{name}: refusal is not one line naming the file: {msg}"
            outcome[name] = "refused"
            continue
        ours = twinplane.load_model(folder)
        with torch.no_grad():
            gap = (ours(x) - expected).abs().max().item()
        outcome[name] = f"match {gap:.1e}"
        if gap > 1e-4:
            wrong.append(f"{name}: loads but logits differ by {gap:.3g}")
        if (why := counts_differ(ours.config, ref)) is not None:  # (memory and MFU read them)
            wrong.append(f"{name}: {why}")
    assert not wrong, f"{model_type} runs as a different model: {wrong}"
    # the sweep reached the options that matter (not all invalid) and both outcomes occur
    assert sum(v.startswith("match") for v in outcome.values()) >= 10, outcome
    assert sum(v == "refused" for v in outcome.values()) >= 2, outcome


def test_refusals_name_the_feature_and_windows_round_trip():
    base = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                num_attention_heads=2)
    with pytest.raises(ValueError, match="layer_types has sliding_attention layers but no sliding_window"):
        ModelConfig.from_hf(base | dict(layer_types=["sliding_attention"] * 4))
    with pytest.raises(ValueError, match="attention_dropout=0.1 turns on dropout"):
        ModelConfig.from_hf(base | dict(attention_dropout=0.1))
    with pytest.raises(ValueError, match="'nemotron_h' has no native implementation"):
        ModelConfig.from_hf(dict(model_type="nemotron_h", hybrid_override_pattern="M-M*"))
    # windows from max_window_layers on (4.x) become per-layer kinds; every layer sliding is Mistral's window.
    # Both are written back in a form that reads the same way (the sweep checks transformers' side).
    cfg = ModelConfig.from_hf(base | dict(use_sliding_window=True, sliding_window=4, max_window_layers=2))
    assert (cfg.sliding_window, cfg.layer_types) == (4, ["full_attention"] * 2 + ["sliding_attention"] * 2)
    again = ModelConfig.from_hf(cfg.to_hf())
    assert (again.sliding_window, again.layer_types) == (cfg.sliding_window, cfg.layer_types)
    cfg = ModelConfig.from_hf(base | dict(use_sliding_window=True, sliding_window=4, max_window_layers=0))
    assert (cfg.sliding_window, cfg.layer_types) == (4, None)
    assert ModelConfig.from_hf(cfg.to_hf()).sliding_window == 4


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_are_transformers(model_type, tied):
    """`num_params` and `active_params` of each family's config equal what transformers' model holds, with and
    without tied embeddings (GPT-OSS's biases and sinks, Gemma's four norms, latent attention's norms, DeltaNet's
    convolution and gates, Qwen3-Next's query gate ...); on the meta device, nothing allocated."""
    config_cls = getattr(transformers, CONFIGS[model_type])
    hf = config_cls(**{**settings(model_type), "tie_word_embeddings": tied})
    with torch.device("meta"):
        ref = getattr(transformers, FAMILIES[model_type].architecture)(hf)
    ours = ModelConfig.from_hf(hf.to_dict())
    assert counts_differ(ours, ref) is None, counts_differ(ours, ref)
    with torch.device("meta"):
        assert ours.num_params == sum(p.numel() for p in Transformer(ours).parameters())

"""The one memory model: the KV bytes formula against a real KV pool, and the run gate and `plan` agreeing."""

import copy

import pytest
import torch

from twinplane.config import load_config
from twinplane.data.tasks import ALPHABET
from twinplane.model import ModelConfig, Transformer
from twinplane.model.lora import adapter_numel, apply_lora
from twinplane.model.memory import Dtypes, kv_bytes_per_token, lora_params, rollout_memory, training_memory
from twinplane.rollout.kv_cache import KVCache, bytes_per_block
from twinplane.run import preflight
from twinplane.run.prepare import demo_model_config
from twinplane.tokenizer import build_char_tokenizer
from twinplane.tools.plan import CPU, from_run_config

GQA = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=8, num_kv_heads=2,
                  head_dim=16)


def test_kv_bytes_per_token_by_hand_and_in_the_engine_pool():
    assert kv_bytes_per_token(GQA, 2) == 2 * 3 * 2 * 16 * 2 == 384  # K and V x layers x kv heads x head_dim x bf16
    assert kv_bytes_per_token(GQA, 4, tp=2) == 2 * 3 * 1 * 16 * 4  # a TP rank holds half the KV heads
    assert kv_bytes_per_token(GQA, 2, tp=8) == 2 * 3 * 1 * 16 * 2  # more ranks than KV heads: they replicate
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVCache(GQA, num_blocks=5, block_size=16, dtype=dtype, device=torch.device("cpu"))
        held = pool.k.numel() * pool.k.element_size() + pool.v.numel() * pool.v.element_size()
        assert bytes_per_block(GQA, 16, dtype) * 5 == held == kv_bytes_per_token(GQA, dtype.itemsize) * 16 * 5


def _run_config(tmp_path, *lines):
    path = tmp_path / "run.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("lines", [
    ("algo:", "  kl_coef: 0.05", "rollout:", "  max_num_seqs: 64"),  # full fine-tuning with a reference copy
    ("train:", "  lora:", "    rank: 4", "    targets: q_proj,v_proj", "algo:", "  kl_coef: 0.05"),
], ids=["full", "lora"])
def test_gate_and_plan_agree(tmp_path, lines):
    """The run gate (`train`) and the planner read one model: from one config file the same parts, in bytes."""
    path = _run_config(tmp_path, *lines)
    cfg = load_config(path)
    mc = demo_model_config(cfg, build_char_tokenizer(ALPHABET))
    gate = preflight.estimate_bytes(cfg, mc, "cpu")
    plan_mc, w, name = from_run_config(path)
    assert name == "the demo's built-in model"
    dt = Dtypes.for_device(CPU)
    assert plan_mc == mc and preflight.memory_inputs(cfg, "cpu") == (dt, w)  # fp32 on the CPU, either way
    tm, rm = training_memory(plan_mc, dt, w), rollout_memory(plan_mc, dt, w)
    assert gate == {k: v for k, v in {"weights, grads and AdamW": tm.params + tm.grads + tm.master + tm.moments,
                                      "KV cache": rm.kv_cache, "engine weights": rm.weights,
                                      "reference": tm.reference}.items() if v}

    # and by hand, against the real model: fp32 weights, grads and two moments, or a frozen base and the
    # adapters' weights, grads and moments; the reference copy only without LoRA; the engine's own copy
    p = mc.num_params
    model = Transformer(copy.deepcopy(mc))
    assert p == sum(x.numel() for x in model.parameters())
    seqs = min(cfg.rollout.max_num_seqs, cfg.rollout.samples)
    assert gate["KV cache"] == 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4 * seqs * (
        preflight.prompt_tokens(cfg) + cfg.rollout.max_new_tokens)
    if cfg.train.lora.rank:
        apply_lora(model, 4, 8.0, targets="q_proj,v_proj")
        lp = adapter_numel(model)
        assert lora_params(mc, 4, ("q_proj", "v_proj")) == lp
        assert gate["weights, grads and AdamW"] == 4 * p + 16 * lp and "reference" not in gate
        assert gate["engine weights"] == 4 * p + 4 * lp
    else:
        assert gate["weights, grads and AdamW"] == 16 * p and gate["reference"] == 4 * p
        assert gate["engine weights"] == 4 * p


def test_gate_refuses_by_the_model(tmp_path):
    cfg = load_config(None, ["train.lora.rank=4"])
    mc = demo_model_config(cfg, build_char_tokenizer(ALPHABET))
    need = sum(preflight.estimate_bytes(cfg, mc, "cpu").values())
    preflight.check_memory(cfg, mc, int(need) + 1, "this device")
    with pytest.raises(preflight.InputError, match=r"^the run needs at least .* GB \(weights, grads and AdamW"):
        preflight.check_memory(cfg, mc, int(need) - 1, "this device")

"""The one memory model: the KV bytes formula against a real KV pool, and the run gate and `plan` agreeing."""

import copy
import dataclasses

import pytest
import torch

from twinplane.config import load_config
from twinplane.data.tasks import ALPHABET
from twinplane.model import AttentionMetadata, ModelConfig, Transformer
from twinplane.model.lora import adapter_numel, apply_lora
from twinplane.model.memory import (
    Dtypes,
    Workload,
    activation_bytes_per_token_layer,
    kv_bytes_per_token,
    linear_attention_bytes_per_token_layer,
    lora_params,
    rollout_memory,
    state_bytes_per_sequence,
    training_memory,
)
from twinplane.rollout.kv_cache import KVCache, bytes_per_block, pool_blocks
from twinplane.rollout.recurrent_state import RecurrentStates
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


# Qwen3-Next's hybrid: layers 0, 2, 3 Gated DeltaNet (2 key heads of 8, 4 value heads of 12, 4 taps), layer 1 attends
HYBRID = ModelConfig.from_hf(dict(
    model_type="qwen3_next", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=0,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4))


def test_hybrid_kv_holds_attention_layers_only_and_states_are_counted():
    assert HYBRID.attention_layers == [1]
    assert kv_bytes_per_token(HYBRID, 2) == 2 * 1 * 2 * 16 * 2 == 128  # K and V x 1 attention layer (not 4)
    # per linear layer: conv history 3 taps x (q 16 + k 16 + v 48 channels) in bf16, the fp32 state 4 x 8 x 12
    assert state_bytes_per_sequence(HYBRID, 2) == 3 * (3 * 80 * 2 + 4 * 8 * 12 * 4) == 3 * 2016
    assert state_bytes_per_sequence(GQA, 2) == 0
    for dtype in (torch.float32, torch.bfloat16):
        states = RecurrentStates(HYBRID, dtype, torch.device("cpu"), slots=5)
        assert states.nbytes == 5 * state_bytes_per_sequence(HYBRID, dtype.itemsize)
        pool = KVCache(HYBRID, num_blocks=5, block_size=16, dtype=dtype, device=torch.device("cpu"))
        assert pool.k.shape[0] == 1 and pool.index == (-1, 0, -1, -1)
        assert pool.nbytes == bytes_per_block(HYBRID, 16, dtype) * 5 == kv_bytes_per_token(HYBRID, dtype.itemsize) * 80
    # a 1 MiB budget: 4x the tokens of a pool sized for every layer, less the states of the sequences at once
    per_block, states = bytes_per_block(HYBRID, 16, torch.bfloat16), 8 * int(state_bytes_per_sequence(HYBRID, 2))
    cpu = torch.device("cpu")
    assert pool_blocks(HYBRID, cpu, torch.bfloat16, 16, 0, 2**20, 0.9, 16) == 2**20 // per_block == 512
    assert pool_blocks(HYBRID, cpu, torch.bfloat16, 16, 0, 2**20, 0.9, 16, states=states) == (2**20 - states) // 2048
    with pytest.raises(preflight.InputError, match=r"beside .* GiB of recurrent states; one sequence of 16 tokens"):
        pool_blocks(HYBRID, cpu, torch.bfloat16, 16, 0, states + per_block - 1, 0.9, 16, states=states)
    rm = rollout_memory(HYBRID, Dtypes(), Workload(prompts_per_step=2, n=4, prompt_len=10, response_len=22))
    assert rm.kv_cache == 128 * 8 * 32 and rm.states == 8 * 3 * 2016
    assert rm.total == rm.weights + rm.kv_cache + rm.states + rm.workspace


def saved_bytes_per_token(model: Transformer, layer: int, T: int = 512) -> float:
    """What autograd keeps for backward from one training forward of `layer` over a packed row of T tokens (each
    storage once; the weights and the layer's input excluded), per token."""
    meta = AttentionMetadata.packed([T], "cpu")
    x = model.model.embed_tokens(torch.randint(0, 32, (1, T))).detach().requires_grad_(True)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[layer](x, *model.rope(meta.positions, x.dtype), meta)
    return sum(kept.values()) / T


@pytest.mark.parametrize("shape", [dict(), dict(hidden_size=320, intermediate_size=640, linear_key_head_dim=48,
                                                linear_num_value_heads=12, linear_value_head_dim=40)])
def test_linear_attention_activations_are_what_autograd_saves(shape):
    """A Gated DeltaNet layer's estimate against the bytes autograd keeps (fp32, CPU); a hybrid's training
    activations sum each layer kind's own estimate."""
    cfg = dataclasses.replace(HYBRID, **shape)
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    want = saved_bytes_per_token(model, 0)
    assert linear_attention_bytes_per_token_layer(cfg, 4) == pytest.approx(want, rel=0.05)
    w = Workload(micro_batch_size=2, prompt_len=100, response_len=156)
    per_token = 3 * linear_attention_bytes_per_token_layer(cfg, 4) + activation_bytes_per_token_layer(cfg, 4)
    assert training_memory(cfg, Dtypes(act=4), w).activations == 512 * (per_token + 3 * cfg.hidden_size * 4)


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

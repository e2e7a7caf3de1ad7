"""The CPU rollout fast paths against their portable versions: oneDNN prepacked linears vs `F.linear`, the KV pool
kept between `generate` calls vs a fresh one, and the host allocator setting's opt-outs."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from twinplane.model.lora import apply_lora
from twinplane.platform import backends, runtime
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.prepacked import (
    PrepackedAttention,
    PrepackedLinear,
    PrepackedLoraLinear,
    PrepackedMLP,
    PrepackedWeight,
    prepack_linears,
    repack,
)

EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_heads=4, num_kv_heads=4)  # wide enough to pack
packed_only = pytest.mark.skipif(not backends.prepacked_linear_ok(torch.device("cpu"), torch.float32),
                                 reason="this torch build has no oneDNN prepacked linear")


@packed_only
def test_packed_weight_equals_f_linear_and_follows_in_place_changes():
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 40), torch.randn(96), torch.randn(70, 40)
    pack = PrepackedWeight()
    full = pack(x, (w,), (b,))
    torch.testing.assert_close(full, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    # a row's result does not depend on how many rows share the call (what batch-independent sampling wants)
    assert all(torch.equal(pack(x[:m], (w,), (b,)), full[:m]) for m in (1, 3, 17, 64))
    with torch.no_grad():
        w.mul_(-2)  # in place, as a weight sync's copy_: the next call re-packs
    torch.testing.assert_close(pack(x, (w,), (b,)), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@packed_only
def test_pack_linears_keeps_parameters():
    model = tiny_model(**WIDE)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = model(ids)
        # per layer: q/k/v as one GEMM, o, gate/up as one, down; not the 50-row LM head
        assert prepack_linears(model) == 2 * 4
        got = model(ids)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn, PrepackedAttention) and isinstance(layer.mlp, PrepackedMLP)
    assert isinstance(layer.self_attn.o_proj, PrepackedLinear) and type(layer.mlp.up_proj) is torch.nn.Linear
    assert list(model.state_dict()) == list(state) and all(torch.equal(model.state_dict()[k], v)
                                                           for k, v in state.items())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    clone = copy.deepcopy(model)  # the prepacked copies are not copied; the clone prepacks its own
    with torch.no_grad():
        assert torch.equal(clone(ids), got)
    # with autograd on, the prepacked ops (forward only) step aside: gradients flow as through nn.Linear
    model.requires_grad_(True)
    model(ids).sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


@packed_only
def test_fused_projections_follow_in_place_changes_and_biases():
    """One GEMM over stacked q/k/v (with Qwen2's biases) and gate/up equals the separate linears, and `repack`
    re-packs when any one of the stacked weights or biases changed in place (a weight sync's copy_). (1e-4: the
    GEMMs sum in different orders; a stale prepacking would be off by the changes, ~0.1 and more.)"""
    model = tiny_model(**{**WIDE, "num_kv_heads": 2}, qkv_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    prepacked, ids = copy.deepcopy(model), torch.tensor([[5, 6, 7, 8, 9, 10]])
    prepack_linears(prepacked)
    assert isinstance(prepacked.model.layers[1].self_attn, PrepackedAttention)
    with torch.no_grad():
        torch.testing.assert_close(prepacked(ids), model(ids), atol=1e-4, rtol=1e-4)
        for m in (model, prepacked):
            m.model.layers[1].self_attn.k_proj.bias.add_(0.1)
            m.model.layers[0].mlp.up_proj.weight.mul_(-1)
        assert (prepacked(ids) - model(ids)).abs().max() > 0.01  # GEMMs read the prepacking unchecked until a repack
        repack(prepacked)
        torch.testing.assert_close(prepacked(ids), model(ids), atol=1e-4, rtol=1e-4)


@packed_only
def test_engine_follows_weights_changed_in_place_between_calls():
    """Weights changed in place outside `load_weights` (a user's or test's copy_) are re-packed by the next
    generate call: its samples are those of a fresh engine with those weights."""
    model = tiny_model(**WIDE)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3)
    engine.generate(PROMPTS, sp)
    with torch.no_grad():
        for m in (model, engine.model):
            m.model.layers[0].self_attn.q_proj.weight.mul_(-1)
            m.model.layers[1].mlp.down_proj.weight.add_(0.05)
    got, want = engine.generate(PROMPTS, sp), RolloutEngine(model, eos_token_id=EOS).generate(PROMPTS, sp)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]


@packed_only
def test_packed_lora_linear_equals_lora_linear():
    model = tiny_model(**WIDE)
    apply_lora(model, 4, alpha=8.0, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)  # nonzero adapters, so the low-rank path counts
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    prepacked = copy.deepcopy(model)
    assert prepack_linears(prepacked) > 0
    assert isinstance(prepacked.model.layers[0].self_attn.q_proj, PrepackedLoraLinear)
    with torch.no_grad():
        torch.testing.assert_close(prepacked(ids), model(ids), atol=1e-5, rtol=1e-5)


@packed_only
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0, max_new_tokens=12, n=2),
                                      SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5)])
def test_packed_engine_equals_the_portable_engine(monkeypatch, sampling):
    """Same tokens; log-probs within fp32 GEMM reordering. (A narrow model is not prepacked: see `worth_prepacking`.)"""
    assert not RolloutEngine(tiny_model(), eos_token_id=EOS).prepacked
    model = tiny_model(**WIDE)
    fast = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, seed=1)
    monkeypatch.setattr(backends, "prepacked_linear_ok", lambda device, dtype: False)
    portable = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, seed=1)
    assert fast.prepacked and not portable.prepacked
    assert not any(isinstance(m, PrepackedLinear) for m in portable.model.modules())
    a, b = fast.generate(PROMPTS, sampling), portable.generate(PROMPTS, sampling)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for x, y in zip(a, b, strict=True):
        # 1e-5 relative: the two GEMMs sum 256-wide dot products in different orders
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=1e-5)


@packed_only
def test_sync_packs_the_lm_head_once_and_the_next_forward_uses_it(monkeypatch):
    """`load_weights` re-packs the LM head as part of the sync (not in the next rollout), from the head weight."""
    model = tiny_model(**WIDE, vocab_size=256)  # 256 x 256 head: worth prepacking
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    assert engine.head is not None
    new = {n: p + 0.01 for n, p in model.named_parameters()}
    engine.load_weights(new.items())
    prepacks = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, *a: prepacks.append(w.shape) or reorder(w, *a))
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)
    got = engine.generate(PROMPTS, sp)
    assert prepacks == []  # the sync prepacked everything, the head from its weight
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(new)
    want = RolloutEngine(fresh, eos_token_id=EOS).generate(PROMPTS, sp)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]


def test_kv_pool_is_kept_between_calls_on_cpu():
    """The second call reuses the first call's pool (zeroed), with the outputs and metrics of a fresh engine; a call
    that needs more blocks gets a new pool."""
    model = tiny_model()
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    engine.generate(PROMPTS, sp)
    engine.pop_metrics()
    pool = engine.kv.k.data_ptr()
    again = engine.generate(PROMPTS[:2], sp)
    assert engine.kv.k.data_ptr() == pool
    fresh = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    want = fresh.generate(PROMPTS[:2], sp)
    assert [s.token_ids for s in again] == [s.token_ids for s in want]
    assert [s.logprobs for s in again] == [s.logprobs for s in want]
    assert engine.pop_metrics()["rollout/kv_cache_usage_peak"] == fresh.pop_metrics()["rollout/kv_cache_usage_peak"]
    engine.generate(PROMPTS * 4, SamplingParams(max_new_tokens=30, n=4))
    assert engine.kv.num_blocks > fresh.kv.num_blocks
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_host_allocator_opt_outs(monkeypatch):
    monkeypatch.setenv("TWINPLANE_HOST_ALLOCATOR", "0")
    assert runtime.tune_host_allocator() is False
    monkeypatch.delenv("TWINPLANE_HOST_ALLOCATOR")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # the user tunes malloc themselves: left alone
    assert runtime.tune_host_allocator() is False

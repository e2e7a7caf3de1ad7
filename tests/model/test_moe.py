"""MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers, the expert paths against each other, and
routing record/replay."""

import pytest
import torch
from conftest import saved_and_reloaded, tiny_moe

import twinplane
from twinplane.model import Transformer
from twinplane.model.moe import RoutingState, load_balancing_loss, routing_agreement
from twinplane.platform import backends

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "qwen3_moe_step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=80,
        norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def hf_model(case):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    m = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # router weights large enough that top-k choices differ between tokens
        for n, p in m.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(0, 0.2)
            elif "gate" in n and "proj" not in n:
                p.normal_(0, 0.5)
    return m


def ids(batch=3, t=11, vocab=97):
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    ref = hf_model(case)
    ref.save_pretrained(tmp_path)  # the published per-expert layout
    ours = twinplane.load_model(tmp_path)
    assert ours.config.num_experts == getattr(ref.config, "num_experts", None) or ref.config.num_local_experts
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)
        mask = torch.ones_like(x)
        mask[0, :4] = 0  # left padding
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        keep = mask.bool()
        torch.testing.assert_close(ours(x, mask)[keep], ref(x, attention_mask=mask, position_ids=pos).logits[keep],
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_saved_weights_load_in_transformers(case, tmp_path):
    ref = hf_model(case)
    ours, back, again = saved_and_reloaded(ref, tmp_path, max_shard_bytes=60_000)  # experts split across files
    assert type(back) is type(ref)
    again = twinplane.load_model(tmp_path / "out")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-4, rtol=0)
        assert torch.equal(again(x), ours(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_equals_loop(dtype):
    experts = tiny_moe().model.layers[0].mlp.experts.to(dtype)
    E, F_, D = experts.gate_proj.shape
    if not backends.grouped_mm_ok(torch.device("cpu"), dtype, (F_, D), grad=False):
        pytest.skip("torch._grouped_mm not available here")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, D, generator=g).to(dtype)
    idx = torch.rand(37, E, generator=g).topk(2, -1).indices
    idx[:10] = torch.tensor([0, 2])  # uneven loads; expert 1/3 may get few tokens
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    xs = x.repeat_interleave(2, 0)[idx.reshape(-1).argsort(stable=True)]
    with torch.no_grad():
        a, b = experts.grouped(xs, counts), experts.loop(xs, counts)
        empty = torch.bincount(torch.zeros(4, dtype=torch.long), minlength=E)  # experts with no tokens
        torch.testing.assert_close(experts.grouped(x[:4], empty), experts.loop(x[:4], empty))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a, b, **tol)


def test_aux_loss_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(2 * 7, 6, generator=g) for _ in range(3)]
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    ref = load_balancing_loss_func(tuple(logits), 6, 2, mask)
    torch.testing.assert_close(load_balancing_loss(logits, 2, mask.reshape(-1).bool()), ref)
    torch.testing.assert_close(load_balancing_loss(logits, 2), load_balancing_loss_func(tuple(logits), 6, 2))


def test_record_then_replay_changes_nothing():
    model = tiny_moe()
    x = ids(vocab=50)
    rec = RoutingState()
    with torch.no_grad():
        a = model(x, routing=rec)
        recorded = rec.indices()  # [N, M, k]
        assert recorded.shape == (x.numel(), len(model.config.moe_layers), 2)
        assert len(recorded.unique()) > 1
        replay = RoutingState(replay=recorded.to(torch.int16))
        b = model(x, routing=replay)
    assert torch.equal(a, b)
    assert routing_agreement(replay.indices(), recorded) == (recorded[..., 0].numel(),) * 2


def test_replay_uses_recorded_experts_and_router_keeps_gradient():
    model = tiny_moe()
    x = ids(vocab=50)
    with torch.no_grad():
        own = RoutingState()
        model(x, routing=own)
    forced = (own.indices() + 1) % 4  # every token on other experts than its router picks
    forced[:5] = -1  # unrecorded tokens fall back to the router
    state = RoutingState(replay=forced, keep_logits=True)
    model.train()
    out = model(x, routing=state)
    for m in range(forced.shape[1]):
        assert torch.equal(state.used[m][5:], forced[5:, m])
        assert torch.equal(state.used[m][:5], own.chosen[m][:5])
    (out.square().mean() + load_balancing_loss(list(state.logits.values()), 2)).backward()
    for layer in model.config.moe_layers:
        assert model.model.layers[layer].mlp.gate.weight.grad.abs().sum() > 0
    agree, counted = routing_agreement(state.indices(), forced)  # the router's own picks mostly differ
    assert counted == (x.numel() - 5) * forced.shape[1] and agree < counted / 2


def test_routing_agreement_counts_sets():
    own = torch.tensor([[[0, 1]], [[2, 3]], [[1, 2]]])  # [N=3, M=1, k=2]
    rec = torch.tensor([[[1, 0]], [[2, 1]], [[-1, -1]]])  # same set, different set, unrecorded
    assert routing_agreement(own, rec) == (1, 2)


def test_moe_param_counts():
    cfg = tiny_moe(qk_norm=False).config  # (num_params leaves out the tiny q/k norm weights)
    model = Transformer(cfg)
    assert cfg.num_params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert cfg.active_params == cfg.num_params - experts // 2  # top-2 of 4 experts run per token

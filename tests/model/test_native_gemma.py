"""Gemma 2 and Gemma 3 (text) natively, on tiny configs with every feature that sets them apart turned on (windows
shorter than the sequences on alternating layers, soft-capped attention scores and final logits, a
query_pre_attn_scalar other than head_dim, Gemma 3's q/k norms and local/global ropes with scaling), against
transformers: logits, padded and packed log-probs, the rollout engine against `generate`, saving, and a short run."""

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_reference, make_batch, peaked_weights, saved_and_reloaded, three_step_run, token_ids

import twinplane
from twinplane.model import AttentionMetadata, ModelConfig
from twinplane.model.attention import capped_attention
from twinplane.model.impl import choose
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.train import Batch
from twinplane.train.chunked_logprobs import token_logprobs
from twinplane.train.logprobs import response_logprobs

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=3,
             pad_token_id=0, sliding_window=4, query_pre_attn_scalar=24, attention_bias=True)
CASES = {  # model type -> (config class, its distinguishing options)
    "gemma2": ("Gemma2Config", dict(attn_logit_softcapping=3.0, final_logit_softcapping=2.5)),
    "gemma3_text": ("Gemma3TextConfig", dict(final_logit_softcapping=2.5, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}})),
}
EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


def hf_model(kind, seed=0, **over):
    cls, extra = CASES[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls)(**{**SIZES, **extra, **over})
    return peaked_weights(transformers.AutoModelForCausalLM.from_config(cfg))  # (Gemma's norms: offsets from 1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    out = {}
    for kind in CASES:
        hf_model(kind).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


reference, ids = hf_reference, token_ids


@pytest.mark.parametrize("kind", list(CASES))
def test_logits_and_padded_batch_match_transformers(kind, folders):
    assert choose(folders[kind]).impl == "native"
    ours, ref = twinplane.load_model(folders[kind]), reference(folders[kind])
    assert ours.config.layer_types == ref.config.layer_types and ours.config.sliding_window == 4
    x = ids(13)
    with torch.no_grad():
        got, want = ours(x), ref(x).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert want.abs().max() < 2.5  # the final soft-cap is at work
        # each feature matters here: without the windows the logits would differ
        ours._layer_attention = [(None, *a[1:]) for a in ours._layer_attention]
        assert (ours(x) - want).abs().max() > 1e-2
    ours = twinplane.load_model(folders[kind])
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    with torch.no_grad():
        a = ours(x, attention_mask=mask)
        b = ref(x, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", list(CASES))
def test_trainer_logprobs_are_transformers_log_softmax_with_grads(kind, folders):
    """The chunked log-probs (soft-capped logits, forward and backward) against transformers' logits."""
    model, ref = twinplane.load_model(folders[kind]), reference(folders[kind])
    prompts, responses = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13, 14, 15, 16, 17], [18, 19, 20]]
    batch = Batch.collate(prompts, responses, 0)
    lp, _ = response_logprobs(model, batch, 0.7, packed=True)
    x = torch.tensor([prompts[0] + responses[0]])
    want = F.log_softmax(ref(x).logits[0, 4:-1] / 0.7, -1).gather(-1, x[0, 5:, None])[:, 0]
    torch.testing.assert_close(lp[0], want, atol=1e-5, rtol=0)
    # gradients through the cap: chunked (chunk 3 of 8 tokens) against autograd over the whole logits
    g = torch.Generator().manual_seed(0)
    h = torch.randn(8, 64, generator=g, requires_grad=True)
    w = (torch.randn(64, 64, generator=g) * 0.5).requires_grad_()
    y = torch.randint(0, 64, (8,), generator=g)
    got_lp, got_ent = token_logprobs(h, w, y, 0.7, chunk=3, with_entropy=True, softcap=2.5)
    logp = F.log_softmax(torch.tanh(h @ w.T / 2.5) * 2.5 / 0.7, -1)
    want_lp, want_ent = logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=0)
    weights = torch.randn(2, 8, generator=g)
    got = torch.autograd.grad((got_lp * weights[0] + got_ent * weights[1]).sum(), (h, w))
    want = torch.autograd.grad((want_lp * weights[0] + want_ent * weights[1]).sum(), (h, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(CASES))
def test_packed_equals_padded(kind, folders):
    model = twinplane.load_model(folders[kind])
    batch = make_batch(model)
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, 1.0, packed=False)
        packed, _ = response_logprobs(model, batch, 1.0, packed=True)
        shared, _ = response_logprobs(model, batch.select(torch.tensor([0, 0, 1, 1, 2])), 1.0, packed=True,
                                      share_prompts=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared, padded[[0, 0, 1, 1, 2]], rtol=1e-5, atol=1e-5)


def test_fast_backends_fall_back_for_soft_capped_layers(folders):
    """A soft-capped layer's metadata leaves flex (and every fused kernel) for the portable path; a layer with only
    its own scale keeps flex, which then scales as the portable path does."""
    meta = AttentionMetadata.packed([5, 9], backend="flex", window=4)
    capped = meta.for_layer(None, 0.2, 3.0)
    assert capped.backend == "sdpa" and capped.window is None and meta.for_layer(4, 0.2).backend == "flex"
    assert meta.for_layer(4) is meta and meta.for_layer(None, 0.2, 3.0) is capped  # one view per forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 14, 16, generator=g) for h in (4, 2, 2))
    ref = capped_attention(q, k, v, None, True, 0.2, 3.0)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.2
    scores = (torch.tanh(scores / 3.0) * 3.0).masked_fill(~torch.ones(14, 14, dtype=torch.bool).tril(), -torch.inf)
    torch.testing.assert_close(ref, scores.softmax(-1) @ v.repeat_interleave(2, 1))
    model = twinplane.load_model(folders["gemma3_text"])  # (no soft-cap: its layers' scale goes through flex)
    x = torch.randint(4, 64, (1, 14), generator=g)
    with torch.no_grad():
        outs = [model(x, meta=AttentionMetadata.packed([5, 9], window=4, backend=b)) for b in ("sdpa", "flex")]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("budget, batch_invariant", [(4096, False), (3, False), (4096, True)])
def test_engine_greedy_equals_generate_and_logprobs_the_trainers(kind, budget, batch_invariant, folders):
    """Budget 3: prompts prefilled in chunks, over the pool; batch_invariant: every GEMM prepacked (oneDNN)."""
    ref = reference(folders[kind])
    engine = RolloutEngine(twinplane.load_model(folders[kind]), eos_token_id=EOS, max_num_batched_tokens=budget,
                           batch_invariant=batch_invariant)
    assert engine.prepacked == batch_invariant
    for prompt in PROMPTS:  # one request at a time, as `generate` runs it; contexts past the window
        got = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0]
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert got.token_ids == want
    sp = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=5)  # sampled together
    samples = engine.generate(PROMPTS, sp)
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0)
    with torch.no_grad():
        lp, _ = response_logprobs(twinplane.load_model(folders[kind]), batch, 0.8)
    m = batch.response_mask.bool()
    rollout = torch.zeros_like(lp)
    for i, s in enumerate(samples):
        rollout[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(lp[m], rollout[m], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", list(CASES))
def test_static_decode_equals_eager(kind, folders):
    """The decode-graph path's fixed buffers (run uncaptured on the CPU): per-window masks over full-width block
    tables, the soft-capped logits it samples from."""
    engines = [RolloutEngine(twinplane.load_model(folders[kind]), eos_token_id=EOS) for _ in range(2)]
    engines[0].graph_backend = "static"
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=3)
    got, want = (e.generate(PROMPTS, sp) for e in engines)
    assert engines[0].pop_metrics()["rollout/engine_steps_graphed"] > 5
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", list(CASES))
def test_triton_engine_equals_the_torch_engine(kind, folders):
    """kernels=triton (Triton's interpreter on the CPU): Gemma 2's attention takes the Triton layer, whose
    soft-capped layers attend on the portable path; Gemma's own norms, MLP and layers keep the torch code."""
    pytest.importorskip("triton")
    engines = [RolloutEngine(twinplane.load_model(folders[kind]), eos_token_id=EOS, kernels=k)
               for k in ("triton", "torch")]
    assert engines[0].kernels == "triton"
    swapped = {type(m).__name__ for m in engines[0].model.modules()} & {"TritonAttention", "TritonDecoderLayer"}
    assert swapped == ({"TritonAttention"} if kind == "gemma2" else set())
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    got, want = (e.generate(PROMPTS[:2], sp) for e in engines)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", list(CASES))
def test_saved_weights_load_in_transformers(kind, tmp_path):
    ours, back, again = saved_and_reloaded(hf_model(kind), tmp_path, max_shard_bytes=40_000)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == [type(back).__name__] and saved["model_type"] == kind
    assert back.config.layer_types == ours.config.layer_types
    x = ids(13)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-4, rtol=0)
        assert torch.equal(again(x), ours(x))


def test_legacy_gemma3_config_form_and_refusals(tmp_path):
    """Gemma 3's 4.x keys (rope_theta + rope_scaling for global layers, rope_local_base_freq, sliding_window_pattern)
    read as transformers reads them; what twinplane does not run is refused by name."""
    cfg = ModelConfig.from_hf(dict(
        model_type="gemma3_text", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
        num_attention_heads=2, head_dim=4, rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 4.0},
        rope_local_base_freq=100.0, sliding_window_pattern=2, sliding_window=4))
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (5000.0, {"rope_type": "linear",
                                                                             "factor": 4.0}, 100.0)
    again = ModelConfig.from_hf(cfg.to_hf())
    assert (again.layer_types, again.rope_local_theta, again.rope_scaling) == (cfg.layer_types, 100.0,
                                                                              cfg.rope_scaling)
    base = dict(model_type="gemma2", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2)
    for over, message in [(dict(use_bidirectional_attention=True), "bidirectional"),
                          (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
                          (dict(sliding_window=None), "sliding_window")]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf(base | over)
    with pytest.raises(ValueError, match="ignores"):
        ModelConfig.from_hf(base | dict(model_type="gemma3_text", attn_logit_softcapping=50.0))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_three_step_train_run(kind, tmp_path):
    final = transformers.AutoModelForCausalLM.from_pretrained(three_step_run(tmp_path, partial(hf_model, kind)))
    assert final.config.model_type == kind

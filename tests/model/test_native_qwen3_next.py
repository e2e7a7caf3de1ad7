"""Qwen3-Next, Qwen3.5 (text) and Qwen3.5-MoE (text) natively, on tiny configs with both layer kinds (Gated DeltaNet
with value heads sharing key heads, gated attention with partial rotary and biases) and, for Qwen3-Next, routed and
shared experts and a dense layer (Qwen3.5-MoE: experts on every layer), against transformers:
the delta rule's two forms, logits over dense, padded, packed and shared-prefix rows, the trainer's log-probs, the
rollout engine against `generate` (prefill chunks, forks, preemption), saving, and a short run."""

import copy
import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_reference, make_batch, peaked_weights, saved_and_reloaded, three_step_run, token_ids

import twinplane
from twinplane.model import AttentionMetadata, deltanet, load_weights
from twinplane.model.impl import choose
from twinplane.model.memory import state_bytes_per_sequence
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.kv_cache import bytes_per_block
from twinplane.train import Batch
from twinplane.train.logprobs import response_logprobs

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as reference_code  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=3,
             pad_token_id=0, attention_bias=True, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
CASES = {  # model type -> (config class, model class, its own options)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[2])),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(  # (experts on every layer)
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
}
EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


def hf_model(kind="qwen3_next", seed=0, **over):
    config, model, extra = CASES[kind]
    torch.manual_seed(seed)
    m = getattr(transformers, model)(getattr(transformers, config)(**{**SIZES, **extra, **over}))
    return peaked_weights(m, special=[("A_log", lambda p: p.uniform_(-1, 1))])  # (and random decays)


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    hf_model(request.param).save_pretrained(path)
    return path


reference, ids = hf_reference, token_ids


def test_delta_rule_forms_match_transformers_reference():
    """Chunked (several chunk sizes, a last chunk partly filled, an initial state, value heads sharing key heads)
    and recurrent against transformers' torch reference; gradients of the two forms agree."""
    g0 = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 37, 2, 8, generator=g0) for _ in range(2))
    v = torch.randn(2, 37, 4, 6, generator=g0)
    g, beta = -torch.rand(2, 37, 4, generator=g0) * 2, torch.rand(2, 37, 4, generator=g0)
    state = torch.randn(2, 4, 8, 6, generator=g0)
    want, want_state = reference_code.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for chunk in (5, 8, 64):
        got, got_state = deltanet.chunked(q, k, v, g, beta, state, chunk=chunk)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=0)
    got, got_state = deltanet.recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_state, want_state, atol=1e-6, rtol=0)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    grads = []
    for rule in (lambda *a: deltanet.chunked(*a, chunk=8), deltanet.recurrent):
        out, final = rule(*inputs, state)
        grads.append(torch.autograd.grad((out * out).sum() + final.sum(), inputs))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_logits_padded_packed_and_shared_prefix_match_transformers(folder):
    assert choose(folder).impl == "native"
    ours, ref = twinplane.load_model(folder), reference(folder)
    assert ours.config.linear_layers == [0, 2, 3] and ours.config.rotary_dim == 4
    assert type(ours.model.layers[0].linear_attn).__name__ == (
        "GatedDeltaNet" if ours.config.model_type == "qwen3_next" else "SplitGatedDeltaNet")
    x = ids(70)  # longer than one chunk of the delta rule
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)
        mask = torch.ones_like(x)
        mask[0, :5] = 0  # left padding
        mask[1, -7:] = 0  # right padding
        got = ours(x, attention_mask=mask)
        want = ref(x, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        keep = mask.bool()
        torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=0)
        alone = [ref(x[0:1, :65]).logits[0], ref(x[1:2, :3]).logits[0], ref(x[2:3]).logits[0]]
        row = torch.cat([x[0, :65], x[1, :3], x[2]])[None]  # each sequence restarts its state and convolution
        got = ours(row, meta=AttentionMetadata.packed([65, 3, 70]))[0]
        torch.testing.assert_close(got, torch.cat(alone), atol=1e-4, rtol=0)
        row = torch.cat([x[1, :3], x[0, :30], x[0, 30:65]])[None]  # the third continues the second's state
        got = ours(row, meta=AttentionMetadata.packed([3, 30, 35], prefix=[-1, -1, 1]))[0]
        torch.testing.assert_close(got, torch.cat([alone[1], alone[0]]), atol=1e-4, rtol=0)


def test_packed_equals_padded_and_trainer_logprobs_are_transformers(folder):
    model, ref = twinplane.load_model(folder), reference(folder)
    batch = make_batch(model)
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, 1.0, packed=False)
        packed, _ = response_logprobs(model, batch, 1.0, packed=True)
        shared, _ = response_logprobs(model, batch.select(torch.tensor([0, 0, 1, 1, 2])), 1.0, packed=True,
                                      share_prompts=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared, padded[[0, 0, 1, 1, 2]], rtol=1e-5, atol=1e-5)
    prompts, responses = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13, 14, 15, 16, 17], [18, 19, 20]]
    lp, _ = response_logprobs(model, Batch.collate(prompts, responses, 0), 0.7, packed=True)
    x = torch.tensor([prompts[0] + responses[0]])
    with torch.no_grad():
        want = F.log_softmax(ref(x).logits[0, 4:-1] / 0.7, -1).gather(-1, x[0, 5:, None])[:, 0]
    torch.testing.assert_close(lp[0].detach(), want, atol=1e-5, rtol=0)
    lp.sum().backward()  # through the chunked form's solves and the convolution
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
               and p.grad is not None) and model.model.layers[0].linear_attn.A_log.grad.abs().sum() > 0


@pytest.mark.parametrize("budget, batch_invariant", [(4096, False), (3, False), (4096, True)])
def test_engine_greedy_equals_generate_and_logprobs_the_trainers(budget, batch_invariant, folder):
    """Budget 3: prompts prefilled in chunks, each chunk from the state the one before left; batch_invariant:
    every linear (DeltaNet's projections too) through the prepacked GEMMs."""
    ref = reference(folder)
    engine = RolloutEngine(twinplane.load_model(folder), eos_token_id=EOS, max_num_batched_tokens=budget,
                           batch_invariant=batch_invariant)
    assert engine.prepacked == batch_invariant
    for prompt in PROMPTS:
        got = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12))[0]
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert got.token_ids == want
    sp = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=5)  # forks: the samples share a prompt state
    samples = engine.generate(PROMPTS, sp)
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0)
    with torch.no_grad():
        lp, _ = response_logprobs(twinplane.load_model(folder), batch, 0.8)
    m = batch.response_mask.bool()
    rollout = torch.zeros_like(lp)
    for i, s in enumerate(samples):
        rollout[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(lp[m], rollout[m], atol=2e-5, rtol=0)


def test_preempted_sequences_rebuild_their_state(folder):
    """A pool of three blocks preempts; each preempted sequence is prefilled again from its tokens into a fresh
    state, so the samples are those of an engine that never preempts; every state slot is free afterwards."""
    model = twinplane.load_model(folder)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, n=3, seed=5)
    free = RolloutEngine(copy.deepcopy(model), eos_token_id=None)
    want = free.generate(PROMPTS, sp)
    # three blocks beside the states of the 12 samples (the budget holds both)
    budget = 3 * bytes_per_block(model.config, free.block_size, torch.float32) + \
        12 * int(state_bytes_per_sequence(model.config, 4))
    tight = RolloutEngine(copy.deepcopy(model), eos_token_id=None, kv_cache_bytes=budget, max_num_batched_tokens=8)
    got = tight.generate(PROMPTS, sp)
    assert tight.kv.k.shape[0] == 1 and tight.blocks.num_blocks == 3  # the one attention layer's pool
    assert tight.pop_metrics()["rollout/preemptions"] > 0
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0)
    assert set(tight.states.ref) == {0} and len(tight.states.free) == tight.states.num_slots
    ref = reference(folder)
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    tight = RolloutEngine(copy.deepcopy(model), eos_token_id=None, kv_cache_bytes=budget - 8 * int(
        state_bytes_per_sequence(model.config, 4)), max_num_batched_tokens=8)  # (4 sequences at once)
    got = tight.generate(PROMPTS, greedy)
    assert tight.pop_metrics()["rollout/preemptions"] > 0
    for prompt, s in zip(PROMPTS, got, strict=True):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert s.token_ids == want


def test_static_decode_falls_back_to_eager(folder):
    """The decode-graph path's static buffers do not address the state pool: such models decode eagerly."""
    engine = RolloutEngine(twinplane.load_model(folder), eos_token_id=EOS)
    engine.graph_backend = "static"
    engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=6, seed=3))
    assert engine.pop_metrics()["rollout/engine_steps_graphed"] == 0


@pytest.mark.parametrize("kind", list(CASES))
def test_saved_weights_load_in_transformers(kind, tmp_path):
    ours, back, again = saved_and_reloaded(hf_model(kind), tmp_path, max_shard_bytes=40_000)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == [CASES[kind][1]] and saved["layer_types"] == SIZES["layer_types"]
    x = ids(13)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-4, rtol=0)
        assert torch.equal(again(x), ours(x))
    load_weights(again, [("mtp.fc.weight", torch.zeros(2, 2))], strict=False)  # published MTP weights: skipped


def test_default_layer_kinds_and_refusals():
    from twinplane.model import ModelConfig

    base = dict(model_type="qwen3_next", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=8,
                num_attention_heads=2, head_dim=8, num_experts=0)
    cfg = ModelConfig.from_hf(base)  # transformers' default: every 4th layer attends
    assert cfg.linear_layers == [0, 1, 2, 4, 5, 6] and cfg.partial_rotary_factor == 0.25
    assert ModelConfig.from_hf(cfg.to_hf()).linear_layers == cfg.linear_layers
    assert ModelConfig.from_hf(base | dict(full_attention_interval=2)).linear_layers == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_hf(base | dict(layer_types=["sliding_attention"] * 8))
    with pytest.raises(ValueError, match="not a multiple"):
        ModelConfig.from_hf(base | dict(linear_num_key_heads=3, linear_num_value_heads=4))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_three_step_train_run(kind, tmp_path):
    final = transformers.AutoModelForCausalLM.from_pretrained(three_step_run(tmp_path, partial(hf_model, kind)))
    assert final.config.model_type == kind

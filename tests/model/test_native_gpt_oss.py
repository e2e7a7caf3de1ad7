"""GPT-OSS natively, on a tiny config with every feature that sets it apart turned on (attention sinks, windows
shorter than the sequences on alternating layers, q/k/v/o biases, a YaRN rope, biased router and experts with the
clamped SwiGLU), against transformers: logits, padded and packed log-probs, the rollout engine against `generate`,
routing record/replay, saving, and a short run."""


import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_reference, make_batch, peaked_weights, saved_and_reloaded, three_step_run, token_ids

import twinplane
from twinplane.model import AttentionMetadata, ModelConfig
from twinplane.model.attention import capped_attention
from twinplane.model.impl import choose
from twinplane.model.moe import RoutingState
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.train import Batch
from twinplane.train.logprobs import response_logprobs

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=3,
             pad_token_id=0, sliding_window=4, num_local_experts=6, num_experts_per_tok=2, swiglu_limit=0.9,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 500.0})
EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


def hf_model(seed=0, **over):
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**{**SIZES, **over})
    cfg._attn_implementation = "eager"
    return peaked_weights(transformers.AutoModelForCausalLM.from_config(cfg),
                          special=[("sinks", lambda p: p.normal_(0, 0.5))])  # (and large sinks)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "tiny"
    hf_model().save_pretrained(path)
    return path


def reference(path):
    return hf_reference(path, attn_implementation="eager")


ids = token_ids


def test_logits_and_padded_batch_match_transformers(folder):
    assert choose(folder).impl == "native"
    ours, ref = twinplane.load_model(folder), reference(folder)
    cfg = ours.config
    assert cfg.layer_types == ref.config.layer_types and cfg.sliding_window == 4 and cfg.qkv_bias and cfg.o_bias
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.num_experts == 6
    x = ids(13)
    with torch.no_grad():
        got, want = ours(x), ref(x).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # each feature matters here: without the windows, or without the sinks, the logits would differ
        ours._layer_attention = [(None, *a[1:]) for a in ours._layer_attention]
        assert (ours(x) - want).abs().max() > 1e-2
        ours = twinplane.load_model(folder)
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (ours(x) - want).abs().max() > 1e-2
    ours = twinplane.load_model(folder)
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    with torch.no_grad():
        a = ours(x, attention_mask=mask)
        b = ref(x, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-4, rtol=0)


def test_packed_equals_padded_and_trainer_logprobs(folder):
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
    torch.testing.assert_close(lp[0], want, atol=1e-5, rtol=0)


def test_sinks_leave_fast_backends_and_join_the_softmax():
    meta = AttentionMetadata.packed([5, 9], backend="flex", window=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    view = meta.for_layer(None).with_sinks(sinks)
    assert view.backend == "sdpa" and view.sinks is sinks and view.window is None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 14, 16, generator=g) for h in (4, 2, 2))
    got = capped_attention(q, k, v, None, True, None, None, sinks)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4
    scores = scores.masked_fill(~torch.ones(14, 14, dtype=torch.bool).tril(), -torch.inf)
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    probs = e / (e.sum(-1, keepdim=True) + (sinks[:, None, None] - scores.amax(-1, keepdim=True)).exp())
    torch.testing.assert_close(got, probs @ v.repeat_interleave(2, 1))


@pytest.mark.parametrize("budget, batch_invariant", [(4096, False), (3, False), (4096, True)])
def test_engine_greedy_equals_generate_and_logprobs_the_trainers(folder, budget, batch_invariant):
    ref = reference(folder)
    engine = RolloutEngine(twinplane.load_model(folder), eos_token_id=EOS, max_num_batched_tokens=budget,
                           batch_invariant=batch_invariant)
    for prompt in PROMPTS:  # one request at a time, as `generate` runs it; contexts past the window
        got = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0]
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert got.token_ids == want
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=5))
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0)
    with torch.no_grad():
        lp, _ = response_logprobs(twinplane.load_model(folder), batch, 0.8)
    m = batch.response_mask.bool()
    rollout = torch.zeros_like(lp)
    for i, s in enumerate(samples):
        rollout[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(lp[m], rollout[m], atol=1e-5, rtol=0)


def test_triton_engine_equals_the_torch_engine(folder):
    """kernels=triton (interpreted on the CPU): GPT-OSS's own attention, MoE and layers keep the torch code."""
    pytest.importorskip("triton")
    engines = [RolloutEngine(twinplane.load_model(folder), eos_token_id=EOS, kernels=k) for k in ("triton", "torch")]
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    got, want = (e.generate(PROMPTS[:2], sp) for e in engines)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_routing_record_and_replay(folder):
    from twinplane.config import AlgoSection, TrainSection
    from twinplane.train import Trainer

    model = twinplane.load_model(folder)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, seed=1, record_routing=True)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=8, n=2))
    for s in samples:  # the engine's record is one full forward's routing
        full = RoutingState()
        with torch.no_grad():
            model(torch.tensor([s.prompt_ids + s.token_ids]), routing=full)
        rec = s.routing
        assert rec.shape == (len(s.prompt_ids) + len(s.token_ids), 4, 2) and (rec[-1] == -1).all()
        assert torch.equal(rec[:-1].long().sort(-1).values, full.indices()[:-1].sort(-1).values)
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0,
                          [s.logprobs for s in samples], routing=[s.routing for s in samples])
    batch.advantages = torch.randn(len(batch))[:, None] * batch.response_mask
    m = batch.response_mask.bool()
    for replay in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainSection(micro_batch_size=5), AlgoSection(routing_replay=replay),
                          temperature=0.7, total_steps=1)
        torch.testing.assert_close(trainer.logprobs(batch)[m], batch.rollout_logprobs[m], atol=1e-5, rtol=0)
        assert trainer.train_step(batch)["rollout/routing_agreement"] == 1.0
    # replayed experts run with the softmax of the router's logits at them (the router keeps its gradient)
    moe = model.model.layers[1].mlp
    x = torch.randn(5, 64)
    forced = torch.tensor([[0, 5]] * 5)
    y = moe(x, RoutingState(replay=forced[:, None].expand(5, 4, 2)))
    w = (x @ moe.router.weight.T + moe.router.bias).gather(1, forced).softmax(-1)
    torch.testing.assert_close(y, moe.experts(x, forced, w), atol=1e-6, rtol=0)
    y.sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_saved_weights_load_in_transformers(tmp_path):
    ours, back, again = saved_and_reloaded(hf_model(), tmp_path, max_shard_bytes=40_000)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["GptOssForCausalLM"] and saved["model_type"] == "gpt_oss"
    assert back.config.layer_types == ours.config.layer_types
    assert back.config.rope_parameters["rope_type"] == "yarn" and back.config.swiglu_limit == 0.9
    back.config._attn_implementation = "eager"
    x = ids(13)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-4, rtol=0)
        assert torch.equal(again(x), ours(x))


def test_config_forms_and_refusals():
    base = dict(model_type="gpt_oss", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, head_dim=4, num_local_experts=4, num_experts_per_tok=2)
    cfg = ModelConfig.from_hf(base)  # transformers' defaults: yarn, windows on every other layer, biases
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0 and cfg.qkv_bias
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 128
    again = ModelConfig.from_hf(cfg.to_hf())
    assert (again.rope_scaling, again.rope_theta, again.layer_types) == (cfg.rope_scaling, cfg.rope_theta,
                                                                         cfg.layer_types)
    with pytest.raises(ValueError, match="gptq"):
        ModelConfig.from_hf(base | dict(quantization_config={"quant_method": "gptq"}))
    assert "quantization_config" not in ModelConfig.from_hf(base | dict(quantization_config={
        "quant_method": "mxfp4"})).to_hf()  # (saved weights are plain)
    with pytest.raises(ValueError, match="attention_dropout"):
        ModelConfig.from_hf(base | dict(attention_dropout=0.1))


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [E, C, R] as an MXFP4 checkpoint holds it: blocks [E, R, C / 32, 16], scales [E, R, C / 32]."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = w.transpose(1, 2).unflatten(-1, (-1, 32))  # [E, R, G, 32]
    exp = torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 6))
    y = x / torch.exp2(exp)
    codes = (y.abs()[..., None] - values).abs().argmin(-1) + 8 * (y < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp[..., 0] + 127).to(torch.uint8)


def test_mxfp4_checkpoint_is_dequantized_on_load(tmp_path):
    """The experts of an MXFP4 checkpoint load as transformers dequantizes them (`convert_moe_packed_tensors`), and
    the model then gives transformers' logits with those weights; what twinplane saves is plain."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = hf_model()
    ref.save_pretrained(tmp_path / "plain")
    state = load_file(tmp_path / "plain" / "model.safetensors")
    for name in [n for n in state if n.endswith(("gate_up_proj", "down_proj"))]:
        w = state.pop(name)
        blocks, scales = mxfp4(w)
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        plain = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert (plain - w).norm() < 0.2 * w.norm()  # (the test's quantizer is MXFP4)
        with torch.no_grad():  # the reference: transformers' own dequantization of the same bytes
            ref.get_parameter(name).copy_(plain)
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((tmp_path / "plain" / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(hf))
    assert choose(folder).impl == "native"
    ours = twinplane.load_model(folder)
    x = ids(13)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)
    twinplane.save_pretrained(ours, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    back = reference(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref(x).logits, atol=1e-4, rtol=0)
    del state["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj has _blocks or _scales but not both"):
        twinplane.load_model(folder)


@pytest.mark.slow
def test_three_step_train_run(tmp_path):
    final = transformers.AutoModelForCausalLM.from_pretrained(three_step_run(tmp_path, hf_model))
    assert final.config.model_type == "gpt_oss"


def test_doctor_says_which_layers_take_the_portable_path(folder, tmp_path):
    from twinplane.model.impl import describe

    lines = describe(folder)
    assert ("portable path: attention sinks: no flash/flex kernel adds them to the softmax (the Triton paged decode "
            "does)") in lines
    assert any(line.startswith("portable path: gpt_oss's own blocks") for line in lines)
    llama = tmp_path / "llama"
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4)
    transformers.LlamaForCausalLM(cfg).save_pretrained(llama)
    assert not [line for line in describe(llama) if line.startswith("portable path")]  # every fast path applies

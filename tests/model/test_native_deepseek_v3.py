"""DeepSeek-V3 natively: latent attention (q through its own latent or not, interleaved rope, YaRN with its
softmax mscale, v_head_dim != q/k width) and DeepSeek's MoE (sigmoid group-limited routing with the correction bias,
scaled weights, shared experts, dense first layers) against transformers' logits; padded and packed log-probs; the
engine over the compressed KV pool against `generate`; routing record and replay; saving; memory; a short run."""

import copy
import json
from functools import partial

import pytest
import torch
from conftest import hf_reference, make_batch, peaked_weights, saved_and_reloaded, three_step_run, token_ids

import twinplane
from twinplane.config import AlgoSection, TrainSection
from twinplane.model import ModelConfig
from twinplane.model.impl import choose
from twinplane.model.memory import kv_bytes_per_token
from twinplane.model.moe import RoutingState
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.kv_cache import KVCache, bytes_per_block
from twinplane.train import Batch, Trainer
from twinplane.train.logprobs import response_logprobs

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=3, pad_token_id=0)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
FEATURES = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=10, v_head_dim=12,
                n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, n_shared_experts=1, n_group=4,
                topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                rope_parameters=YARN)  # rope_interleave: transformers' default (True)
CASES = {"q_latent": {}, "q_plain": dict(q_lora_rank=None, attention_bias=True, v_head_dim=20)}
EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


def hf_model(kind, seed=0, **over):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{**SIZES, **FEATURES, **CASES[kind], **over})
    m = peaked_weights(transformers.DeepseekV3ForCausalLM(cfg), norm_offset=1.0)
    with torch.no_grad():  # random score corrections
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return m


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    for kind in CASES:
        hf_model(kind).save_pretrained(root / kind)
    return {kind: root / kind for kind in CASES}


reference, ids = hf_reference, token_ids


@pytest.mark.parametrize("kind", list(CASES))
def test_logits_and_padded_batch_match_transformers(kind, folders):
    assert choose(folders[kind]).impl == "native"
    ours, ref = twinplane.load_model(folders[kind]), reference(folders[kind])
    assert ours.config.is_moe_layer(1) and not ours.config.is_moe_layer(0)
    x = ids(80)  # past the pretraining length YaRN extends
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)
    x = ids(11)
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    with torch.no_grad():
        a = ours(x, attention_mask=mask)
        b = ref(x, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", list(CASES))
def test_packed_equals_padded(kind, folders):
    model = twinplane.load_model(folders[kind])
    batch = make_batch(model)
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, 1.0, packed=False)
        packed, _ = response_logprobs(model, batch, 1.0, packed=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("mode", ["eager", "static", "batch_invariant"])  # static: the decode-graph path, uncaptured
def test_engine_greedy_equals_generate_and_logprobs_the_trainers(kind, mode, folders):
    ref = reference(folders[kind])
    engine = RolloutEngine(twinplane.load_model(folders[kind]), eos_token_id=EOS,
                           batch_invariant=mode == "batch_invariant")
    if mode == "static":
        engine.graph_backend = "static"
    assert engine.backend == "sdpa" and engine.prepacked == (mode == "batch_invariant")
    for prompt in PROMPTS:
        got = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12))[0]
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert got.token_ids == want
    # the pool holds the compressed latent + rope key, one copy per token and layer
    cfg = engine.model.config
    assert engine.kv.v is engine.kv.k and engine.kv.k.shape[-2:] == (1, 16 + 8)
    sp = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=5)
    samples = engine.generate(PROMPTS, sp)  # sampled together: prefill chunks and decodes in one row
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0)
    with torch.no_grad():
        lp, _ = response_logprobs(twinplane.load_model(folders[kind]), batch, 0.8)
    m = batch.response_mask.bool()
    rollout = torch.zeros_like(lp)
    for i, s in enumerate(samples):
        rollout[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(lp[m], rollout[m], atol=1e-5, rtol=0)
    assert cfg.kv_layout == (1, 1, 24)


def test_routing_record_and_replay(folders):
    model = twinplane.load_model(folders["q_latent"])
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, seed=1, record_routing=True)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=8, n=2))
    for s in samples:  # the engine's record is one full forward's routing
        full = RoutingState()
        with torch.no_grad():
            model(torch.tensor([s.prompt_ids + s.token_ids]), routing=full)
        rec = s.routing
        assert rec.shape == (len(s.prompt_ids) + len(s.token_ids), 2, 3) and (rec[-1] == -1).all()
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


def test_replayed_experts_run_with_the_routers_weights(folders):
    """Replay replaces the chosen experts; their weights are the router's (uncorrected) scores at them."""
    model = twinplane.load_model(folders["q_latent"])
    moe = model.model.layers[1].mlp
    x = torch.randn(5, 64)
    forced = torch.tensor([[0, 5, 7]] * 5)
    with torch.no_grad():
        y = moe(x, RoutingState(replay=forced[:, None].expand(5, 2, 3)))
        scores = torch.sigmoid(x @ moe.gate.weight.T).gather(1, forced)
        w = scores / scores.sum(-1, keepdim=True) * 2.5
        want = moe.experts(x, forced, w) + moe.shared_experts(x)
    torch.testing.assert_close(y, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", list(CASES))
def test_saved_weights_load_in_transformers(kind, tmp_path):
    ours, back, again = saved_and_reloaded(hf_model(kind), tmp_path, max_shard_bytes=40_000)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["DeepseekV3ForCausalLM"] and saved["model_type"] == "deepseek_v3"
    x = ids(70)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-4, rtol=0)
        assert torch.equal(again(x), ours(x))


def with_mtp_layer(src, dst):
    """`src` (a 3-layer folder) with a multi-token-prediction layer as DeepSeek-V3 publishes it: a decoder layer's
    tensors plus its own norms, projection, head and embedding as `model.layers.3.*`, in a shard of its own."""
    from safetensors.torch import load_file, save_file

    big = hf_model("q_latent", seed=1, num_hidden_layers=4)
    big.save_pretrained(dst / "big")
    extra = {n: t for n, t in load_file(dst / "big" / "model.safetensors").items() if n.startswith("model.layers.3.")}
    D, V = SIZES["hidden_size"], SIZES["vocab_size"]
    extra |= {"model.layers.3.enorm.weight": torch.ones(D), "model.layers.3.hnorm.weight": torch.ones(D),
              "model.layers.3.eh_proj.weight": torch.randn(D, 2 * D), "model.layers.3.embed_tokens.weight":
              torch.randn(V, D), "model.layers.3.shared_head.norm.weight": torch.ones(D),
              "model.layers.3.shared_head.head.weight": torch.randn(V, D)}
    out = dst / "mtp"
    out.mkdir()
    main = load_file(src / "model.safetensors")
    save_file(main, out / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(extra, out / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {n: "model-00001-of-00002.safetensors" for n in main} | {n: "model-00002-of-00002.safetensors"
                                                                     for n in extra}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return out, json.loads((src / "config.json").read_text())


def test_mtp_layers_are_skipped_as_transformers_skips_them(folders, tmp_path):
    from twinplane.model.impl import describe

    folder, config = with_mtp_layer(folders["q_latent"], tmp_path)
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    ours, ref = twinplane.load_model(folder), reference(folder)
    x = ids(20)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-4, rtol=0)
    assert any("1 MTP layer(s) (model.layers.3.*) are skipped on load, not trained and not saved" in line
               for line in describe(folder))
    twinplane.save_pretrained(ours, tmp_path / "saved")  # the MTP layer is not saved, and the config says so
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    torch.testing.assert_close(twinplane.load_model(tmp_path / "saved")(x), ours(x), atol=0, rtol=0)
    # without the config's count, or past it, the layer is a tensor the model lacks: refused, naming it
    for count in (None, 0):
        (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": count}))
        with pytest.raises(KeyError, match=r"'model\.layers\.3\..*' has no parameter in deepseek_v3"):
            twinplane.load_model(folder)
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be an integer >= 0, got '1'"):
        ModelConfig.from_hf(config | {"num_nextn_predict_layers": "1"})


def test_memory_counts_the_compressed_pool_and_every_parameter(folders):
    model = twinplane.load_model(folders["q_latent"])
    cfg = model.config
    assert cfg.num_params == sum(p.numel() for p in model.parameters())
    assert kv_bytes_per_token(cfg, 2) == 3 * (16 + 8) * 2  # layers x (latent + rope key) x bf16, keys = values
    assert kv_bytes_per_token(cfg, 2, tp=4) == kv_bytes_per_token(cfg, 2)  # every TP rank holds the latent
    pool = KVCache(cfg, num_blocks=5, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    assert pool.nbytes == bytes_per_block(cfg, 16, torch.float32) * 5 == pool.k.numel() * 4


def test_refusals():
    base = {**SIZES, **FEATURES, "model_type": "deepseek_v3"}
    cfg = ModelConfig.from_hf(base)
    assert cfg.head_dim == 8 and cfg.rope_interleave and cfg.moe_layers == [1, 2]
    for bad, match in ((dict(num_key_value_heads=2), "a key and a value per head"),
                       (dict(moe_layer_freq=2), "moe_layer_freq=2 turns on experts on every"),
                       (dict(scoring_func="softmax"), "router scores other than sigmoid"),
                       (dict(n_group=3), "n_group=3 must divide")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf(base | bad)


@pytest.mark.slow
def test_three_step_train_run(tmp_path):
    three_step_run(tmp_path, partial(hf_model, "q_latent"), "algo.routing_replay=true", "rollout.record_routing=true")

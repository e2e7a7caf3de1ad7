"""OLMo-2/3, GLM, GLM-4 and Phi-3 natively: each on a tiny config with every feature that sets it apart turned on
(post-norms, whole-projection q/k norms, OLMo-3's sliding layers with their own rope beside yarn-scaled full
layers, partial and interleaved rope, fused projections, longrope) against
transformers' logits, padded and packed log-probs, the rollout engine against `generate`, saving, and a short run."""

import json
from functools import partial

import pytest
import torch
from conftest import hf_reference, make_batch, peaked_weights, saved_and_reloaded, three_step_run, token_ids

import twinplane
from twinplane.config import ConfigError, load_config
from twinplane.model.impl import choose
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.run import preflight
from twinplane.train import Batch
from twinplane.train.critic import build_value_model
from twinplane.train.logprobs import packed_layout, response_logprobs

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=3, pad_token_id=0)
LONG = 16  # Phi-3's pretraining length here: sequences past it take the long factors
CASES = {  # model type -> (config class, its distinguishing options)
    "olmo2": ("Olmo2Config", dict(attention_bias=True, rms_norm_eps=1e-5)),
    "olmo3": ("Olmo3Config", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                   "full_attention": {"rope_type": "yarn", "rope_theta": 5e5,
                                                                      "factor": 4.0,
                                                                      "original_max_position_embeddings": 16}})),
    "glm": ("GlmConfig", dict(attention_bias=True, partial_rotary_factor=0.5, head_dim=24)),
    "glm4": ("Glm4Config", dict(attention_bias=True, partial_rotary_factor=0.5, head_dim=24)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, original_max_position_embeddings=LONG, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 4 for i in range(6)],
        "long_factor": [2.0 + i for i in range(6)]})),
}
EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


def hf_model(kind, seed=0, **over):
    cls, extra = CASES[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls)(**{**SIZES, **extra, **over})
    return peaked_weights(transformers.AutoModelForCausalLM.from_config(cfg), norm_offset=1.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
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
    for t in (11, LONG + 5):  # (Phi-3: within and past the pretraining length)
        x = ids(t)
        with torch.no_grad():
            gap = (ours(x) - ref(x).logits).abs().max().item()
        assert gap < 1e-4, (t, gap)
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
@pytest.mark.parametrize("batch_invariant", [False, True])  # True: every GEMM prepacked (oneDNN)
def test_engine_greedy_equals_generate_and_logprobs_the_trainers(kind, batch_invariant, folders):
    ref = reference(folders[kind])
    engine = RolloutEngine(twinplane.load_model(folders[kind]), eos_token_id=EOS, batch_invariant=batch_invariant)
    assert engine.prepacked == batch_invariant
    got = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=9))  # (Phi-3: up to LONG tokens)
    for prompt, s in zip(PROMPTS, got, strict=True):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert s.token_ids == want
    # sampled: the engine's log-probs are the trainer's
    sp = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=5)
    samples = engine.generate(PROMPTS, sp)
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0)
    with torch.no_grad():
        lp, _ = response_logprobs(twinplane.load_model(folders[kind]), batch, 0.8)
    m = batch.response_mask.bool()
    rollout = torch.zeros_like(lp)
    for i, s in enumerate(samples):
        rollout[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
    torch.testing.assert_close(lp[m], rollout[m], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["eager", "static", "chunked"])
def test_longrope_engine_crosses_the_pretraining_length_as_generate(mode, folders):
    """Past it transformers' `generate` re-encodes the whole sequence with the long factors; the engine recomputes
    the sequence's k/v there (decodes eager or from the graph path's static buffers; prompts past the limit
    prefilled in chunks), and gives the same greedy tokens."""
    ref = reference(folders["phi3"])
    kw = {"max_num_batched_tokens": 8} if mode == "chunked" else {}
    engine = RolloutEngine(twinplane.load_model(folders["phi3"]), eos_token_id=EOS, **kw)
    engine.graph_backend = "static" if mode == "static" else engine.graph_backend
    prompts = [*PROMPTS, list(range(20, 20 + LONG + 2))]  # (the last one is past the limit from the start)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20))
    for prompt, s in zip(prompts, got, strict=True):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert s.token_ids == want
    assert max(len(s.prompt_ids) + len(s.token_ids) for s in got[:len(PROMPTS)]) > LONG + 1  # (some crossed)
    assert (engine.pop_stats().graph_steps > 10) == (mode == "static")


def test_longrope_trainer_logprobs_across_the_limit_are_the_engines(folders):
    """Sampled sequences crossing the limit: the trainer's log-probs (packed, padded, shared prompts) equal the
    engine's, and transformers' for each token from its prefix alone (short factors up to the limit, long past)."""
    model = twinplane.load_model(folders["phi3"])
    engine = RolloutEngine(twinplane.load_model(folders["phi3"]), eos_token_id=EOS)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=20, n=2, seed=3))
    assert any(len(s.prompt_ids) + len(s.token_ids) > LONG + 1 for s in samples)
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0)
    m = batch.response_mask.bool()
    rollout = torch.zeros(m.shape)
    for i, s in enumerate(samples):
        rollout[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
    with torch.no_grad():
        for kw in (dict(packed=True), dict(packed=False), dict(packed=True, share_prompts=True),
                   dict(packed=True, layout=packed_layout(batch, share_prompts=True))):  # (as the trainer passes it)
            lp, _ = response_logprobs(model, batch, 0.8, **kw)
            torch.testing.assert_close(lp[m], rollout[m], atol=1e-5, rtol=0)
        ref = reference(folders["phi3"])
        for s in samples[:4]:
            seq = s.prompt_ids + s.token_ids
            want = [torch.log_softmax(ref(torch.tensor([seq[:t]])).logits[0, -1] / 0.8, -1)[seq[t]].item()
                    for t in range(len(s.prompt_ids), len(seq))]
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want), atol=1e-5, rtol=0)


def test_longrope_values_of_a_row_do_not_depend_on_its_batch(folders):
    """PPO's value model takes each row's factor set as that sequence alone would, not the batch's longest."""
    critic = build_value_model(twinplane.load_model(folders["phi3"]).config,
                               twinplane.load_model(folders["phi3"]).named_parameters(), torch.device("cpu"),
                               torch.float32)
    with torch.no_grad():
        critic.score.weight.normal_()
        x, mask = ids(LONG + 4, batch=2), torch.ones(2, LONG + 4, dtype=torch.long)
        mask[0, 10:] = 0  # a short row beside one past the limit
        both, alone = critic(x, mask), critic(x[:1, :10])
        torch.testing.assert_close(both[0, :10], alone[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(both[1], critic(x[1:])[0], atol=1e-5, rtol=0)


def test_longrope_runs_past_the_limit_only_where_both_planes_follow_it(folders):
    """vLLM, transformers' own forward and the routing record take one factor set per engine, batch or record:
    a run whose sequences can pass the limit is refused with them, in one line; within it, accepted."""
    mc = preflight.model_config(str(folders["phi3"]))
    past = ["data.max_prompt_tokens=10", "rollout.max_new_tokens=8"]  # 18 > LONG
    preflight.check_rope_limits(load_config(None, past), mc)  # (the native planes)
    for key in ("rollout.backend=vllm", "rollout.record_routing=true"):
        with pytest.raises(ConfigError, match=f"^{key.removesuffix('=true')}: .*=16; .* = 18$"):
            preflight.check_rope_limits(load_config(None, [*past, key]), mc)
        within = ["data.max_prompt_tokens=8", "rollout.max_new_tokens=8", key]
        preflight.check_rope_limits(load_config(None, within), mc)
    hf = preflight.model_config(str(folders["phi3"]), "hf")
    assert hf.longrope_limit == LONG
    with pytest.raises(ConfigError, match="^model.impl=hf: transformers' forward picks one set per batch"):
        preflight.check_rope_limits(load_config(None, past), hf)


@pytest.mark.parametrize("kind", list(CASES))
def test_saved_weights_load_in_transformers(kind, tmp_path):
    ours, back, again = saved_and_reloaded(hf_model(kind), tmp_path, max_shard_bytes=40_000)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == [type(back).__name__] and saved["model_type"] == kind
    x = ids(LONG + 5)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-4, rtol=0)
        assert torch.equal(again(x), ours(x))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_three_step_train_run(kind, tmp_path):
    long = dict(original_max_position_embeddings=6) if kind == "phi3" else {}  # (rollouts cross it)
    final = transformers.AutoModelForCausalLM.from_pretrained(three_step_run(tmp_path, partial(hf_model, kind,
                                                                                               **long)))
    assert final.config.model_type == kind

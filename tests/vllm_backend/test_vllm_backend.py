"""The vLLM rollout backend against the own engine and the trainer's scoring, on a tiny random Llama (CPU wheel).

Skipped where vLLM is not importable (its own environment: see docs/vllm.md)."""

import copy

import pytest
import torch

pytest.importorskip("vllm")

from twinplane.model import ModelConfig, Transformer  # noqa: E402
from twinplane.model.checksum import weights_checksum  # noqa: E402
from twinplane.rollout import MultiTurnRollout, RolloutEngine, SamplingParams  # noqa: E402
from twinplane.rollout.vllm_backend import VllmEngine, logprobs_mode, request_params, stop_at  # noqa: E402
from twinplane.tokenizer import build_char_tokenizer  # noqa: E402

EOS = 95
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


def random_llama(seed: int = 0, tied: bool = True) -> Transformer:
    """Head size 32 (vLLM's CPU attention takes multiples of 32); weights wide enough (std 0.3) that greedy
    decoding does not collapse onto one token."""
    cfg = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def engines():
    model = random_llama()
    vllm = VllmEngine(copy.deepcopy(model), EOS, seed=0)
    return model, vllm, RolloutEngine(copy.deepcopy(model), EOS)


def scored(model: Transformer, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log pi(token) [T]: log softmax(logits / T) of one full forward (T = 1 when greedy)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_sampling_params_map_exactly():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=20, min_new_tokens=3, n=4,
                        stop_token_ids=[7, 9], stop_sequences=[[11], [12, 13]])
    p = request_params(sp, seed=2**64 - 5, cap=11, stop_ids=[EOS])
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_tokens, p.max_tokens) == (1, 0.7, 0.9, 5, 3, 11)
    assert sorted(p.stop_token_ids) == [7, 9, 11, EOS]  # one-token stop sequences are stop tokens
    assert p.seed == (2**64 - 5) % 2**63 and p.logprobs == 0 and not p.detokenize
    assert request_params(sp, 0, cap=2, stop_ids=[]).min_tokens == 2  # a cap below min_new_tokens wins
    assert request_params(SamplingParams(), 0, cap=4, stop_ids=[]).top_k in (0, -1)  # off
    assert logprobs_mode(1.0) == logprobs_mode(0.0) == "raw_logprobs" and logprobs_mode(0.7) == "processed_logprobs"


def test_stop_sequences_end_where_the_own_engine_ends():
    sp = SamplingParams(stop_sequences=[[3, 4], [9]], min_new_tokens=2)
    assert stop_at([3, 4, 1, 3, 4, 5], sp) == 5  # [3, 4] at index 0..1 ends before min_new_tokens: the next one
    assert stop_at([1, 9, 2, 9], sp) == 4
    assert stop_at([1, 2, 3], sp) is None


def test_greedy_equals_the_own_engine(engines):
    model, vllm, own = engines
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    a, b = own.generate(PROMPTS, sp), vllm.generate(PROMPTS, sp)
    assert [s.token_ids for s in b] == [s.token_ids for s in a]
    assert [s.finish_reason for s in b] == [s.finish_reason for s in a]
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-4)


def test_sampled_logprobs_are_the_trainers(engines):
    model, vllm, _ = engines
    samples = vllm.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=1))
    assert [s.request_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({tuple(s.token_ids) for s in samples}) > 3  # samples of one prompt differ
    for s in samples:
        want = scored(model, s.prompt_ids, s.token_ids, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)


def test_seeds_caps_and_stops(engines):
    _, vllm, own = engines
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3, stop_token_ids=list(range(40, 80)),
                        min_new_tokens=4)
    a, b = vllm.generate(PROMPTS, sp), vllm.generate(PROMPTS, sp)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]  # seeded
    stops = set(range(40, 80)) | {EOS}
    for s in a:
        assert not stops & set(s.token_ids[:4])  # stop tokens suppressed before min_new_tokens
        assert s.finish_reason == "length" or (s.finish_reason == "stop" and s.token_ids[-1] in stops)
    capped = vllm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12), max_new_tokens=[2, 5, 12])
    assert [len(s.token_ids) for s in capped] == [2, 5, 12]
    assert [s.finish_reason for s in capped[:2]] == ["length", "length"]
    greedy = own.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    seq = greedy[0].token_ids[3:5]  # a two-token stop sequence the greedy output contains
    sp = SamplingParams(temperature=0, max_new_tokens=12, stop_sequences=[seq])
    a, b = own.generate(PROMPTS, sp), vllm.generate(PROMPTS, sp)
    assert [(s.token_ids, s.finish_reason) for s in b] == [(s.token_ids, s.finish_reason) for s in a]
    assert b[0].token_ids[-2:] == seq and b[0].finish_reason == "stop"


def test_multi_turn_driver_over_vllm(engines):
    """The tool driver over vLLM (its call end a stop sequence of many tokens, token ids in and out) returns what it
    returns over the own engine."""
    _, vllm, own = engines
    tok = build_char_tokenizer("0123456789+-*/=|<>{}[]():,\"_ abcdefghijklmnopqrstuvwxyz")
    sp = SamplingParams(temperature=0, max_new_tokens=24)
    rolls = [MultiTurnRollout(e, tok, {}, max_turns=3).generate(PROMPTS, sp) for e in (own, vllm)]
    assert [(s.token_ids, s.loss_mask, s.finish_reason) for s in rolls[1]] == \
        [(s.token_ids, s.loss_mask, s.finish_reason) for s in rolls[0]]


def test_weight_sync_changes_outputs_and_checksums_match(engines):
    model, vllm, own = engines
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    before = [s.token_ids for s in vllm.generate(PROMPTS, sp)]
    new = random_llama(seed=1)
    sent = list(new.named_parameters())
    assert vllm.load_weights(sent, version=7) == weights_checksum(sent) == vllm.checksum()
    own.load_weights(sent, version=7)
    a, b = own.generate(PROMPTS, sp), vllm.generate(PROMPTS, sp)
    assert [s.token_ids for s in b] != before
    assert [s.token_ids for s in b] == [s.token_ids for s in a] and {s.weight_version for s in b} == {7}
    for s in vllm.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=0)):
        assert torch.allclose(torch.tensor(s.logprobs), scored(new, s.prompt_ids, s.token_ids, 1.0), atol=1e-4)
    damaged = [(n, t.clone() if i else t + 1e-3) for i, (n, t) in enumerate(sent)]
    assert vllm.load_weights(damaged) != weights_checksum(sent)  # the engine's checksum sees what it loaded


def test_sleep_and_wake_keep_the_weights(engines):
    """vLLM's CPU build ignores sleep mode (it frees GPU memory only): the engine still answers the same."""
    _, vllm, _ = engines
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    before = [s.token_ids for s in vllm.generate(PROMPTS, sp)]
    vllm.sleep()
    vllm.wake_up()
    assert [s.token_ids for s in vllm.generate(PROMPTS, sp)] == before


def test_samples_do_not_depend_on_batching(engines):
    """Seeded samples from an engine running 3 sequences at a time with a 128-token step budget (prompts queued,
    never split) equal those of the engine running all at once."""
    model, vllm, _ = engines
    vllm.load_weights(list(model.named_parameters()))  # (an earlier test synced other weights)
    small = VllmEngine(copy.deepcopy(model), EOS, seed=0, max_num_seqs=3, max_num_batched_tokens=16)
    prompts = [list(range(1 + i, 40 + i)) for i in range(8)]  # 8 x 39 tokens x 4 samples: many steps' worth
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, n=4, seed=11)
    assert [s.token_ids for s in small.generate(prompts, sp)] == [s.token_ids for s in vllm.generate(prompts, sp)]


def test_untied_head_and_another_temperature():
    """An untied LM head syncs by its own name; at T = 0.7 vLLM reports log softmax(logits / 0.7)."""
    model = random_llama(seed=2, tied=False)
    vllm = VllmEngine(copy.deepcopy(model), EOS, seed=0, temperature=0.7)
    new = random_llama(seed=3, tied=False)
    assert vllm.load_weights(list(new.named_parameters())) == weights_checksum(new.named_parameters())
    for s in vllm.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=0)):
        assert torch.allclose(torch.tensor(s.logprobs), scored(new, s.prompt_ids, s.token_ids, 0.7), atol=1e-4)


def test_longrope_within_its_limit_takes_the_short_factors(tmp_path):
    """vLLM rotates every token by longrope's long factors when its max_model_len passes the pretraining length,
    which it serves longrope models at: there, as the trainer, it takes the short ones (runs whose sequences pass
    it are refused, `preflight.check_rope_limits`)."""
    import transformers

    from twinplane.model import load_model

    cfg = transformers.Phi3Config(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                         "long_factor": [4.0 + i for i in range(16)]},
        bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path).eval()
    assert model.longrope_limit == 32
    vllm = VllmEngine(copy.deepcopy(model), EOS, seed=0)
    assert vllm.llm.llm_engine.model_config.max_model_len == 32
    for s in vllm.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=1)):
        assert torch.allclose(torch.tensor(s.logprobs), scored(model, s.prompt_ids, s.token_ids, 1.0), atol=1e-4)

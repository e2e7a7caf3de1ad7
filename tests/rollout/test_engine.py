"""The rollout engine against full recomputation, and its log-probs against the trainer's."""

import copy

import pytest
import torch
from conftest import EOS, PROMPTS, greedy_no_cache, tiny_model

from twinplane.config import AlgoSection, TrainSection
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.train import Batch, Trainer


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True, "num_kv_heads": 4},
                                  {"model_type": "qwen3", "qk_norm": True}, {"sliding_window": 4}])
def test_greedy_equals_full_recompute(over):
    model = tiny_model(**over)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    assert [s.request_index for s in samples] == [0, 1, 2, 3]
    for s, p in zip(samples, PROMPTS, strict=False):
        want = greedy_no_cache(model, p, 12)
        assert s.token_ids == want
        assert s.finish_reason == ("stop" if want[-1] == EOS else "length")


def test_engine_logprobs_equal_trainer_recompute():
    model = tiny_model()
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, seed=1)
    sp = SamplingParams(temperature=0.7, max_new_tokens=10, n=3)
    samples = engine.generate(PROMPTS, sp)
    assert len(samples) == 12 and {len(s.token_ids) for s in samples} != {10}  # some stopped early
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0,
                          [s.logprobs for s in samples])
    trainer = Trainer(model, TrainSection(micro_batch_size=5), AlgoSection(), temperature=0.7, total_steps=1)
    lp = trainer.logprobs(batch)
    m = batch.response_mask.bool()
    torch.testing.assert_close(lp[m], batch.rollout_logprobs[m], atol=1e-5, rtol=0)


def test_sampling_controls():
    model = tiny_model()
    engine = RolloutEngine(model, eos_token_id=EOS)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_new_tokens=8))
    tiny_p = engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=8))
    assert [s.token_ids for s in top1] == [s.token_ids for s in greedy] == [s.token_ids for s in tiny_p]
    # seeded sampling is reproducible; n samples of one prompt differ
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=7)
    a, b = engine.generate(PROMPTS, sp), engine.generate(PROMPTS, sp)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert len({tuple(s.token_ids) for s in a[:4]}) > 1
    # min_new_tokens bans EOS; stop_token_ids stop
    forced = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, min_new_tokens=6, seed=1))
    assert all(len(s.token_ids) == 6 and s.finish_reason == "length" for s in forced)
    first = greedy[0].token_ids[0]
    stopped = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[first]))
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == "stop"


def test_top_k_restricts_support():
    model = tiny_model()
    engine = RolloutEngine(model, eos_token_id=None)
    with torch.no_grad():
        top2 = model(torch.tensor([PROMPTS[0]]))[0, -1].topk(2).indices.tolist()
    samples = engine.generate(PROMPTS[:1], SamplingParams(temperature=2.0, top_k=2, max_new_tokens=1, n=64, seed=0))
    assert {s.token_ids[0] for s in samples} == set(top2)


def test_weight_sync_and_checksum():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    engine = RolloutEngine(copy.deepcopy(a), eos_token_id=EOS)
    before = engine.checksum()
    engine.load_weights(b.named_parameters(), version=5)
    assert engine.checksum() != before and engine.weight_version == 5
    from twinplane.model.checksum import weights_checksum

    assert engine.checksum() == weights_checksum(b.named_parameters())
    s = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=3))[0]
    assert s.weight_version == 5 and s.token_ids == greedy_no_cache(b, PROMPTS[0], 3)


def test_in_process_sync_compares_bitwise_and_catches_a_bad_copy(monkeypatch):
    from twinplane.cluster import LocalPlanes
    from twinplane.cluster.sync import bitwise_equal, sync_in_process
    from twinplane.controller import Controller, WeightSyncError

    policy = tiny_model(seed=1)
    trainer = Trainer(policy, TrainSection(), AlgoSection(), temperature=1.0, total_steps=1)
    engine = RolloutEngine(tiny_model(seed=0), eos_token_id=EOS)
    report = sync_in_process(engine, trainer, version=1)
    assert report.mismatched() == [] and report.compared == {"engine 0": True} and engine.weight_version == 1
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), policy.parameters(), strict=True))
    t = torch.randn(100)
    flipped = t.clone()
    flipped.view(torch.int32)[7] ^= 1  # one low mantissa bit
    assert bitwise_equal(t, t.clone()) and not bitwise_equal(t, flipped)
    assert not bitwise_equal(torch.zeros(2), -torch.zeros(2))  # equal values, different bits
    # A copy that misses one tensor (a bug in loading) is caught, and the controller refuses to go on.
    load = engine.load_weights
    monkeypatch.setattr(engine, "load_weights", lambda named, version, strict: load(
        [(n, t) for n, t in named if not n.endswith("down_proj.weight")], version, strict=False))
    with torch.no_grad():
        policy.model.layers[0].mlp.down_proj.weight.add_(1.0)
    assert sync_in_process(engine, trainer, version=2).mismatched() == ["engine 0"]
    controller = Controller(LocalPlanes(engine, trainer), None, None, SamplingParams(n=2))
    with pytest.raises(WeightSyncError, match="differ bitwise"):
        controller.sync_weights()


def test_checksum_detects_small_changes():
    from twinplane.model.checksum import tensor_checksum, weights_checksum

    t = torch.randn(3_000_000)  # spans several chunks
    base = tensor_checksum(t)
    flipped = t.clone()
    flipped.view(torch.int32)[2_500_000] ^= 1  # one low mantissa bit
    swapped = t.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert base == tensor_checksum(t.clone())
    assert base != tensor_checksum(flipped) and base != tensor_checksum(swapped)
    named = [("a", t), ("b", t[:5])]
    assert weights_checksum(named) != weights_checksum([("a", t), ("c", t[:5])])  # names count
    assert weights_checksum(named, dtype=torch.bfloat16) == weights_checksum([(n, x.bfloat16()) for n, x in named])

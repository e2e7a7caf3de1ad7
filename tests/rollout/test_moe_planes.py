"""MoE in both planes: the engine against full recompute, its routing record, and replay in the trainer."""

import copy

import pytest
import torch
from conftest import tiny_moe

from twinplane.config import AlgoSection, TrainSection
from twinplane.model.moe import RoutingState
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.train import Batch, Trainer

EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


@pytest.mark.parametrize("over", [{}, {"model_type": "qwen2_moe", "qk_norm": False, "qkv_bias": True,
                                       "shared_expert_intermediate_size": 48, "norm_topk_prob": False}])
def test_greedy_equals_full_recompute_and_routing_is_recorded(over):
    model = tiny_moe(**over)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, record_routing=True)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    for s, p in zip(samples, PROMPTS, strict=True):
        ids, out = list(p), []
        with torch.no_grad():
            for _ in range(8):
                tok = int(model(torch.tensor([ids]))[0, -1].argmax())
                out.append(tok)
                ids.append(tok)
                if tok == EOS:
                    break
        assert s.token_ids == out
        full = RoutingState()  # the routing of one full forward over prompt + response
        with torch.no_grad():
            model(torch.tensor([ids]), routing=full)
        rec = s.routing
        assert rec.dtype == torch.int16 and rec.shape == (len(ids), 2, 2)
        assert (rec[-1] == -1).all()  # the last sampled token never ran through the engine
        torch.testing.assert_close(rec[:-1].long().sort(-1).values, full.indices()[:-1].sort(-1).values, atol=0,
                                   rtol=0)


def sampled_batch(model, dtype, temperature=1.0):
    engine = RolloutEngine(copy.deepcopy(model).to(dtype), eos_token_id=EOS, seed=1, record_routing=True)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=10, n=3))
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0,
                          [s.logprobs for s in samples], routing=[s.routing for s in samples])
    batch.advantages = torch.randn(len(batch))[:, None] * batch.response_mask
    return batch


def step_metrics(model, batch, replay, temperature=1.0):
    trainer = Trainer(copy.deepcopy(model), TrainSection(micro_batch_size=5), AlgoSection(routing_replay=replay),
                      temperature=temperature, total_steps=1)
    return trainer.logprobs(batch), trainer.train_step(batch)


def test_engine_logprobs_equal_trainer_with_and_without_replay():
    model = tiny_moe()
    batch = sampled_batch(model, torch.float32, temperature=0.7)
    m = batch.response_mask.bool()
    for replay in (False, True):
        lp, metrics = step_metrics(model, batch, replay, 0.7)
        torch.testing.assert_close(lp[m], batch.rollout_logprobs[m], atol=1e-5, rtol=0)
        assert metrics["rollout/routing_agreement"] == 1.0 and metrics["moe/load_imbalance"] >= 1.0


def test_replay_aligns_a_bf16_engine_with_an_fp32_trainer():
    # Router logits scaled down so near-ties are common and bf16 flips some top-k choices.
    model = tiny_moe(seed=3)
    with torch.no_grad():
        for layer in model.config.moe_layers:
            model.model.layers[layer].mlp.gate.weight.mul_(0.05)
    batch = sampled_batch(model, torch.bfloat16)
    _, own = step_metrics(model, batch, replay=False)
    _, rep = step_metrics(model, batch, replay=True)
    assert own["rollout/routing_agreement"] < 1.0
    assert rep["rollout/routing_agreement"] == 1.0
    assert rep["actor/logprob_gap"] < own["actor/logprob_gap"]


def test_aux_loss_coef_changes_only_through_the_router_balance():
    model = tiny_moe()
    batch = sampled_batch(model, torch.float32)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    Trainer(a, TrainSection(micro_batch_size=5), AlgoSection(), 1.0, 1).train_step(batch)
    mb = Trainer(b, TrainSection(micro_batch_size=5, router_aux_loss_coef=10.0), AlgoSection(), 1.0, 1)
    metrics = mb.train_step(batch)
    assert metrics["moe/aux_loss"] > 0
    gate = f"model.layers.{model.config.moe_layers[0]}.mlp.gate.weight"
    assert not torch.equal(dict(a.named_parameters())[gate], dict(b.named_parameters())[gate])


def test_routing_record_survives_chunked_prefill_forks_and_preemption():
    """The paged engine records per step: prefill chunks, n-way forks and recompute after preemption must give the
    record of an unconstrained run."""
    from twinplane.rollout.kv_cache import bytes_per_block

    model = tiny_moe()
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5)
    want = RolloutEngine(copy.deepcopy(model), eos_token_id=None, record_routing=True).generate(PROMPTS, sp)
    free = RolloutEngine(copy.deepcopy(model), eos_token_id=None)
    tight = RolloutEngine(copy.deepcopy(model), eos_token_id=None, record_routing=True, max_num_batched_tokens=4,
                          kv_cache_bytes=3 * bytes_per_block(model.config, free.block_size, torch.float32))
    got = tight.generate(PROMPTS, sp)
    assert tight.pop_metrics()["rollout/preemptions"] > 0
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.routing.shape == (len(a.prompt_ids) + len(a.token_ids), 2, 2)
        torch.testing.assert_close(a.routing.sort(-1).values, b.routing.sort(-1).values, atol=0, rtol=0)


def test_replay_is_the_same_in_packed_and_padded_micro_batches():
    model = tiny_moe()
    batch = sampled_batch(model, torch.bfloat16)
    lps = []
    for packing in (True, False):
        train = TrainSection(micro_batch_size=5, packing=packing)
        trainer = Trainer(copy.deepcopy(model), train, AlgoSection(routing_replay=True), 1.0, 1)
        lps.append(trainer.logprobs(batch))
        assert trainer.train_step(batch)["rollout/routing_agreement"] == 1.0
    torch.testing.assert_close(lps[0], lps[1], atol=1e-5, rtol=0)

"""The paged, continuously batched engine: outputs independent of batching, sharing and preemption; blocks."""

import copy
import random
from dataclasses import replace

import pytest
import torch
from conftest import EOS, PROMPTS, greedy_no_cache, paged_case, tiny_model

from twinplane.errors import InputError
from twinplane.model import AttentionMetadata
from twinplane.platform import hardware
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.block_manager import BlockManager
from twinplane.rollout.kv_cache import bytes_per_block
from twinplane.rollout.paged_attention import paged_attention
from twinplane.rollout.scheduler import Scheduler
from twinplane.rollout.sequence import Sequence
from twinplane.rollout.stats import EngineStats


def assert_pool_empty(engine):
    assert engine.blocks.num_free == engine.blocks.num_blocks and not any(engine.blocks.ref)


def test_greedy_with_n_backfill_and_chunked_prefill_equals_full_recompute():
    model = tiny_model()
    # 2 running slots for 4 prompts x 3 samples: samples finish and others are admitted; 4-token chunks
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, max_num_seqs=3, max_num_batched_tokens=4)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, n=3))
    assert [s.request_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for s in samples:
        assert s.token_ids == greedy_no_cache(model, PROMPTS[s.request_index], 10)
    m = engine.pop_metrics()
    assert m["rollout/running_seqs_mean"] <= 3 and m["rollout/preemptions"] == 0
    assert m["rollout/engine_steps"] > 0 and engine.pop_metrics() == {}  # popped: the next step starts from zero
    assert_pool_empty(engine)


def test_decodes_beyond_the_token_budget_make_a_prefill_chunk_wait():
    """3 decodes with a 2-token budget while a 40-token prompt is mid-prefill: its chunk waits for room (it was
    sized from the negative remainder of the budget, and the step crashed)."""
    model = tiny_model()
    prompts = [list(range(5, 36)), list(range(5, 45))]
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=None, max_num_batched_tokens=2)
    for s in engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, n=3)):
        assert s.token_ids == greedy_no_cache(model, prompts[s.request_index], 6)
    assert_pool_empty(engine)


def test_engine_stats_of_parallel_engines_merge_into_one_plane():
    """Ray's data-parallel engines report their counters; the driver's merge is the plane's metrics."""
    a = EngineStats(steps=10, running_sum=40, usage_peak=0.5, preemptions=1, prefill_tokens=100, decode_tokens=300,
                    seconds=2.0)
    b = EngineStats(steps=30, running_sum=60, usage_peak=0.75, preemptions=2, prefill_tokens=50, decode_tokens=100,
                    seconds=4.0)
    m = EngineStats.parallel([a, b]).metrics()
    assert m["rollout/engine_steps"] == 40 and m["rollout/preemptions"] == 3
    assert m["rollout/running_seqs_mean"] == 100 / 40 and m["rollout/kv_cache_usage_peak"] == 0.75
    assert m["perf/decode_tokens_per_s"] == 400 / 4.0 and m["perf/prefill_tokens_per_s"] == 150 / 4.0
    assert m["rollout/engine_busy_s_max"] == 4.0 and m["rollout/engine_busy_s_min"] == 2.0
    one = (a + b).metrics()  # one engine, two rollouts in a row (DAPO): time adds up
    assert one["perf/decode_tokens_per_s"] == 400 / 6.0 and "rollout/engine_busy_s_max" not in one


def sampled(engine, prompts, seeds_per_prompt, sp):
    pairs = enumerate(zip(prompts, seeds_per_prompt, strict=True))
    seqs = [engine.sequence(p, i, sp, seeds) for i, (p, seeds) in pairs]
    return engine.run(seqs)


def test_shared_prompt_equals_separate_submissions_and_cow_keeps_shared_blocks():
    model = tiny_model()
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompt = list(range(5, 5 + 21))  # 21 tokens: the last 16-token block is partly filled and shared
    seeds = [11, 22, 33, 44]
    shared_blocks_unchanged = []
    step = engine._step

    def checked_step(batch, sched, sp_):  # snapshot every shared block, run the step, compare
        shared = [b for b, r in enumerate(engine.blocks.ref) if r > 1]
        before = engine.kv.k[:, shared].clone(), engine.kv.v[:, shared].clone()
        out = step(batch, sched, sp_)
        shared_blocks_unchanged.append(torch.equal(engine.kv.k[:, shared], before[0])
                                       and torch.equal(engine.kv.v[:, shared], before[1]))
        return out

    engine._step = checked_step
    together = sampled(engine, [prompt], [seeds], sp)
    m = engine.pop_metrics()
    assert m["perf/prefill_tokens_per_s"] > 0
    engine._step = step
    apart = sampled(engine, [prompt] * 4, [[s] for s in seeds], sp)
    assert [s.token_ids for s in together] == [s.token_ids for s in apart]
    assert len({tuple(s.token_ids) for s in together}) > 1  # the streams differ
    for a, b in zip(together, apart, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert all(shared_blocks_unchanged) and len(shared_blocks_unchanged) > 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_and_batching_do_not_change_outputs(temperature):
    model = tiny_model()
    sp = SamplingParams(temperature=temperature, max_new_tokens=24, n=3, seed=5)
    free = RolloutEngine(copy.deepcopy(model), eos_token_id=None)
    want = free.generate(PROMPTS, sp)
    per_block = bytes_per_block(model.config, free.block_size, torch.float32)
    tight = RolloutEngine(copy.deepcopy(model), eos_token_id=None, kv_cache_bytes=3 * per_block,
                          max_num_batched_tokens=8)
    got = tight.generate(PROMPTS, sp)
    m = tight.pop_metrics()
    assert m["rollout/preemptions"] > 0 and m["rollout/kv_cache_usage_peak"] <= 1.0
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert_pool_empty(tight)
    one = RolloutEngine(copy.deepcopy(model), eos_token_id=None, max_num_seqs=1).generate(PROMPTS, sp)
    assert [s.token_ids for s in one] == [s.token_ids for s in want]


def test_running_count_follows_admissions_forks_preemptions_and_finishes(monkeypatch):
    """The scheduler's kept count of running-set slots equals its running sequences' widths after every step of
    a run that admits, forks (n samples), preempts, retires early stops and runs ahead (static decode steps)."""
    checks = []

    def checked(name):
        fn = getattr(Scheduler, name)

        def wrapper(self, *a, **k):
            out = fn(self, *a, **k)
            checks.append(self.num_running == sum(s.width for s in self.running))
            return out

        monkeypatch.setattr(Scheduler, name, wrapper)

    for name in ("schedule", "schedule_ahead", "finish"):
        checked(name)
    model = tiny_model()
    per_block = bytes_per_block(model.config, RolloutEngine(copy.deepcopy(model), None).block_size, torch.float32)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, kv_cache_bytes=4 * per_block,
                           max_num_batched_tokens=8)
    engine.graph_backend = "static"
    engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=20, n=3, seed=2), [20, 3, 11, 20])
    m = engine.pop_metrics()
    assert m["rollout/preemptions"] > 0 and m["rollout/engine_steps_ahead"] > 0
    assert len(checks) > 20 and all(checks)


def test_random_budgets_caps_and_chunks_give_the_unconstrained_outputs():
    """Seeded random mixes of prompt lengths (around block edges), n, stops, sampling, KV budgets from one sequence
    up, running-set caps and token budgets (below the number of decodes too): the outputs, log-probs and finish
    reasons of the unconstrained engine (with the batch-invariant GEMMs), and an empty pool afterwards. (It catches
    the negative prefill chunk above.)"""
    model, rng = tiny_model(), random.Random(0)
    invariant = {"batch_invariant": True}  # (MKL's small GEMMs round a row by the batch's size on some CPUs)
    bs = RolloutEngine(copy.deepcopy(model), None).block_size
    per_block = bytes_per_block(model.config, bs, torch.float32)
    for _ in range(40):
        prompts = [[rng.randrange(4, 50) for _ in range(rng.choice([1, 5, 15, 16, 17, 33]))]
                   for _ in range(rng.randint(1, 4))]
        sp = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_new_tokens=rng.choice([1, 7, 16]),
                            n=rng.choice([1, 2, 3, 5]), seed=rng.randrange(100),
                            stop_token_ids=rng.choice([[], [7, 9]]), top_p=rng.choice([1.0, 0.8]),
                            stop_sequences=rng.choice([[], [[8], [9, 10]]]))
        eos = rng.choice([None, EOS])
        want = RolloutEngine(copy.deepcopy(model), eos, **invariant).generate(prompts, sp)
        need = -(-(max(map(len, prompts)) + sp.max_new_tokens) // bs)
        tight = RolloutEngine(copy.deepcopy(model), eos, kv_cache_bytes=(need + rng.choice([0, 1, 4])) * per_block,
                              max_num_seqs=rng.choice([1, 3, 8, 64]), max_num_batched_tokens=rng.choice([1, 2, 3, 64]),
                              **invariant)
        got = tight.generate(prompts, sp)
        assert [(s.token_ids, s.finish_reason) for s in got] == [(s.token_ids, s.finish_reason) for s in want]
        for a, b in zip(got, want, strict=True):  # (attention over padded keys rounds by the batch: ~1e-7)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert_pool_empty(tight)


def test_per_request_caps_are_prefixes_and_decode_nothing_past_them():
    """`generate(..., max_new_tokens=[...])` (multi-turn continuations, each with what is left of its budget): a
    capped sample is the uncapped one's first tokens, and no decode step runs past a cap."""
    model = tiny_model()
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=None)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=4)
    full = engine.generate(PROMPTS, sp)
    engine.pop_stats()
    caps = [12, 3, 1, 7]
    capped = engine.generate(PROMPTS, sp, max_new_tokens=caps)
    for s, f in zip(capped, full, strict=True):
        assert s.token_ids == f.token_ids[:caps[s.request_index]] and s.finish_reason == "length"
        torch.testing.assert_close(s.logprobs, f.logprobs[:len(s.token_ids)], atol=1e-5, rtol=0)
    # a sample's first token comes from its prompt's prefill, every later one from a decode of the one before
    assert engine.pop_stats().decode_tokens == sum(len(s.token_ids) - 1 for s in capped)
    assert_pool_empty(engine)
    for bad in ([13, 1, 1, 1], [0, 1, 1, 1], [1, 1]):
        with pytest.raises(ValueError, match="one cap in 1..12 per request"):
            engine.generate(PROMPTS, sp, max_new_tokens=bad)


@pytest.mark.parametrize("seed", range(4))
def test_admission_fills_the_running_cap_counting_each_sample(seed):
    """Waiting sequences are admitted oldest first while their samples (a sequence not yet forked counts its n)
    fit `max_num_seqs`: the admitted ones are the longest prefix of the queue within the cap, and no more."""
    rng = random.Random(seed)
    widths, cap = [rng.choice([1, 1, 2, 3, 8]) for _ in range(40)], rng.choice([5, 8, 17])
    sched = Scheduler(BlockManager(1000, 4), max_num_seqs=cap, max_num_batched_tokens=10_000)
    for i, w in enumerate(widths):
        sched.add(Sequence([1, 2, 3], i, SamplingParams(n=w, max_new_tokens=4), list(range(w))))
    batch = sched.schedule()
    fits = next((k for k in range(len(widths)) if sum(widths[:k + 1]) > cap), len(widths))
    assert [s.request_index for s in batch.seqs] == list(range(max(fits, 1)))
    assert sched.num_running == sum(widths[:max(fits, 1)])


def test_budget_too_small_for_one_sequence_is_a_clear_error():
    """An input error (exit 2 in a run), raised before anything is allocated; one block short is refused, exact fits."""
    model = tiny_model()
    engine = RolloutEngine(model, eos_token_id=None, kv_cache_bytes=1)
    with pytest.raises(InputError, match="holds 0 blocks .* raise rollout.kv_cache_gb"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    assert engine.kv is None
    sp = SamplingParams(max_new_tokens=30)
    longest = max(len(p) for p in PROMPTS) + sp.max_new_tokens  # 37 tokens: 3 blocks of 16
    per_block = bytes_per_block(model.config, engine.block_size, engine.dtype)
    need = -(-longest // engine.block_size)
    engine.kv_cache_bytes = (need - 1) * per_block
    with pytest.raises(InputError, match=f"one sequence of {longest} tokens needs {need}"):
        engine.generate(PROMPTS, sp)
    engine.kv_cache_bytes = need * per_block
    assert len(engine.generate(PROMPTS, sp)) == len(PROMPTS)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("lockstep", [False, True])
def test_paged_attention_equals_dense_per_sequence(window, lockstep):
    q, k, v, paged, tables, ctx, qlens, window = paged_case(window, lockstep=lockstep)
    kc0, vc0 = paged.k_cache.clone(), paged.v_cache.clone()
    meta = AttentionMetadata(torch.zeros(1, q.shape[2], dtype=torch.long), window=window, paged=paged)
    out = paged_attention(q, k, v, meta, 0)
    # decodes of one context length (the common case: samples in lockstep) attend with no mask unless windowed
    assert (paged.plan(window)[0][3] is None) == (lockstep and window is None)
    bs, start = paged.block_size, 0
    for t, c, n in zip(tables, ctx, qlens, strict=True):
        slots = [t[p // bs] * bs + p % bs for p in range(c)]
        keys = kc0[0].flatten(0, 1)[slots].clone()
        vals = vc0[0].flatten(0, 1)[slots].clone()
        keys[c - n:], vals[c - n:] = k[0, :, start:start + n].transpose(0, 1), v[0, :, start:start + n].transpose(0, 1)
        qp, kp = torch.arange(c - n, c)[:, None], torch.arange(c)[None]
        mask = (kp <= qp) & ((qp - kp) < window if window else True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:start + n], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], attn_mask=mask,
            enable_gqa=True)
        torch.testing.assert_close(out[:, :, start:start + n], ref, atol=1e-5, rtol=0)
        start += n


@pytest.mark.gpu
def test_flash_paged_backend_equals_portable():
    if not hardware.detect().attention.flash_attn_eligible:
        pytest.skip("the fused paged backend needs flash-attn")
    model = tiny_model().cuda()
    sp = SamplingParams(temperature=0, max_new_tokens=16, n=2)
    fused = RolloutEngine(copy.deepcopy(model), eos_token_id=None).generate(PROMPTS, sp)
    portable = RolloutEngine(copy.deepcopy(model), eos_token_id=None)
    portable.backend, portable.block_size = "sdpa", 16
    assert [s.token_ids for s in fused] == [s.token_ids for s in portable.generate(PROMPTS, sp)]


def test_batch_invariant_needs_the_cpu_float32_engine():
    with pytest.raises(InputError, match="rollout.batch_invariant: needs the CPU float32 engine"):
        RolloutEngine(tiny_model().to(torch.bfloat16), None, batch_invariant=True)


@pytest.mark.parametrize("graphs", ["eager", "static"])
def test_requests_with_their_own_sampling_share_steps_and_sample_as_alone(graphs):
    """A server's requests each bring their own temperature, top-p/top-k, cap and stop tokens: batched together they
    sample exactly what each samples alone (rows sharing a sampling are sampled in one call)."""
    model = tiny_model()
    kinds = [SamplingParams(temperature=0.0, max_new_tokens=10),
             SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=14, n=2),
             SamplingParams(temperature=1.0, top_k=5, max_new_tokens=8, stop_token_ids=[7]),
             SamplingParams(temperature=1.3, max_new_tokens=12, min_new_tokens=4)]

    def run(pairs):
        e = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
        e.graph_backend = graphs
        seqs = [e.sequence(p, i, sp, [100 * i + j for j in range(sp.n)]) for i, (p, sp) in pairs]
        return e.run(seqs)

    pairs = list(enumerate(zip(PROMPTS, kinds, strict=True)))
    together = run(pairs)
    alone = [s for pair in pairs for s in run([pair])]
    assert [s.token_ids for s in together] == [s.token_ids for s in alone]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert len(together[0].token_ids) == 10 and all(len(s.token_ids) >= 5 for s in together[4:])


def test_top_logprobs_are_the_policy_distributions_most_likely_tokens():
    model = tiny_model()
    e = RolloutEngine(copy.deepcopy(model), eos_token_id=None)
    sp = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=3, top_logprobs=4)
    got = e.generate(PROMPTS[:2], sp)
    plain = RolloutEngine(copy.deepcopy(model), eos_token_id=None).generate(PROMPTS[:2], replace(sp, top_logprobs=0))
    assert [s.token_ids for s in got] == [s.token_ids for s in plain] and plain[0].top_logprobs is None
    for s in got:  # against a full forward over prompt + response: log_softmax(logits / T), its 4 largest
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        logits = model(ids)[0, len(s.prompt_ids) - 1:-1].float()
        want = torch.log_softmax(logits / 0.8, -1).topk(4, -1)
        assert len(s.top_logprobs) == len(s.token_ids)
        for pairs, ids_k, vals_k, lp in zip(s.top_logprobs, want.indices, want.values, s.logprobs, strict=True):
            assert [t for t, _ in pairs] == ids_k.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in pairs]), vals_k, atol=1e-5, rtol=0)
            assert pairs[0][1] >= lp - 1e-6

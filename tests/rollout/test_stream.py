"""The engine as a stream: the same samples as a plain call, partial rollouts against their definition, restarts,
and a saved stream that continues bitwise."""

import copy
import json

import pytest
import torch
from conftest import EOS, PROMPTS, tiny_model

from twinplane.model import load_weights
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.sequence import sample_seed
from twinplane.rollout.stream import EngineStream, GroupRequest

SP = SamplingParams(temperature=1.0, max_new_tokens=10, n=2)


def groups(prompts=PROMPTS, first_uid=0):
    return [GroupRequest(first_uid + i, list(p), [sample_seed(5, first_uid + i, j) for j in range(SP.n)])
            for i, p in enumerate(prompts)]


def plain(model, requests):
    """The same groups through `RolloutEngine.run` (one call, its own pool and scheduler)."""
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    seqs = [engine.sequence(g.prompt_ids, g.uid, SP, g.seeds) for g in requests]
    return engine.run(seqs)


def tokens(samples):
    return [(s.request_index, s.token_ids) for s in samples]


def stream_of(model, **kw):
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    return engine, EngineStream(engine, SP, max_groups=8, max_prompt_len=16, **kw)


def test_stream_samples_equal_a_plain_call_however_groups_join():
    model = tiny_model()
    want = plain(model, groups())
    _, stream = stream_of(model)
    reqs = groups()
    stream.add(reqs[:2])
    got = stream.advance(steps=3)  # the other two join mid-way
    stream.add(reqs[2:])
    got += stream.advance()
    assert all(len(g) == SP.n for g in got)
    assert sorted(tokens([s for g in got for s in g])) == sorted(tokens(want))
    assert all(s.versions == [0] * len(s.token_ids) for g in got for s in g)


def test_until_groups_stops_as_soon_as_enough_groups_complete():
    _, stream = stream_of(tiny_model())
    reqs = groups()
    stream.add(reqs[:1])
    stream.advance(steps=3)
    stream.add(reqs[1:])
    first = stream.advance(until_groups=1)
    assert [g[0].request_index for g in first] == [0]
    rest = stream.advance()
    assert len(first) + len(rest) == len(PROMPTS) and stream.call([], None, None).idle


def new_weights(model, seed=3):
    other = tiny_model(seed=seed)
    load_weights(model, other.named_parameters())
    return other


def token_logprobs(model, sample) -> list[float]:
    """log p(each generated token | the text before it) under `model`, recomputed without a cache."""
    ids = sample.prompt_ids + sample.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
    start = len(sample.prompt_ids)
    return [float(lp[start + t - 1, tok]) for t, tok in enumerate(sample.token_ids)]


def test_partial_rollout_continues_under_new_weights_with_each_tokens_version():
    """After a weight change mid-sample, the later tokens' log-probs are the new model's given the text so far,
    the earlier tokens keep the old model's; `versions` says which is which."""
    model = tiny_model()
    engine, stream = stream_of(model)
    stream.add(groups())
    stream.advance(steps=4)
    other = new_weights(engine.model)
    engine.weights_loaded(1)
    samples = [s for g in stream.advance() for s in g]
    assert any(0 in s.versions and 1 in s.versions for s in samples)
    for s in samples:
        old, new = token_logprobs(model, s), token_logprobs(other, s)
        want = [o if v == 0 else n for o, n, v in zip(old, new, s.versions, strict=True)]
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want), atol=1e-5, rtol=0)
        assert s.versions == sorted(s.versions) and s.oldest_version == s.versions[0]


def test_too_stale_groups_restart_and_partial_false_regenerates_under_the_new_weights():
    model = tiny_model()
    engine, stream = stream_of(model, max_staleness=0)
    stream.add(groups())
    stream.advance(steps=4)
    new_weights(engine.model)
    engine.weights_loaded(1)
    result = stream.call([], None, None)
    assert result.restarted > 0
    assert all(s.versions == [1] * len(s.token_ids) for g in result.groups for s in g)
    # abort-and-resubmit equals generating the groups afresh with the new weights
    engine2, stream2 = stream_of(model, partial=False)
    stream2.add(groups())
    stream2.advance(steps=4)
    new_weights(engine2.model)
    engine2.weights_loaded(1)
    got = [s for g in stream2.advance() for s in g]
    fresh = copy.deepcopy(model)
    new_weights(fresh)
    assert sorted(tokens(got)) == sorted(tokens(plain(fresh, groups())))


@pytest.mark.parametrize("partial", [True, False])
def test_a_saved_stream_continues_bitwise(partial):
    model = tiny_model()
    engine, stream = stream_of(model, partial=partial)
    stream.add(groups())
    first = stream.advance(until_groups=1)
    new_weights(engine.model)
    engine.weights_loaded(1)
    state = json.loads(json.dumps(stream.state()))  # plain data
    want = stream.advance()
    engine2 = RolloutEngine(copy.deepcopy(engine.model), eos_token_id=EOS)
    engine2.weight_version = 1
    stream2 = EngineStream(engine2, SP, max_groups=8, max_prompt_len=16, partial=partial)
    stream2.load_state(state)
    got = stream2.advance()
    assert first and [[(s.token_ids, s.logprobs, s.versions) for s in g] for g in got] == \
        [[(s.token_ids, s.logprobs, s.versions) for s in g] for g in want]

"""The engine as a stream: the same samples as a plain call, partial rollouts against their definition, restarts,
and a saved stream that continues bitwise."""

import copy
import json
import string

import pytest
import torch
from conftest import EOS, PROMPTS, assert_multi_turn_logprobs_match_trainer, tiny_model

from twinplane.model import load_weights
from twinplane.rollout import MultiTurnRollout, RolloutEngine, SamplingParams
from twinplane.rollout.sequence import sample_seed
from twinplane.rollout.stream import EngineStream, GroupRequest, StreamRequest
from twinplane.rollout.tools import build_tools
from twinplane.tokenizer import build_char_tokenizer

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
    return engine, EngineStream(engine, StreamRequest(SP, max_groups=8, max_prompt_len=16, **kw))


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
    stream2 = EngineStream(engine2, StreamRequest(SP, max_groups=8, max_prompt_len=16, partial=partial))
    stream2.load_state(state)
    got = stream2.advance()
    assert first and [[(s.token_ids, s.logprobs, s.versions) for s in g] for g in got] == \
        [[(s.token_ids, s.logprobs, s.versions) for s in g] for g in want]


def test_multi_turn_tool_rollouts_in_a_stream():
    """A sample that stops at a tool call gets exactly the tool's output (loss mask 0, log-prob 0) and generates on
    with its prefix recomputed: the model's tokens score like the trainer's one forward over the whole sequence,
    across a weight change and a save/restore of the stream."""
    tok = build_char_tokenizer(string.printable)
    model = tiny_model(vocab_size=tok.vocab_size)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    sp = SamplingParams(temperature=0.8, max_new_tokens=80, n=3)
    # the random model has no idea of the format: its favourite character ends a call, so calls happen
    probe = engine.generate([tok.encode("2+3=")], SamplingParams(temperature=0.8, max_new_tokens=40, n=4, seed=3))
    counts = torch.bincount(torch.tensor([t for s in probe for t in s.token_ids]), minlength=tok.vocab_size)
    counts[tok.eos_token_id] = 0
    call_end = tok.decode([int(counts.argmax())], skip_special_tokens=False)
    turns = MultiTurnRollout(engine, tok, build_tools(["calculator"]), max_turns=3, call_start="#", call_end=call_end)
    stream = EngineStream(engine, StreamRequest(sp, max_groups=4, max_prompt_len=8), turns)
    prompts = [tok.encode(p) for p in ["2+3=", "hello", "x"]]
    stream.add([GroupRequest(i, p, [sample_seed(1, i, j) for j in range(3)]) for i, p in enumerate(prompts)])
    stream.advance(steps=30)
    state = json.loads(json.dumps(stream.state()))
    samples = [s for g in stream.advance() for s in g]
    assert any(s.num_turns >= 2 for s in samples) and any(0 in s.loss_mask for s in samples)
    for s in samples:
        assert len(s.loss_mask) == len(s.token_ids) == len(s.logprobs) == len(s.versions)
        assert s.num_tool_calls == s.num_tool_errors  # (a random model writes no JSON)
        # a finished model turn ran its call, except the last one; a tool output cut by the budget ends the sample
        assert s.num_tool_calls == s.num_turns - (s.finish_reason != "length" or s.loss_mask[-1] == 1)
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if not m)
        assert len(s.token_ids) <= sp.max_new_tokens
        # each tool segment is the calculator's answer to the turn before it, encoded in the output template
        text = tok.decode(s.token_ids, skip_special_tokens=False)
        assert text.count("<tool_response>") == s.num_tool_calls or s.finish_reason == "length"
    assert_multi_turn_logprobs_match_trainer(model, samples, tok.pad_token_id, 0.8)
    # a restored stream continues to the same samples
    engine2 = RolloutEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    stream2 = EngineStream(engine2, StreamRequest(sp, max_groups=4, max_prompt_len=8),
                           turns=MultiTurnRollout(engine2, tok, build_tools(["calculator"]), max_turns=3,
                                                  call_start="#", call_end=call_end))
    stream2.load_state(state)
    again = [s for g in stream2.advance() for s in g]
    assert [(s.token_ids, s.loss_mask) for s in again] == [(s.token_ids, s.loss_mask) for s in samples]

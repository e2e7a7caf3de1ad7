"""Graph-captured decode (twinplane.rollout.graphs): the static path (fixed buffers, padded buckets) forced on CPU
equals the eager engine, before and after a weight sync; padding rows never touch a sequence's blocks; options
and fallbacks. The capture itself (CUDA/HIP graphs) is tested at the end, on GPUs only."""

import contextlib
import copy
import time

import pytest
import torch
from conftest import EOS, PROMPTS, assert_same, greedy_no_cache, tiny_model, tiny_moe

from twinplane.config import ConfigError, load_config
from twinplane.platform import backends
from twinplane.rollout import RolloutEngine, SamplingParams, engine_options
from twinplane.rollout import graphs as decode_graphs
from twinplane.rollout.graphs import DecodeGraphs, buckets
from twinplane.rollout.kv_cache import bytes_per_block


def engine(model, mode="static", **kw):
    e = RolloutEngine(copy.deepcopy(model), **{"eos_token_id": EOS, **kw})
    e.graph_backend = mode  # "static": the graph path's buffers and buckets, run without capture
    return e


def test_buckets():
    assert buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256]
    assert buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]
    assert buckets(3) == [1, 2, 3] and buckets(1) == [1]
    with pytest.raises(ValueError, match="graph_max_batch"):
        buckets(0)


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True, "num_kv_heads": 4},
                                  {"model_type": "qwen3", "qk_norm": True}, {"sliding_window": 4}, "moe"])
def test_static_greedy_equals_eager(over):  # (the eager engine is checked against full recompute in test_engine)
    model = tiny_moe() if over == "moe" else tiny_model(**over)
    sp = SamplingParams(temperature=0, max_new_tokens=12, n=3)
    static = engine(model)
    got = static.generate(PROMPTS, sp)
    assert static.pop_metrics()["rollout/engine_steps_graphed"] > 5
    assert_same(got, engine(model, "eager").generate(PROMPTS, sp))


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=7),
                                SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, n=2,
                                               min_new_tokens=4, seed=3)])
def test_static_seeded_sampling_equals_eager(sp):
    model = tiny_model()
    static, eager = engine(model), engine(model, "eager")
    got = static.generate(PROMPTS, sp)
    assert static.pop_metrics()["rollout/engine_steps_graphed"] > 5
    want = eager.generate(PROMPTS, sp)
    assert_same(got, want)
    assert len({tuple(s.token_ids) for s in got}) > 4  # sampled, not one sequence repeated


def rows_checked(monkeypatch, launch=None):
    """`DecodeGraphs.launch` (or `launch`, a wrapper of it), checking that the rows the forward reads are those
    built afresh from the sequences (token, position, slot, context length, block table padded with the reserved
    block; padding rows after), whether the host staged a row or the device advanced it. The token of a step
    launched ahead is known on the host only after the step before it is read back: the rows are checked when the
    step is (`finish`). Returns the counts of rows staged, rows advanced on the device, steps launched ahead and
    steps not launched ahead (a capture was due)."""
    seen, counts, forward = {}, {"staged": 0, "advanced": 0, "ahead": 0, "refused": 0}, DecodeGraphs.forward
    launch, finish, launched = launch or DecodeGraphs.launch, DecodeGraphs.finish, {}

    def read(self, size):
        seen["rows"] = self.inputs[:size].tolist()
        return forward(self, size)

    def checked_launch(self, seqs, sp, ahead=False):
        before = [(s, s.num_computed, list(s.block_table)) for s in seqs]
        step = launch(self, seqs, sp, ahead)
        if step is None:
            counts["refused"] += ahead
            return None
        size, host = self.bucket(len(seqs)), self.host[step.buffer]
        assert host[len(seqs):size, decode_graphs.LIVE].sum() == 0  # padding rows stay where they are
        staged = int(host[:len(seqs), decode_graphs.RESET].sum())
        counts["staged"] += staged
        counts["advanced"] += len(seqs) - staged
        counts["ahead"] += ahead
        launched[id(step)] = before, seen.pop("rows"), size
        return step

    def checked_finish(self, step):
        out = finish(self, step)
        before, rows, size = launched.pop(id(step))
        bs, pad = self.block_size, self.pad_block
        want = [[s.tokens[p], p, table[p // bs] * bs + p % bs, p + 1, *table, *[pad] * (self.max_blocks - len(table))]
                for s, p, table in before]
        assert rows == want + [self.pad_row] * (size - len(before))
        return out

    monkeypatch.setattr(DecodeGraphs, "forward", read)
    monkeypatch.setattr(DecodeGraphs, "launch", checked_launch)
    monkeypatch.setattr(DecodeGraphs, "finish", checked_finish)
    return counts


def test_static_and_eager_steps_mixed_with_preemption_and_chunked_prefill(monkeypatch):
    """Decode batches above graph_max_batch run eagerly, prefill steps always do; a tight pool preempts. The rows
    staged between steps always equal rows built afresh (tables grown, copied on write, freed and given again)."""
    counts = rows_checked(monkeypatch)
    model = tiny_model()
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, n=3, seed=5)
    want = engine(model, "eager", eos_token_id=None).generate(PROMPTS, sp)
    per_block = bytes_per_block(model.config, 16, torch.float32)
    # 4 blocks' budget: 3 for sequences (as the eager engine's tight test) + the reserved padding block
    tight = engine(model, eos_token_id=None, kv_cache_bytes=4 * per_block, max_num_batched_tokens=8,
                   graph_max_batch=2)
    got = tight.generate(PROMPTS, sp)
    m = tight.pop_metrics()
    assert m["rollout/preemptions"] > 0 and 0 < m["rollout/engine_steps_graphed"] < m["rollout/engine_steps"]
    assert_same(got, want)
    assert tight.blocks.num_free == tight.blocks.num_blocks == 3
    assert counts["staged"] > 0 and counts["advanced"] > 0


def test_padding_rows_write_only_the_reserved_block(monkeypatch):
    model = tiny_model()
    e = engine(model)
    launch, seen = DecodeGraphs.launch, []

    def checked(self, seqs, sp, ahead=False):
        bs, pad = self.block_size, self.pad_block
        assert all(pad not in s.block_table for s in seqs)
        written = {s.block_table[s.num_computed // bs] * bs + s.num_computed % bs for s in seqs}
        before = self.kv.k.clone(), self.kv.v.clone()
        out = launch(self, seqs, sp, ahead)
        changed = ((self.kv.k != before[0]).flatten(3).any(-1) | (self.kv.v != before[1]).flatten(3).any(-1))
        changed = set(changed.any(0).flatten().nonzero().flatten().tolist())  # pool slots written in any layer
        assert changed - written <= set(range(pad * bs, (pad + 1) * bs))  # nothing else but the padding block
        seen.append((len(seqs), self.bucket(len(seqs)), len(changed & written) == len(written)))
        return out

    rows_checked(monkeypatch, checked)
    for _ in range(2):  # the second call's sequences get the first call's rows and blocks again
        e.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=1))
    assert any(n < size for n, size, _ in seen)  # some steps had padding rows
    assert all(ok for _, _, ok in seen)  # and every real row's k/v landed in its own slot


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, max_new_tokens=24, n=3, seed=2),
                                SamplingParams(temperature=0.8, max_new_tokens=20, n=2, min_new_tokens=5, seed=6),
                                SamplingParams(temperature=0, max_new_tokens=16, n=2)])
def test_steps_run_ahead_give_the_samples_of_steps_read_back_one_by_one(sp, monkeypatch):
    """Run ahead, each decode step is launched before the one before it is read back: sequences that stopped in
    that step waste a row (dropped), the ones whose last token it was sit the step out. Samples, log-probs and the
    counters equal those of an engine that reads every step back (and the eager engine's), the rows each step
    read are the sequences' own, and a sequence's wasted row draws nothing it would have used."""
    counts, dropped, current = rows_checked(monkeypatch), [], decode_graphs.Launched.current

    def counted(self, seqs):
        kept = current(self, seqs)
        dropped.extend(s for i, s in enumerate(seqs) if i not in kept)
        return kept

    monkeypatch.setattr(decode_graphs.Launched, "current", counted)
    model, caps = tiny_model(), [sp.max_new_tokens, 3, sp.max_new_tokens - 5, 7]  # (caps: lengths differ)
    ahead, step_by_step = engine(model), engine(model, run_ahead=False)
    got = ahead.generate(PROMPTS, sp, caps)
    assert_same(got, step_by_step.generate(PROMPTS, sp, caps))  # (a wasted row can change a bucket: GEMM rounding)
    assert_same(got, engine(model, "eager").generate(PROMPTS, sp, caps))
    a, b = ahead.pop_stats(), step_by_step.pop_stats()
    assert a.ahead_steps > 5 and b.ahead_steps == 0 and counts["ahead"] == a.ahead_steps
    assert a.decode_tokens == b.decode_tokens and a.steps >= b.steps  # (a last step ahead may find none going on)
    if sp.temperature:
        assert {s.finish_reason for s in got} == {"stop", "length"}
        assert dropped  # rows of sequences that had just stopped
    assert all(s.finish_reason == "stop" for s in dropped)  # a last token by length: the step ahead sat it out
    assert ahead.blocks.num_free == ahead.blocks.num_blocks


@pytest.mark.parametrize("run_ahead", [True, False])
def test_time_blocked_reading_steps_back_is_counted(run_ahead, monkeypatch):
    """`rollout/device_wait_s`: the host's time blocked on a step's event (a stand-in that takes 2 ms, as a device
    still running the step would), counted once per graphed step, over a call's steps only."""
    class SlowEvent:
        def record(self):
            pass

        def synchronize(self):
            time.sleep(0.002)

    init = DecodeGraphs.__init__

    def with_events(self, *a, **k):
        init(self, *a, **k)
        self.events = [SlowEvent(), SlowEvent()]

    monkeypatch.setattr(DecodeGraphs, "__init__", with_events)
    e = engine(tiny_model(), run_ahead=run_ahead)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=1)
    for _ in range(2):  # (a second call reuses the first one's static decode: its count starts again)
        e.generate(PROMPTS, sp)
        stats = e.pop_stats()
        assert stats.graph_steps > 5 and (stats.ahead_steps > 0) == run_ahead
        assert 0.002 * stats.graph_steps <= stats.wait_seconds < stats.seconds
        assert stats.metrics()["rollout/device_wait_s"] == stats.wait_seconds


def test_host_device_copies_of_a_step_are_contiguous(monkeypatch):
    """The staging copy and the read back of every bucket, the largest and the smaller ones, copy between
    contiguous tensors: torch copies a strided one between host and device through a pageable temporary, and a
    copy into pageable memory returns only once the device has run the step (the step run ahead would not be)."""
    copies, copy_ = [], torch.Tensor.copy_

    def recorded(self, src, non_blocking=False):
        if non_blocking:
            copies.append((tuple(self.shape), self.is_contiguous() and src.is_contiguous()))
        return copy_(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recorded)
    e = engine(tiny_model(), max_num_seqs=24)
    e.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5), [12, 2, 7, 4])
    backs = {shape for shape, _ in copies if len(shape) == 2 and shape[0] == 2}  # [2, bucket]: the read backs
    assert len(backs) > 2 and max(backs)[1] == e.decoder.buckets[-1]  # several buckets, the largest among them
    assert copies and all(ok for _, ok in copies)


def test_steps_run_ahead_in_a_stream_of_rounds_and_weight_updates():
    """An engine stream runs ahead within a round of engine steps and reads the last step back before the round
    ends, so groups, tokens, log-probs and versions equal those of steps read back one by one, across rounds with
    partial rollouts under new weights."""
    from twinplane.rollout.sequence import sample_seed
    from twinplane.rollout.stream import EngineStream, GroupRequest, StreamRequest

    sp, new = SamplingParams(temperature=1.0, max_new_tokens=16, n=2), tiny_model(seed=4)
    runs = []
    for run_ahead in (True, False):
        e = engine(tiny_model(), run_ahead=run_ahead)
        stream = EngineStream(e, StreamRequest(sp, max_groups=8, max_prompt_len=16))
        stream.add([GroupRequest(i, p, [sample_seed(5, i, j) for j in range(sp.n)]) for i, p in enumerate(PROMPTS)])
        done = stream.advance(steps=4) + stream.advance(steps=3)
        e.load_weights(new.named_parameters(), version=1)  # (the stream requeues what is in flight)
        done += stream.advance(until_groups=1) + stream.advance()
        runs.append(([s for g in done for s in g], e.pop_stats().ahead_steps))
    (got, ahead_steps), (want, none) = runs
    assert_same(got, want)
    assert [s.versions for s in got] == [s.versions for s in want] and ahead_steps > 3 and none == 0
    assert any(1 in s.versions and 0 in s.versions for s in got)  # partial rollouts continued under new weights


def test_nothing_runs_ahead_of_a_tool_call():
    """A sample that stops at a tool call goes on after the tool's output, drawing from its random stream: no step
    runs ahead of it (its wasted row would have drawn a number), so samples equal steps read back one by one."""
    import string

    from twinplane.rollout import MultiTurnRollout
    from twinplane.rollout.sequence import sample_seed
    from twinplane.rollout.stream import EngineStream, GroupRequest, StreamRequest
    from twinplane.rollout.tools import build_tools
    from twinplane.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(string.printable)
    model, sp = tiny_model(vocab_size=tok.vocab_size), SamplingParams(temperature=1.0, max_new_tokens=40, n=3)
    # the random model's favourite character ends a call, so calls happen
    probe = engine(model, "eager", eos_token_id=tok.eos_token_id).generate([tok.encode("2+3=")], sp)
    counts = torch.bincount(torch.tensor([t for s in probe for t in s.token_ids]), minlength=tok.vocab_size)
    counts[tok.eos_token_id] = 0
    call_end, runs = tok.decode([int(counts.argmax())], skip_special_tokens=False), []
    for run_ahead in (True, False):
        e = engine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, run_ahead=run_ahead)
        turns = MultiTurnRollout(e, tok, build_tools(["calculator"]), max_turns=3, call_start="#", call_end=call_end)
        stream = EngineStream(e, StreamRequest(sp, max_groups=4, max_prompt_len=8), turns)
        stream.add([GroupRequest(i, tok.encode(p), [sample_seed(1, i, j) for j in range(3)])
                    for i, p in enumerate(["2+3=", "hello", "x"])])
        samples = [s for g in stream.advance() for s in g]
        runs.append((samples, e.pop_stats()))
    (got, a), (want, b) = runs
    assert_same(got, want)
    assert a.ahead_steps == 0 and a.graph_steps == b.graph_steps > 10 and any(s.num_tool_calls for s in got)


def test_weight_sync_in_place_and_outputs_follow_the_new_weights():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    static, eager = engine(a), engine(b, "eager")
    greedy = SamplingParams(temperature=0, max_new_tokens=10, n=2)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=9)
    before = static.generate(PROMPTS, greedy)
    ptrs = [p.data_ptr() for p in static.model.parameters()]
    static.load_weights(b.named_parameters(), version=3)
    assert [p.data_ptr() for p in static.model.parameters()] == ptrs  # copied in place: graphs' pointers stay valid
    after = static.generate(PROMPTS, greedy)
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    assert_same(after, eager.generate(PROMPTS, greedy))
    assert all(s.weight_version == 3 for s in after)
    for s in after:
        assert s.token_ids == greedy_no_cache(b, PROMPTS[s.request_index], 10)
    assert_same(static.generate(PROMPTS, sampled), eager.generate(PROMPTS, sampled))
    assert static.pop_metrics()["rollout/engine_steps_graphed"] > 10


def test_options_platform_choice_and_fallbacks(monkeypatch):
    cfg = load_config(None, ["rollout.graphs=false", "rollout.graph_max_batch=64"])
    opts = engine_options(cfg.rollout)
    assert opts["graphs"] is False and opts["graph_max_batch"] == 64
    model = tiny_model()
    assert RolloutEngine(model, EOS, **opts).graph_backend == "eager"
    if not torch.cuda.is_available():  # CPU: no graphs, so no block reserved for padding rows
        e = RolloutEngine(model, EOS, kv_cache_bytes=3 * bytes_per_block(model.config, 16, torch.float32))
        assert e.graph_backend == "eager"
        e.generate(PROMPTS, SamplingParams(max_new_tokens=24))
        assert e.blocks.num_blocks == 3
    for bad, msg in ((["rollout.graph_max_batch=-1"], r"rollout.graph_max_batch: must be in 0..1024 \(0 = "),
                     (["rollout.graphs=maybe"], "rollout.graphs: expected true/false")):
        with pytest.raises(ConfigError, match=msg):
            load_config(None, bad)
    with pytest.raises(ValueError, match="graph_max_batch"):
        RolloutEngine(model, EOS, graph_max_batch=-1)
    assert RolloutEngine(model, EOS, max_num_seqs=48).graph_max_batch == 48  # the default follows max_num_seqs
    moe = tiny_moe()
    assert decode_graphs.decode_mode("static", moe, record_routing=False) == "static"
    assert decode_graphs.decode_mode("static", moe, record_routing=True) == "eager"  # the record is host-side
    monkeypatch.setattr(backends, "grouped_mm_ok", lambda *a, **k: False)
    assert decode_graphs.decode_mode("cuda_graph", moe, record_routing=False) == "eager"  # the loop reads counts
    assert decode_graphs.decode_mode("cuda_graph", model, record_routing=False) == "cuda_graph"
    with pytest.raises(ValueError, match="decode graph mode"):
        decode_graphs.decode_mode("graphs", model, False)


def test_failed_capture_warns_and_decodes_eagerly():
    """Here a capture fails for want of CUDA; on a GPU an op that cannot be captured would fail the same way."""
    model = tiny_model()
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=2)
    e = engine(model, "cuda_graph")
    with pytest.warns(UserWarning, match="capturing the decode graph of batch .* failed"):
        got = e.generate(PROMPTS, sp)
    assert e.graph_backend == "eager" and e.pop_metrics()["rollout/engine_steps_graphed"] == 0
    assert_same(got, engine(model, "eager").generate(PROMPTS, sp))


def test_record_routing_stays_eager_and_keeps_its_record():
    moe = tiny_moe()
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    e = engine(moe, record_routing=True)
    got = e.generate(PROMPTS, sp)
    assert e.pop_metrics()["rollout/engine_steps_graphed"] == 0
    assert all(s.routing is not None and (s.routing[:-1] >= 0).all() for s in got)


class FakeStream:
    def __init__(self, device=None):
        self.waits = 0

    def wait_stream(self, other):
        self.waits += 1


class FakeGraph:
    """A stand-in for torch.cuda.CUDAGraph on CPU: `replay` re-runs the step that was captured (set below)."""

    capturing = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        FakeGraph.capturing = self

    def capture_end(self):
        FakeGraph.capturing = None


@pytest.mark.parametrize("keep_pool", [True, False])
def test_capture_bookkeeping_with_a_stand_in_for_cuda_graphs(keep_pool, monkeypatch):
    """The cuda_graph mode's bookkeeping on CPU, replays giving the eager engine's outputs. An engine that keeps its
    pool captures each bucket once in its lifetime: later calls that fit replay the same graphs, also after a
    weight sync. One that releases its pool after each call (a trainer shares the device) captures each bucket once
    per call, on the engine's one side stream, with warm-up runs only for shapes it has not decoded before."""
    main = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool",))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    run, calls = DecodeGraphs.run, {"warmup": 0, "capture": 0}

    def recorded(self, size, key):
        graph = FakeGraph.capturing
        out = run(self, size, key)
        calls["capture" if graph else "warmup"] += 1
        if graph is not None:
            graph.replay = lambda: out.copy_(run(self, size, key))
        return out

    monkeypatch.setattr(DecodeGraphs, "run", recorded)
    captures, capture = [], DecodeGraphs._capture
    monkeypatch.setattr(DecodeGraphs, "_capture",
                        lambda self, size, key: captures.append((size, key)) or capture(self, size, key))
    counts = rows_checked(monkeypatch)
    model, sp = tiny_model(), SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5)
    graphed, eager = engine(model, "cuda_graph", keep_pool=keep_pool), engine(model, "eager")
    want, first = eager.generate(PROMPTS, sp), None
    for call in range(3):
        if call == 2:  # in place, as a weight sync loads them
            for e in (graphed, eager):
                e.load_weights(tiny_model(seed=1).named_parameters())
            want = eager.generate(PROMPTS, sp)
        captures.clear()
        calls.update(warmup=0, capture=0)
        assert_same(graphed.generate(PROMPTS, sp), want)
        assert len(set(captures)) == len(captures) == calls["capture"]
        assert captures != [] if call == 0 or not keep_pool else captures == []
        assert calls["warmup"] == (decode_graphs.WARMUP_RUNS * len(captures) if call == 0 else 0)
        assert graphed.pop_metrics()["rollout/engine_steps_graphed"] > 5
        if keep_pool:  # the same static decode and pool, their graphs replayed
            first = first or graphed.decoder
            assert graphed.decoder is first and graphed.decoder.kv is graphed.kv
        else:
            assert graphed.decoder is None and graphed.kv is None
    assert isinstance(graphed.warmth.stream, FakeStream) and graphed.warmth.stream is not main
    assert counts["advanced"] > counts["staged"] > 0  # most rows continue on the device between steps
    assert counts["ahead"] > 0  # steps ran ahead where their bucket was captured already,
    assert counts["refused"] > 0  # and were read back first where it was not (then captured as usual)


# --- GPUs: the captured graphs ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_captured_graphs_equal_eager_before_and_after_weight_sync(monkeypatch):
    a, b = tiny_model(seed=0).cuda(), tiny_model(seed=1).cuda()
    graphed = RolloutEngine(copy.deepcopy(a), eos_token_id=EOS)
    assert graphed.graph_backend == "cuda_graph"
    eager = RolloutEngine(copy.deepcopy(a), eos_token_id=EOS, graphs=False)
    captures, capture = [], DecodeGraphs._capture
    monkeypatch.setattr(DecodeGraphs, "_capture",
                        lambda self, size, key: captures.append((size, key)) or capture(self, size, key))
    greedy = SamplingParams(temperature=0, max_new_tokens=16, n=3)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=4)
    for sp in (greedy, sampled):
        assert_same(graphed.generate(PROMPTS, sp), eager.generate(PROMPTS, sp), atol=1e-4)
    assert captures and len(set(captures)) == len(captures)  # each (bucket, sampler) once in the engine's lifetime
    assert graphed.pop_metrics()["rollout/engine_steps_graphed"] > 10 and graphed.graph_backend == "cuda_graph"
    for e in (graphed, eager):
        e.load_weights(b.named_parameters())
    for sp in (greedy, sampled):
        assert_same(graphed.generate(PROMPTS, sp), eager.generate(PROMPTS, sp), atol=1e-4)
    assert len(captures) == len(set(captures))  # the weight sync kept every graph
    for s in graphed.generate(PROMPTS, greedy):
        assert s.token_ids == greedy_no_cache(b, PROMPTS[s.request_index], 16)


@pytest.mark.gpu
def test_a_captured_graph_reads_weights_loaded_in_place():
    from twinplane.rollout.kv_cache import KVCache

    a, b = tiny_model(seed=0).cuda(), tiny_model(seed=1).cuda()
    model = copy.deepcopy(a)
    kv = KVCache(model.config, 5, 16, torch.float32, torch.device("cuda"))
    dec = DecodeGraphs(model, kv, "cuda_graph", "sdpa", 2, 8, 8)
    key = decode_graphs.sampling_key(SamplingParams(temperature=1.0), frozenset())
    assert dec._capture(4, key)
    graph, out = dec.graphs[4, key]
    # 4 one-token sequences, staged: reset, live, no ban, a uniform's bits, own row, new table, then the state row
    # (token, position 0, the slot: worked out on the device, context 1, the table: block i, then padding)
    u = torch.tensor([0.5], dtype=torch.float64).view(torch.long).item()
    rows = torch.tensor([[1, 1, 0, u, i, 1, 5 + i, 0, 0, 1, i, 4] for i in range(4)], device="cuda")
    assert rows.shape[1] == dec.staged.shape[1] and decode_graphs.STATE == 6

    def replayed():
        dec.staged[:4].copy_(rows)
        graph.replay()
        return out.clone()

    def eager():
        dec.staged[:4].copy_(rows)
        return dec.run(4, key)

    first = replayed()
    assert dec.inputs[:4, decode_graphs.POS].tolist() == [1] * 4  # advanced on the device
    torch.testing.assert_close(first, eager(), atol=1e-5, rtol=0)
    from twinplane.model import load_weights

    load_weights(model, b.named_parameters())
    second = replayed()
    torch.testing.assert_close(second, eager(), atol=1e-5, rtol=0)
    assert not torch.allclose(second[1], first[1])

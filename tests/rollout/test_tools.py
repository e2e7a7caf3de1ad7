"""Tools, engine stop sequences and multi-turn rollouts.

References: Python's own arithmetic for the calculator, the unconstrained greedy run for stop sequences, a
scripted engine (fixed replies, so every branch of the driver is exercised deterministically) and the
trainer's full-sequence recomputation for the real engine's multi-turn log-probs.
"""

import builtins
import copy
import random
import socket
import string
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_multi_turn_logprobs_match_trainer, tiny_model

from twinplane.rollout import MultiTurnRollout, RolloutEngine, Sample, SamplingParams, multi_turn_metrics
from twinplane.rollout.sequence import Sequence
from twinplane.rollout.tools import Calculator, PythonTool, ToolResult, build_tools
from twinplane.sandbox import SandboxUnavailable, get_sandbox
from twinplane.tokenizer import build_char_tokenizer


@pytest.fixture
def sandbox():
    """The python tool needs the bwrap sandbox; where it cannot start (no user namespaces) these tests skip."""
    try:
        return get_sandbox("bwrap")
    except SandboxUnavailable as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expr,want", [
    ("2+3", "5"), ("2 + 3 * 4", "14"), ("(2+3)*4", "20"), ("2**3**2", "512"), ("-2**2", "-4"), ("+-+3", "-3"),
    ("7//2", "3"), ("-7//2", "-4"), ("7 % 3", "1"), ("-7 % 3", "2"), ("7/2", "3.5"), ("6/3", "2"),
    ("0.1 + 0.2", "0.3"), ("2**-1", "0.5"), ("10**20", "100000000000000000000"), ("1_000 * 3", "3000"),
    ("((1))", "1"), ("1.5e3 - 1", "1499"),
])
def test_calculator_hand_cases(expr, want):
    assert Calculator()(expr) == ToolResult(want, False)


def test_calculator_matches_python_arithmetic():
    """Random expressions against Python's evaluation of the same text (the reference is allowed eval)."""
    rng = random.Random(0)

    def expr(depth):
        if depth == 0 or rng.random() < 0.3:
            return str(rng.randint(0, 50)) if rng.random() < 0.8 else f"{rng.uniform(0, 9):.2f}"
        if rng.random() < 0.15:
            return f"-({expr(depth - 1)})"
        return f"({expr(depth - 1)} {rng.choice(['+', '-', '*', '/', '//', '%'])} {expr(depth - 1)})"

    checked = 0
    for _ in range(300):
        e = expr(4)
        try:
            want = eval(e)
        except ZeroDivisionError:
            assert Calculator()(e) == ToolResult("error: division by zero", True)
            continue
        got = Calculator()(e)
        assert not got.error, e
        assert got.output == (f"{want:.12g}" if isinstance(want, float) else str(want)), e
        checked += 1
    assert checked > 200


@pytest.mark.parametrize("expr", [
    "1/0", "1//0", "5 % 0", "0**-1", "x + 1", "__import__('os')", "().__class__", "(1).real", "abs(-1)",
    "'a' * 3", "True + 1", "1j", "[1, 2]", "1 if 1 else 2", "1 < 2", "lambda: 1", "a = 1", "2 ** 10 ** 10",
    "9**9**9", "(10**1000) * (10**1000)", "10.0 ** 400", "1e308 * 10", "(-8) ** 0.5", "1 +", "", "1 " + "+ 1 " * 150,
    "(" * 150 + "1" + ")" * 150, "1 << 3", "1 & 1",
])
def test_calculator_errors(expr, monkeypatch):
    def no_eval(*args, **kwargs):
        raise AssertionError("the calculator must not use eval/exec")

    monkeypatch.setattr(builtins, "eval", no_eval)
    monkeypatch.setattr(builtins, "exec", no_eval)
    t0 = time.perf_counter()
    r = Calculator()(expr)
    assert r.error and r.output.startswith("error:"), (expr, r)
    assert time.perf_counter() - t0 < 0.5  # huge powers are refused, not computed


def test_build_tools(sandbox):
    tools = build_tools(["calculator", "python"])
    assert isinstance(tools["calculator"], Calculator) and isinstance(tools["python"], PythonTool)
    with pytest.raises(ValueError, match="unknown tools"):
        build_tools(["shell"])


# ---------------------------------------------------------------------------------------------- python tool


def test_python_tool_runs_and_prints(sandbox):
    assert PythonTool()("print('hi', 6 * 7)") == ToolResult("hi 42", False)
    r = PythonTool()("def f():\n    raise KeyError('boom')\nf()")
    assert r.error and r.output.startswith("error: exit code 1") and r.output.endswith("KeyError: 'boom'")


def test_python_tool_limits(sandbox):
    t0 = time.perf_counter()
    r = PythonTool(timeout_s=20, cpu_s=1)("while True:\n    pass")
    assert r.error and "CPU time" in r.output and time.perf_counter() - t0 < 5
    t0 = time.perf_counter()
    r = PythonTool(timeout_s=1)("import time\nprint('before', flush=True)\ntime.sleep(60)")
    assert r.error and "wall-clock" in r.output and "before" in r.output and time.perf_counter() - t0 < 4
    r = PythonTool(memory_mb=256)("x = bytearray(4 * 1024**3)\nprint(len(x))")
    assert r.error and "MemoryError" in r.output


def test_python_tool_truncates_output(sandbox):
    r = PythonTool(max_output_chars=300)("print('START' + 'a' * 10000 + 'END')")
    assert not r.error and len(r.output) <= 300
    assert r.output.startswith("START") and r.output.endswith("END") and "truncated" in r.output


def test_python_tool_runs_in_a_fresh_work_dir_with_a_clean_env(monkeypatch, sandbox):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    marker = "twinplane_tool_marker.txt"
    tool = PythonTool()
    r = tool(f"import os\nopen({marker!r}, 'w').write('x')\nprint(os.getcwd())\n"
             "print(sorted(k for k in os.environ if 'PROXY' in k.upper()))")
    cwd, proxies = r.output.splitlines()
    assert not r.error and proxies == "[]"
    assert not tool("import os\nprint(os.listdir('.'))").output.count(marker)  # each call starts empty
    assert not Path(marker).exists() and not (Path(__file__).parents[2] / marker).exists()


def test_python_tool_has_no_network(sandbox):
    """A server is listening on localhost; under bwrap the tool's network namespace has no route to it."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        port = server.getsockname()[1]
        for code in [f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                     f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))"]:
            r = PythonTool()(code)
            assert r.error and ("ConnectionRefusedError" in r.output or "unreachable" in r.output), r.output
        with pytest.raises(TimeoutError):
            server.accept()


# ---------------------------------------------------------------------------------------------- engine stops

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


def first_stop(tokens, seq, min_new=0):
    """Length of the shortest prefix ending with `seq` whose last token is at index >= min_new, or None."""
    return next((j for j in range(max(len(seq), min_new + 1), len(tokens) + 1) if tokens[j - len(seq):j] == seq),
                None)


def test_engine_stop_sequences():
    engine = RolloutEngine(tiny_model(), eos_token_id=None)
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    free = engine.generate(PROMPTS, greedy)
    assert all(s.loss_mask == [1] * 16 and (s.num_turns, s.num_tool_calls, s.num_tool_errors) == (1, 0, 0)
               for s in free)  # a plain generation is one all-model turn
    seq = free[0].token_ids[3:5]
    never = [free[0].token_ids[0]] * 17  # longer than any output
    same = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16, stop_sequences=[never]))
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in same] == \
           [(s.token_ids, s.logprobs, s.finish_reason) for s in free]
    for min_new in [0, 5]:
        sp = SamplingParams(temperature=0, max_new_tokens=16, min_new_tokens=min_new, stop_sequences=[never, seq])
        stopped = engine.generate(PROMPTS, sp)
        assert first_stop(free[0].token_ids, seq, min_new) is not None or min_new > 0
        for s, f in zip(stopped, free, strict=True):
            cut = first_stop(f.token_ids, seq, min_new)
            assert s.token_ids == f.token_ids[:cut]  # log-probs agree to fp32 noise: compaction changes batches
            torch.testing.assert_close(s.logprobs, f.logprobs[:cut], atol=1e-5, rtol=0)
            assert s.finish_reason == ("length" if cut is None else "stop")
            if cut is not None:
                assert s.token_ids[-2:] == seq  # kept in the output
    with pytest.raises(ValueError):
        SamplingParams(stop_sequences=[[]])


def test_a_stop_sequence_matches_generated_tokens_only():
    seq = Sequence([1, 2], 0, SamplingParams(max_new_tokens=8, stop_sequences=[[2, 5]]), [0])
    seq.append(5, 0.0)  # [2, 5] ends the tokens, but its 2 is the prompt's
    assert seq.finish_reason is None
    seq.append(2, 0.0)
    seq.append(5, 0.0)
    assert seq.finish_reason == "stop"


# ---------------------------------------------------------------------------------------------- multi-turn driver

ALPHABET = string.printable
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call>'


class ScriptedEngine:
    """Test double for the engine: replies are scripted per prompt text and per number of tool outputs (`marker`)
    seen; honours n, max_new_tokens and stop_sequences like the engine and records every call."""

    def __init__(self, tok, script, marker="<tool_response>"):
        self.tok, self.script, self.marker, self.calls = tok, script, marker, []

    def generate(self, prompts, sampling, max_new_tokens=None):
        self.calls.append(([list(p) for p in prompts], sampling, max_new_tokens))
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p, skip_special_tokens=False)
            reply = self.script[text.split("|")[0]][text.count(self.marker)]
            ids = self.tok.encode(reply) + [self.tok.eos_token_id]
            cut = [first_stop(ids, s) for s in sampling.stop_sequences]
            end = min([c for c in cut if c is not None], default=len(ids))
            cap = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens[i]
            reason = "stop" if end <= cap else "length"
            ids = ids[:min(end, cap)]
            for _ in range(sampling.n):
                out.append(Sample(i, list(p), ids, [-0.5 - 0.01 * t for t in ids], reason, 7))
        return out


def rollout(script, tools=None, max_turns=4, budget=400, n=1, prompts=("A|",), **kw):
    tok = build_char_tokenizer(ALPHABET)
    engine = ScriptedEngine(tok, script)
    mt = MultiTurnRollout(engine, tok, build_tools(["calculator"]) if tools is None else tools, max_turns, **kw)
    samples = mt.generate([tok.encode(p) for p in prompts], SamplingParams(max_new_tokens=budget, n=n))
    return tok, engine, samples


def segments(tok, s):
    """The response split into (text, is_model) runs of equal loss_mask."""
    out, start = [], 0
    for j in range(1, len(s.token_ids) + 1):
        if j == len(s.token_ids) or s.loss_mask[j] != s.loss_mask[start]:
            out.append((tok.decode(s.token_ids[start:j], skip_special_tokens=False), bool(s.loss_mask[start])))
            start = j
    return out


def test_tool_call_round_trip():
    tok, engine, [s] = rollout({"A": ["Let me compute." + CALL, "It is 14."]})
    assert segments(tok, s) == [("Let me compute." + CALL, True), ("<tool_response>14</tool_response>", False),
                                ("It is 14.<eos>", True)]
    assert (s.num_turns, s.num_tool_calls, s.num_tool_errors, s.finish_reason) == (2, 1, 0, "stop")
    assert len(s.logprobs) == len(s.loss_mask) == len(s.token_ids) and s.weight_version == 7
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if not m)
    assert [lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m] == \
           [-0.5 - 0.01 * t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
    # tokens in, tokens out: the continuation prompt is exactly prompt + everything so far
    (p1, sp1, _), (p2, sp2, caps) = engine.calls
    assert p2 == [p1[0] + tok.encode("Let me compute." + CALL + "<tool_response>14</tool_response>")]
    assert sp1.stop_sequences == [tok.encode("</tool_call>")] and sp2.n == 1 and sp2.seed is None
    assert sp2.max_new_tokens == caps[0] == 400 - len(p2[0]) + len(p1[0])


@pytest.mark.parametrize("call,error,shown", [
    ('<tool_call>{"name": "calculator", "arguments": "7*6"}</tool_call>', False, "42"),
    ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>', True, "error: unknown tool"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>', True,
     "error: division by zero"),
    ('<tool_call>{"name": "calculator", "arguments": {"x": 1, "y": 2}}</tool_call>', True, "string argument"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "2*2"}}</tool_call>', False, "4"),  # sole entry
    ("<tool_call>{'name': 'calculator'}</tool_call>", True, "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', True, "must be"),
    ('oops</tool_call>', True, "without a preceding"),
])
def test_tool_call_variants_and_errors(call, error, shown):
    tok, _, [s] = rollout({"A": [call, "done"]})
    model1, (tool_text, is_model), model2 = segments(tok, s)
    assert model1 == (call, True) and not is_model and model2 == ("done<eos>", True)
    assert tool_text.startswith("<tool_response>" + ("error: " if error else "")) and shown in tool_text
    assert (s.num_tool_calls, s.num_tool_errors, s.num_turns) == (1, int(error), 2)


def test_max_turns_and_batching():
    script = {"A": [CALL] * 5, "B": ["no tools"], "C": [CALL, CALL, "ok"]}
    tok, engine, samples = rollout(script, max_turns=3, n=2, prompts=("A|", "B|", "C|"))
    assert [s.request_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [(s.num_turns, s.num_tool_calls, s.finish_reason) for s in samples] == \
           [(3, 2, "max_turns")] * 2 + [(1, 0, "stop")] * 2 + [(3, 2, "stop")] * 2
    assert segments(tok, samples[0])[-1] == (CALL, True)  # the last turn's call is not run
    # one engine call per turn, with only the live samples, n=1 after the first
    assert [len(p) for p, _, _ in engine.calls] == [3, 4, 4] and [sp.n for _, sp, _ in engine.calls] == [2, 1, 1]
    m = multi_turn_metrics(samples)
    assert m["rollout/turns_mean"] == pytest.approx(14 / 6) and m["rollout/tool_calls_mean"] == pytest.approx(8 / 6)
    assert m["rollout/tool_errors_mean"] == 0 and m["rollout/max_turns_reached"] == pytest.approx(1 / 3)
    tool_tokens = sum(s.loss_mask.count(0) for s in samples)
    assert m["rollout/tool_token_frac"] == pytest.approx(tool_tokens / sum(len(s.token_ids) for s in samples))


def test_budget_covers_tool_tokens():
    # tool output cut at the budget: finish "length", the model gets no further turn
    budget = len(CALL) + 8
    tok, engine, [s] = rollout({"A": [CALL, "never"]}, budget=budget)
    assert len(s.token_ids) == budget and s.finish_reason == "length" and len(engine.calls) == 1
    assert segments(tok, s)[1] == ("<tool_response>"[:8], False)
    # continuation turns capped at each sample's own budget (the engine's per-request max_new_tokens)
    budget = len(CALL) + len("<tool_response>14</tool_response>") + 12
    tok, engine, samples = rollout({"A": [CALL, "a long answer"], "D": ["wxyz" + CALL, "a long answer"]},
                                   budget=budget, prompts=("A|", "D|"))
    assert engine.calls[1][1].max_new_tokens == 12 and engine.calls[1][2] == [12, 8]
    assert [segments(tok, s)[-1] for s in samples] == [("a long answe", True), ("a long a", True)]
    assert all(len(s.token_ids) == budget and s.finish_reason == "length" for s in samples)


def test_custom_template_special_call_tokens_and_odd_output():
    """Qwen-style: <tool_call>/</tool_call> are single special tokens; a chat template wraps the output; a tool
    returning characters the char tokenizer lacks still goes through (as '?'), a raising tool is an error."""
    tok = build_char_tokenizer(ALPHABET)
    tok.tok.add_special_tokens(["<tool_call>", "</tool_call>"])

    class Echo:
        name, parameter = "echo", "text"

        def __call__(self, arguments):
            if arguments == "raise":
                raise RuntimeError("bug")
            return ToolResult(arguments + " caf\u00e9")

    script = {"A": ['<tool_call>{"name": "echo", "arguments": "hi"}</tool_call>',
                    '<tool_call>{"name": "echo", "arguments": "raise"}</tool_call>', "bye"]}
    engine = ScriptedEngine(tok, script, marker="<user>")
    mt = MultiTurnRollout(engine, tok, {"echo": Echo()}, max_turns=3, output_template="\n<user>{output}</user>\n")
    assert mt.call_end_ids == [tok.token_id("</tool_call>")]
    [s] = mt.generate([tok.encode("A|")], SamplingParams(max_new_tokens=200))
    texts = [t for t, _ in segments(tok, s)]
    assert texts[1] == "\n<user>hi caf?</user>\n" and texts[3].startswith("\n<user>error: echo failed: RuntimeError")
    assert (s.num_tool_calls, s.num_tool_errors, s.num_turns, s.finish_reason) == (2, 1, 3, "stop")


# ---------------------------------------------------------------------------------------------- real engine


def test_real_engine_multi_turn_logprobs_match_trainer():
    """Continuing from prompt + model tokens + tool tokens must score exactly like the trainer's one forward
    over the whole sequence: the tokens-in/tokens-out guarantee, checked at the model's tokens."""
    tok = build_char_tokenizer(ALPHABET)
    model = tiny_model(vocab_size=tok.vocab_size)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = [tok.encode(p) for p in ["2+3=", "hello", "x"]]
    sp = SamplingParams(temperature=0.8, max_new_tokens=160, n=4, seed=3)
    # the random model has no idea of the format: use its favourite character as the call end, so calls happen
    plain = engine.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=30, n=4, seed=3))
    counts = torch.bincount(torch.tensor([t for s in plain for t in s.token_ids]), minlength=tok.vocab_size)
    counts[tok.eos_token_id] = 0
    call_end = tok.decode([int(counts.argmax())], skip_special_tokens=False)
    mt = MultiTurnRollout(engine, tok, build_tools(["calculator"]), max_turns=3, call_start="#", call_end=call_end)
    samples = mt.generate(prompts, sp)
    assert any(s.num_turns >= 2 for s in samples) and any(0 in s.loss_mask for s in samples)
    assert all(s.num_tool_errors == s.num_tool_calls for s in samples)  # no "#" JSON from a random model
    # every block is back in the pool after a generate that stopped inside tool calls
    assert engine.blocks.num_free == engine.blocks.num_blocks and not any(engine.blocks.ref)
    assert [s.token_ids for s in mt.generate(prompts, sp)] == [s.token_ids for s in samples]  # seeded

    batch = assert_multi_turn_logprobs_match_trainer(model, samples, tok.pad_token_id, 0.8)
    assert (batch.rollout_logprobs[~batch.response_mask.bool()] == 0).all()


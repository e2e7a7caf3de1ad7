"""Rewards: verifiers on hand-written cases and on GSM8K's own solutions, the sandboxed runner against functions
that raise / return NaN or None / hang / crash, and the reward model against transformers' classifier."""

import json
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from twinplane.rewards import RewardRunner, exact_int, format_ok, get_reward, last_boxed, score
from twinplane.tokenizer import build_char_tokenizer

GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.parametrize("completion,answer,mode,expected", [
    ("so she makes 9 * 2 = $18 a day.\n#### 18", "18", "strict", 1.0),
    ("so she makes 9 * 2 = $18 a day.\n#### 18", "18", "flexible", 1.0),
    ("she makes 18 dollars", "18", "strict", 0.0),  # strict needs '####'
    ("she makes 18 dollars", "18", "flexible", 1.0),
    ("#### 18\nand then 5 more", "18", "strict", 1.0),  # strict: the number after '####'
    ("#### 18\nand then 5 more", "18", "flexible", 0.0),  # flexible: the last number
    ("The total is 1,000.", "1000", "flexible", 1.0),
    ("#### 1,000", "1000", "strict", 1.0),
    ("#### 1000", "1,000", "strict", 1.0),
    ("it costs $3.50.", "3.5", "flexible", 1.0),
    ("#### $3.50", "3.5", "strict", 1.0),
    ("the change is -2", "-2", "flexible", 1.0),
    ("#### -2", "-2", "strict", 1.0),
    ("the change is 2", "-2", "flexible", 0.0),
    ("between 2000-2010", "2010", "flexible", 1.0),  # a range's hyphen is not a minus sign
    ("#### 72.", "72", "strict", 1.0),
    ("#### 72.0", "72", "strict", 1.0),
    ("it is 0.5", "0.50", "flexible", 1.0),
    ("7 apples", "7.1", "flexible", 0.0),
    ("no number here", "7", "flexible", 0.0),
    ("", "7", "strict", 0.0),
    # references in GSM8K's own format: a worked solution ending in '#### N'
    ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72", "strict", 1.0),
    ("so 24 + 48 = 72", "Natalia sold 24 clips.\n#### 72", "flexible", 1.0),
    ("so 24", "Natalia sold 24 clips.\n#### 72", "flexible", 0.0),
    ("#### 1000", "work\n#### 1,000", "strict", 1.0),
])
def test_gsm8k_cases(completion, answer, mode, expected):
    assert score("gsm8k", [completion], [answer], mode=mode) == [expected]


def test_gsm8k_default_is_flexible_and_bad_options_fail():
    assert score("gsm8k", ["the answer is 5"], ["5"]) == [1.0]
    with pytest.raises(ValueError, match="mode"):
        score("gsm8k", ["5"], ["5"], mode="lenient")
    with pytest.raises(ValueError, match="gsm8k"):
        score("gsm8k", ["5"], ["5"], tolerance=0.1)  # an option the verifier does not take
    with pytest.raises(ValueError, match="not a number"):
        score("gsm8k", ["5"], ["five"])


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} not present")
def test_gsm8k_reference_solutions_score_themselves():
    solutions = [json.loads(line)["answer"] for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    for mode in ("strict", "flexible"):
        assert score("gsm8k", solutions, solutions, mode=mode) == [1.0] * len(solutions)
    # answers shuffled across problems (a seeded derangement): only coincidences may match
    perm = list(range(len(solutions)))
    rng = random.Random(0)
    while any(i == p for i, p in enumerate(perm)):
        rng.shuffle(perm)
    shuffled = [solutions[p] for p in perm]
    for mode in ("strict", "flexible"):
        assert sum(score("gsm8k", solutions, shuffled, mode=mode)) / len(solutions) <= 0.01


def test_last_boxed():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\boxed{3}}") == r"\boxed{3}"  # the last top-level one
    assert last_boxed(r"\boxed{x^{2}+\{1\}}") == r"x^{2}+\{1\}"  # escaped braces do not nest
    assert last_boxed(r"\boxed {7}") == "7"
    assert last_boxed(r"answer \boxed{\frac{1}{2}") is None  # truncated: no answer
    assert last_boxed("the answer is 1/2") is None


@pytest.mark.parametrize("completion,answer,expected", [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"so \boxed{1/2}", r"\frac12", 1.0),
    (r"so \boxed{\dfrac{1}{2}}.", "1/2", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{\frac{1}{2}} is wrong, \boxed{\frac{1}{3}}", r"\frac{1}{3}", 1.0),  # the last box counts
    (r"\boxed{\frac{1}{\frac{2}{3}}}", r"\frac{3}{2}", 1.0),  # nested braces
    ("the answer is 0.5", "0.5", 0.0),  # no box, no reward
    (r"\boxed{5}", r"The solution... so the answer is $\boxed{5}$.", 1.0),  # a MATH-style reference solution
])
def test_math_equivalence(completion, answer, expected):
    pytest.importorskip("math_verify")
    assert score("math", [completion], [answer]) == [expected]


def test_math_off_the_main_thread():
    """math-verify's own timeouts use SIGALRM (main thread only): elsewhere they are turned off, not an error."""
    pytest.importorskip("math_verify")
    out = []
    t = threading.Thread(target=lambda: out.append(score("math", [r"\boxed{1/2}", r"\boxed{2}"], ["0.5", "3"])))
    t.start()
    t.join()
    assert out == [[1.0, 0.0]]


def test_exact_match_and_exact_int():
    assert score("exact_match", ["  Paris \n", "paris", "Paris"], ["Paris", "Paris", " Paris"]) == [1.0, 0.0, 1.0]
    assert exact_int([" 42", "42.0", "-3", "x"], ["42", "42", "-3", "1"]) == [1.0, 0.0, 1.0, 0.0]
    assert score("exact_int", ["7"], ["7"]) == [1.0]
    assert get_reward("exact_int")(["7", "8"], ["7", "7"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward("nope")


def test_format_weight_adds_exactly_w():
    w = 0.25
    comps = ["#### 5", "#### 6", "the answer is 5", "#### five"]
    base = score("gsm8k", comps, ["5"] * 4, mode="flexible")
    with_fmt = score("gsm8k", comps, ["5"] * 4, mode="flexible", format_weight=w)
    assert [b - a for a, b in zip(base, with_fmt, strict=True)] == [w, w, 0.0, 0.0]
    assert [format_ok("gsm8k", c) for c in comps] == [1.0, 1.0, 0.0, 0.0]
    assert format_ok("math", r"\boxed{x}") == 1.0 and format_ok("math", r"\boxed{x") == 0.0
    assert format_ok("exact_match", "anything") is None  # no format: no bonus
    assert score("exact_match", ["a"], ["a"], format_weight=w) == [1.0]
    with RewardRunner("gsm8k", {"mode": "strict"}, format_weight=w) as runner:
        rewards, metrics = runner(comps, ["5"] * 4)
    assert rewards == [1.0 + w, w, 0.0, 0.0]
    assert runner.last_verifier == [1.0, 0.0, 0.0, 0.0]
    assert metrics == {"reward/errors": 0.0, "reward/format": 0.5}


def test_in_process_builtins_are_protected():
    with RewardRunner("gsm8k") as runner:
        rewards, metrics = runner(["5", "5", "6"], ["5", "not a number", "6"])
    assert rewards == [1.0, 0.0, 1.0]
    assert metrics["reward/errors"] == 1.0 and "reward/timeouts" not in metrics
    assert "not a number" in runner.last_error


USER_FNS = '''
import os
import time

def per_sample(completion, answer, bonus=0.0):
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "nan":
        return float("nan")
    if completion == "none":
        return None
    if completion == "hang":
        while True:
            time.sleep(60)
    if completion == "crash":
        os._exit(3)
    return float(completion == answer) + bonus
'''


def test_runner_survives_bad_samples(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_FNS)
    runner = RewardRunner(f"{path}:per_sample", {"bonus": 0.5}, timeout_s=2.0)
    comps = ["7", "raise", "7", "nan", "none", "hang", "8", "crash", "7"]
    rewards, metrics = runner(comps, ["7"] * len(comps))
    assert rewards == [1.5, 0.0, 1.5, 0.0, 0.0, 0.0, 0.5, 0.0, 1.5]  # samples after the hang/crash still scored
    assert metrics == {"reward/errors": 5.0, "reward/timeouts": 1.0}
    rewards, metrics = runner(["7", "8"], ["7", "7"])  # a fresh worker took over
    assert rewards == [1.5, 0.5] and metrics["reward/errors"] == 0.0
    pid = runner._worker.proc.pid
    runner.close()
    runner.close()  # idempotent
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        runner(["7"], ["7"])


BATCHED_FNS = '''
def flagged(completions, answers):
    return [float(c == a) if c != "nan" else float("nan") for c, a in zip(completions, answers)]
flagged.batched = True

def plain(completions, answers, scale=1.0):
    if "raise" in completions:
        raise ValueError("bad batch")
    return [scale * len(c) for c in completions]
'''


def test_runner_module_function_batched(tmp_path, monkeypatch):
    (tmp_path / "my_batched_rewards.py").write_text(BATCHED_FNS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardRunner("my_batched_rewards:flagged") as runner:  # batched via the function's attribute
        assert runner(["a", "nan", "b"], ["a", "a", "a"]) == ([1.0, 0.0, 0.0], {"reward/errors": 1.0,
                                                                                "reward/timeouts": 0.0})
    with RewardRunner("my_batched_rewards:plain", {"batched": True, "scale": 2.0}) as runner:
        assert runner(["ab", "c"], ["", ""])[0] == [4.0, 2.0]
        rewards, metrics = runner(["raise", "c"], ["", ""])  # a batched call fails as a whole
        assert rewards == [0.0, 0.0] and metrics["reward/errors"] == 2.0
        assert runner(["abc"], [""])[0] == [6.0]
    assert score("my_batched_rewards:plain", ["ab"], [""], batched=True) == [2.0]  # in-process, same spec


def test_unloadable_user_function_fails_fast(tmp_path):
    (tmp_path / "ok.py").write_text("def f(c, a):\n    return 1.0\n")
    for spec in [f"{tmp_path}/missing.py:f", "no_such_module_xyz:f", f"{tmp_path}/ok.py:g", "nope"]:
        with pytest.raises(ValueError) as err:
            RewardRunner(spec)
        assert spec in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="options"):
        RewardRunner(f"{tmp_path}/ok.py:f", {"unknown_option": 1})


def test_runner_math_in_worker():
    pytest.importorskip("math_verify")
    with RewardRunner("math", timeout_s=10.0, format_weight=0.1) as runner:
        rewards, metrics = runner([r"\boxed{\frac{1}{2}}", r"\boxed{1/3}", "0.5"], ["0.5", "0.5", "0.5"])
    assert rewards == pytest.approx([1.1, 0.1, 0.0])
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/format": pytest.approx(2 / 3)}


# ---- reward model -----------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=#.?"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def classifier(request, tmp_path_factory):
    """A random-weight transformers sequence classifier saved with save_pretrained, plus a tokenizer."""
    tok = build_char_tokenizer(ALPHABET)
    cfg_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForSequenceClassification"),
                          "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification")}[request.param]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=2, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # larger-than-default weights, random norms/biases: every path matters to the score
        for n, p in ref.named_parameters():
            p.normal_(0, 0.3 if ("norm" in n or n.endswith("bias")) else 0.1)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    tok.save(path)
    return path, ref, tok


def test_reward_model_matches_transformers(classifier):
    from twinplane.rewards.reward_model import RewardModel

    path, ref, tok = classifier
    texts = ["what is 2+3? 5", "hi", "a longer text with several words in it #### 42.", "x<pad>"]
    rm = RewardModel(path, device="cpu", batch_size=3)
    ids = [tok.encode(t, add_special_tokens=True) for t in texts]
    width = max(map(len, ids))
    x = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    with torch.no_grad():
        expected = ref(input_ids=x, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(torch.tensor(rm(texts)), expected, atol=1e-4, rtol=0)


def test_runner_adds_reward_model_score(classifier):
    from twinplane.rewards.reward_model import RewardModel

    path, _, _ = classifier
    rm = RewardModel(path, device="cpu")
    prompts, comps = ["what is 2+3? ", "name a color. "], ["5", "blue"]
    with RewardRunner("exact_match", reward_model=str(path), reward_model_weight=0.5) as runner:
        rewards, metrics = runner(comps, ["5", "red"], prompts)
    expected = [1.0 + 0.5 * s for s in rm([prompts[0] + comps[0]])] + [0.5 * s for s in rm([prompts[1] + comps[1]])]
    assert rewards == pytest.approx(expected, abs=1e-5)
    assert set(metrics) == {"reward/errors", "reward/model"}


def test_step_deadline_bounds_a_function_that_always_hangs(tmp_path, monkeypatch):
    """20 samples of a function that never returns, 1 s per sample, 2 s per step: each call costs about one
    deadline (not 20 timeouts), every sample scores 0 and is counted, and the worker is replaced once per call
    without importing torch (a restart costs well under a second)."""
    import time

    from twinplane.rewards import worker as worker_mod

    (tmp_path / "hang.py").write_text("import time\ndef f(c, a):\n    time.sleep(600)\n")
    starts = []
    real_start = worker_mod.Worker.start
    monkeypatch.setattr(worker_mod.Worker, "start", lambda self: (starts.append(1), real_start(self))[1])
    with RewardRunner(f"{tmp_path / 'hang.py'}:f", timeout_s=1.0, step_timeout_s=2.0) as runner:
        for _ in range(2):
            t0 = time.perf_counter()
            rewards, m = runner(["1"] * 20, ["1"] * 20)
            took = time.perf_counter() - t0
            assert rewards == [0.0] * 20 and m["reward/errors"] == 20 and m["reward/timeouts"] == 20
            assert m["reward/deadline"] >= 18 and 2.0 <= took < 5.0, (m, took)
    assert len(starts) <= 4  # the first start plus at most one replacement per timeout inside a deadline
    t0 = time.perf_counter()
    w = worker_mod.Worker(f"{tmp_path / 'hang.py'}:f", {})
    w.start()
    w.close()
    assert time.perf_counter() - t0 < 1.5  # no torch import in the worker

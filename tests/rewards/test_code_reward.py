"""The `code` reward and the sandbox seam it runs on.

References: HumanEval's own canonical solutions (must pass) and deliberately wrong programs (must fail),
hand-written MBPP and stdin/stdout tasks with known pass counts, and the unsafe-local backend, which must give
the same results as bwrap on benign programs.
"""

import gzip
import json
import os
import re
import time
from pathlib import Path

import pytest
from conftest import data_path

from twinplane import sandbox as sb
from twinplane.config import ConfigError, load_config
from twinplane.data import DataError, load_code_records
from twinplane.rewards import RewardRunner, score
from twinplane.rewards.code import CodeScorer, extract_program, parse_tests
from twinplane.rollout.tools import PythonTool

HUMANEVAL = data_path("humaneval/HumanEval.jsonl.gz")
needs_humaneval = pytest.mark.skipif(not HUMANEVAL.is_file(), reason="no HumanEval (--data-dir, $TWINPLANE_DATA)")


def bwrap_or_skip():
    try:
        return sb.get_sandbox("bwrap")
    except sb.SandboxUnavailable as e:
        pytest.skip(str(e))


def humaneval():
    rows = [json.loads(line) for line in gzip.open(HUMANEVAL, "rt")]
    answers = [json.dumps({"prompt": r["prompt"], "test": r["test"], "entry_point": r["entry_point"]}) for r in rows]
    return rows, answers


def alive(tag: str) -> list[str]:
    hits = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and tag in (p / "cmdline").read_bytes().decode(errors="ignore"):
                hits.append(p.name)
        except OSError:
            pass
    return hits


@needs_humaneval
def test_humaneval_canonical_pass_and_wrong_programs_fail():
    bwrap_or_skip()
    rows, answers = humaneval()
    canonical = [r["prompt"] + r["canonical_solution"] for r in rows]
    wrong_body = [r["prompt"] + "    return None\n" for r in rows[:40]]
    other = [rows[i + 1]["prompt"] + rows[i + 1]["canonical_solution"] for i in range(40)]  # solves problem i+1
    rewards = score("code", canonical + wrong_body + other, answers + answers[:40] + answers[:40])
    assert rewards[:164] == [1.0] * 164
    assert rewards[164:] == [0.0] * 80


def test_forms_partial_credit_and_fakes():
    bwrap_or_skip()
    mbpp = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1"],
            "test_setup_code": "import math"}
    stdio = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", " 7 ", "11"]}
    he = {"prompt": "def inc(x):\n", "test": "def check(f):\n    assert f(1) == 2\n", "entry_point": "inc"}
    completions = ["```python\ndef add(a, b):\n    return a + b\n```",  # 2 of 3 (the third assert is wrong)
                   "Sure:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n",  # 2 of 3 (5+5=10)
                   "    return x + 1\n",  # continues the prompt
                   "import sys\nsys.exit(0)",  # exits before the tests: not a pass
                   "import os\nos._exit(0)",
                   "print('passed')\ndef add(a, b):\n    raise ValueError"]
    answers = [mbpp, stdio, he, he, he, mbpp]
    scorer = CodeScorer("bwrap", partial=True)
    res = scorer(completions, [json.dumps(a) for a in answers])
    assert [(r.passed, r.total) for r in res] == [(2, 3), (2, 3), (1, 1), (0, 1), (0, 1), (0, 3)]
    assert [r.reward for r in res] == pytest.approx([2 / 3, 2 / 3, 1.0, 0.0, 0.0, 0.0])
    assert res[-1].status == "crash" and res[0].status == "ok"
    assert score("code", completions[:3], answers[:3]) == [0.0, 0.0, 1.0]  # all-or-nothing by default


def test_hang_fork_alloc_flood_score_zero_and_leave_nothing():
    bwrap_or_skip()
    he = json.dumps({"prompt": "", "test": "def check(f):\n    assert f() == 1\n", "entry_point": "f"})
    tag = f"7.{os.getpid()}"
    bad = {"timeout": f"import os\nos.system('sleep 3{tag} &')\ndef f():\n    while True: pass",
           "crash": "import os\ndef f():\n    while True:\n        os.fork()",
           "memory": "def f():\n    x = []\n    while True: x.append(bytes(1 << 30))",
           "flood": "def f():\n    while True: print('y' * 1000)"}
    t0 = time.monotonic()
    res = CodeScorer("bwrap", test_timeout_s=3, timeout_s=8)(list(bad.values()) + ["def f():\n    return 1"],
                                                                [he] * 5)
    assert [r.reward for r in res] == [0.0] * 4 + [1.0]
    assert res[0].status == "timeout" and res[2].status == "memory" and res[3].status == "timeout"
    assert time.monotonic() - t0 < 20
    assert not alive(tag)
    stdio = json.dumps({"inputs": [""], "outputs": ["x"]})
    flood = CodeScorer("bwrap")(["while True: print('y' * 10000)"], [stdio])[0]
    assert flood.reward == 0.0 and flood.status == "output_limit"


def test_unsafe_local_agrees_with_bwrap_on_benign_programs():
    bwrap_or_skip()
    programs = ["print('hi', 6 * 7)", "import json, math\nprint(json.dumps({'r': math.sqrt(2)}))",
                "def f():\n    raise KeyError('boom')\nf()", "import sys\nprint(sys.stdin.read() == '')"]
    def run(name, code):  # the work dir's path differs (/w vs a temp dir); nothing else may
        r = PythonTool(sandbox=name)(code)
        return r.error, re.sub(r'File "[^"]*main.py"', 'File "main.py"', r.output)

    for code in programs:
        assert run("bwrap", code) == run("unsafe-local", code)
    mbpp = json.dumps({"test_list": ["assert sq(3) == 9", "assert sq(0) == 1"]})
    completions = ["def sq(x):\n    return x * x", "def sq(x):\n    return x + x", "def sq(x):\n    return 1 / 0"]
    results = {name: [(r.reward, r.passed, r.status) for r in CodeScorer(name, partial=True)(completions, [mbpp] * 3)]
               for name in ("bwrap", "unsafe-local")}
    assert results["bwrap"] == results["unsafe-local"] == [(0.5, 1, "ok"), (0.0, 0, "ok"), (0.0, 0, "crash")]


def test_sandbox_seam_statuses():
    box = bwrap_or_skip()
    lim = sb.Limits(wall_s=2, cpu_s=1)
    assert box.run({"a.py": "print(input())"}, [box.python, "-I", "a.py"], b"x\n", lim).stdout == b"x\n"
    assert box.run({"a.py": "import time\ntime.sleep(9)"}, [box.python, "-I", "a.py"], None, lim).status == "timeout"
    r = box.run({"a.py": "while True: pass"}, [box.python, "-I", "a.py"], None, sb.Limits(wall_s=30, cpu_s=1))
    assert r.status == "timeout" and r.signal is not None  # the CPU limit, not the wall clock
    r = box.run({"a.py": "print('z' * 10**7)"}, [box.python, "-I", "a.py"], None, lim)
    assert r.status == "output_limit" and len(r.stdout) == lim.output_bytes
    assert box.run({"a.py": "raise SystemExit(3)"}, [box.python, "-I", "a.py"]).exit_code == 3


def test_no_isolating_backend_is_a_startup_error(monkeypatch, tmp_path):
    monkeypatch.setattr(sb.bwrap, "find_bwrap", lambda: None)
    sb.get_sandbox.cache_clear()
    try:
        with pytest.raises(sb.SandboxUnavailable, match="unsafe-local"):
            sb.get_sandbox("bwrap")
        with pytest.raises(sb.SandboxUnavailable):
            PythonTool()
        data = tmp_path / "t.jsonl"
        data.write_text(json.dumps({"prompt": "p", "inputs": ["1"], "outputs": ["1"]}) + "\n")
        from twinplane.cli import main

        assert main(["eval", "--model", str(tmp_path), "--data", str(data), "--reward", "code"]) == 2
        with pytest.raises(ConfigError, match="sandbox"):
            load_config(None, ["sandbox=docker"])
    finally:
        sb.get_sandbox.cache_clear()


def test_code_task_loading(tmp_path):
    rows = [{"text": "add", "test_list": ["assert add(1, 1) == 2"], "test_setup_code": ""},
            {"text": "echo", "input_output": json.dumps({"inputs": ["a"], "outputs": ["a"]})},
            {"text": "given", "answer": {"inputs": ["1"], "outputs": ["2"]}}]
    path = tmp_path / "mix.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, stats = load_code_records(path)
    assert stats["loaded"] == 3 and [r.prompt for r in records] == ["add", "echo", "given"]
    assert [parse_tests(r.answer).kind for r in records] == ["mbpp", "stdio", "stdio"]
    path.write_text(json.dumps({"text": "x", "test_list": []}) + "\n")
    with pytest.raises(DataError, match=r"mix.jsonl:1: .*test_list"):
        load_code_records(path)
    assert extract_program("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_program("def f(): pass") == "def f(): pass"
    if HUMANEVAL.is_file():
        records, _ = load_code_records(HUMANEVAL)
        assert len(records) == 164 and records[0].prompt.startswith("from typing import List")


def test_reward_runner_counts_failures():
    bwrap_or_skip()
    he = json.dumps({"prompt": "", "test": "def check(f):\n    assert f() == 1\n", "entry_point": "f"})
    with RewardRunner("code", {"test_timeout_s": 1.0}, timeout_s=5) as runner:
        rewards, metrics = runner(["def f():\n    return 1", "def f():\n    while True: pass", "def f(:"], [he] * 3)
    assert rewards == [1.0, 0.0, 0.0] and runner.last_verifier == rewards
    assert metrics["reward/code_timeout"] == 1 and metrics["reward/code_crash"] == 1
    assert metrics["reward/errors"] == 0 and metrics["reward/code_pass_rate"] == pytest.approx(1 / 3)

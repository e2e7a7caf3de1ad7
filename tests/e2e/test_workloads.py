"""User workloads end to end: a model folder + a data file through `twinplane train` and `twinplane eval`."""

import json
import re
import string

import pytest
import torch

from twinplane.cli import main
from twinplane.model import ModelConfig, Transformer
from twinplane.rollout import RolloutEngine, Sample
from twinplane.run.prepare import save_hf_folder
from twinplane.tokenizer import build_char_tokenizer

COMMON = ["train.steps=1", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=6",
          "log.progress=false", "eval.before=false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random model whose char tokenizer covers printable ASCII (tool-call markup included)."""
    out = tmp_path_factory.mktemp("model")
    tok = build_char_tokenizer(string.printable[:95])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                                    num_heads=2, num_kv_heads=1, head_dim=16, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id))
    save_hf_folder(model, tok, out)
    return out


@pytest.fixture
def gsm8k_file(tmp_path):
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(1, 5)]
    path = tmp_path / "mini_gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_cli_writes_pass_at_k(model_dir, gsm8k_file, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(model_dir), "--data", str(gsm8k_file), "--reward", "gsm8k", "--n", "4",
                 "--out", str(out), "rollout.max_new_tokens=5"]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 4
    for key in ("accuracy", "pass@1", "pass@2", "pass@4", "mean@4", "response_length", "truncated"):
        assert 0 <= result[key] <= (5 if key == "response_length" else 1), key
    assert result["pass@1"] == pytest.approx(result["mean@4"])
    assert json.loads(capsys.readouterr().out) == result


def test_bad_data_is_one_line_exit_2(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{"question": oops}\n')
    args = ["train", f"model.path={model_dir}", f"data.train_file={bad}", *COMMON]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}:2" in err[0]
    assert main([*args, "data.prompt_field=prompt"]) == 2
    assert "question" in capsys.readouterr().err  # the error lists the fields that exist


@pytest.mark.slow
def test_training_survives_bad_reward_functions(model_dir, gsm8k_file, tmp_path):
    """Answers 2, 4, 6, 8: the function raises, returns NaN, never returns, or scores normally."""
    fn = tmp_path / "bad_reward.py"
    fn.write_text(
        "import time\n"
        "def score(completion, answer, **kw):\n"
        "    if answer.endswith('2'):\n        raise RuntimeError('boom')\n"
        "    if answer.endswith('4'):\n        return float('nan')\n"
        "    if answer.endswith('6'):\n        time.sleep(1000)\n"
        "    return 1.0\n")
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), f"model.path={model_dir}", f"data.train_file={gsm8k_file}",
                 f"reward.name={fn}:score", "reward.timeout_s=1", *COMMON, "rollout.prompts_per_step=4"]) == 0
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["reward/errors"] == 6 and row["reward/timeouts"] == 2  # 3 bad prompts x 2 samples
    assert row["reward/mean"] == pytest.approx(0.25)  # only the well-behaved prompt's 2 samples score 1


@pytest.mark.slow
def test_tool_rollouts_in_training(model_dir, gsm8k_file, tmp_path, monkeypatch):
    """A scripted policy (the engine's `generate` replaced) asks the calculator for i+i, then answers with what it
    returned. The step's turn and tool counts, the share of tool tokens, the reward and the held-out accuracy are
    then known by hand (every i and 2i here is one digit, so every sample has the same length)."""
    tok = build_char_tokenizer(string.printable[:95])
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s+%s"}}</tool_call>'

    def scripted(engine, prompts, sampling, max_new_tokens=None):
        out = []
        for r, ids in enumerate(prompts):
            text = tok.decode(ids, skip_special_tokens=False)
            i = re.search(r"What is (\d+) plus", text).group(1)
            result = re.search(r"<tool_response>(.*)</tool_response>", text)
            reply = tok.encode(f"#### {result.group(1)}") + [tok.eos_token_id] if result else tok.encode(call % (i, i))
            out += [Sample(r, list(ids), list(reply), [-1.0] * len(reply), "stop", engine.weight_version)
                    for _ in range(sampling.n)]
        return out

    monkeypatch.setattr(RolloutEngine, "generate", scripted)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), f"model.path={model_dir}", f"data.train_file={gsm8k_file}",
                 f"data.val_file={gsm8k_file}", "reward.name=gsm8k", "rollout.tools=[calculator]",
                 "rollout.max_turns=2", "eval.every=1", *COMMON, "rollout.max_new_tokens=160"]) == 0
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    tool, model = len("<tool_response>2</tool_response>"), len(call % (1, 1)) + len("#### 2") + 1  # + <eos>
    assert (row["rollout/turns_mean"], row["rollout/tool_calls_mean"], row["rollout/tool_errors_mean"]) == (2, 1, 0)
    assert row["rollout/max_turns_reached"] == 0
    assert row["rollout/tool_token_frac"] == pytest.approx(tool / (tool + model))
    assert row["reward/mean"] == 1 and row["val/accuracy"] == 1

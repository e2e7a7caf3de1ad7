"""The shipped example configs: every one loads and validates (no model, data, hub or GPU needed), the two 8-GPU
configs have the cluster layout docs/scale-out.md describes, and each runs, with its documented command, for two steps
on tiny stand-ins (a tiny model folder and data files built here; the GPU configs on this one process)."""

import gzip
import json
import shlex
import string
from pathlib import Path

import pytest
import torch

from twinplane.cli import main
from twinplane.config import load_config
from twinplane.model import ModelConfig, Transformer
from twinplane.run.prepare import save_hf_folder
from twinplane.sandbox import SandboxUnavailable, get_sandbox
from twinplane.tokenizer import build_char_tokenizer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
YAMLS = sorted(EXAMPLES.glob("*.yaml"))
EIGHT_GPU = ["nvidia_8gpu.yaml", "mi300x_8gpu.yaml"]
MEMORY_KEYS = ("max_tokens_per_micro_batch", "activation_checkpointing", "optimizer_offload")
# Two small steps: the stand-ins are tiny, the examples' own sizes are for real models.
SMALL = ["train.steps=2", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "data.val_size=2",
         "train.micro_batch_size=4", "rollout.kv_cache_gb=0.01", "log.progress=false"]
ONE_PROCESS = ["cluster.backend=local", "cluster.train_devices=1", "cluster.rollout_devices=1",
               "cluster.colocate=false"]
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>\n"


@pytest.fixture(autouse=True)
def data_folder(tmp_path, monkeypatch) -> Path:
    """$TWINPLANE_DATA with a few rows in each layout the examples read (GSM8K, HumanEval, MBPP)."""
    data = tmp_path / "data"
    gsm8k = [{"question": f"Tom has {a} apples and buys {b} more. How many now?",
              "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    humaneval = [{"task_id": f"t/{i}", "prompt": f"def add{i}(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
                  "canonical_solution": "    return a + b\n", "entry_point": f"add{i}",
                  "test": "def check(f):\n    assert f(1, 2) == 3\n"} for i in range(3)]
    mbpp = [{"text": f"Write a function add{i}(a, b) that returns a + b.", "test_list": [f"assert add{i}(1, 2) == 3"]}
            for i in range(4)]
    for name, rows in (("gsm8k/train.jsonl", gsm8k), ("gsm8k/test.jsonl", gsm8k), ("mbpp/train.jsonl", mbpp)):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "humaneval").mkdir()
    (data / "humaneval" / "HumanEval.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps(r) + "\n" for r in humaneval).encode()))
    monkeypatch.setenv("TWINPLANE_DATA", str(data))
    return data


def tiny_chat_model(out: Path, moe: bool) -> Path:
    """A random tiny model (printable-ASCII character tokenizer, a chat template), dense or Qwen3-MoE-shaped."""
    tok = build_char_tokenizer(string.printable)
    experts = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, norm_topk_prob=True)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **(experts if moe else {}))
    torch.manual_seed(0)
    save_hf_folder(Transformer(cfg), tok, out)
    (out / "chat_template.jinja").write_text(CHAT)
    return out


def documented_command(path: Path) -> tuple[dict[str, str], list[str]]:
    """The example's `# Run:` line (with its continuation lines): (environment, arguments after `twinplane`)."""
    lines = path.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("# Run:"))
    text = lines[i].removeprefix("# Run:")
    while text.endswith("\\"):
        i += 1
        text = text[:-1] + " " + lines[i].lstrip("#")
    words = shlex.split(text)
    start = words.index("twinplane")
    return dict(w.split("=", 1) for w in words[:start]), words[start + 1:]


def test_examples_exist():
    names = {p.name for p in YAMLS}
    assert {"gsm8k_instruct.yaml", *EIGHT_GPU} <= names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_example_loads(path):
    cfg = load_config(path, ["model.path=/path/to/model"])  # unknown keys, wrong types and invalid combinations
    assert cfg.data.train_file


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_example_states_what_it_needs_and_one_command(path, data_folder):
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(line.startswith("# Needs:") for line in header)
    env, args = documented_command(path)
    assert env == {"TWINPLANE_DATA": "/path/to/data"}
    assert args[:2] == ["train", f"examples/{path.name}"] and any(a.startswith("model.path=") for a in args)
    cfg = load_config(path)
    assert cfg.model.path is None  # a model folder is the user's to name
    assert cfg.data.train_file.startswith(str(data_folder))  # found through $TWINPLANE_DATA, nothing hard-coded
    assert "../" not in path.read_text()  # no paths outside the repository


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_example_runs_from_anywhere(path, data_folder, tmp_path, monkeypatch, capsys):
    """The documented command, run from another folder, on the stand-ins: two steps, a summary, a checkpoint."""
    cfg = load_config(path)
    model = tiny_chat_model(tmp_path / "model", moe=cfg.rollout.record_routing)
    _, args = documented_command(path)
    args = [str(EXAMPLES / path.name) if a == f"examples/{path.name}" else
            f"model.path={model}" if a.startswith("model.path=") else a for a in args]
    if "--run-dir" not in args:
        args += ["--run-dir", "run"]
    extra = SMALL + (ONE_PROCESS if cfg.cluster.backend == "ray" else [])
    if cfg.sandbox == "bwrap":
        try:
            get_sandbox("bwrap")
        except SandboxUnavailable:
            extra.append("sandbox=unsafe-local")  # a tiny random model's 8 characters of "code"
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main([*args, *extra]) == 0, capsys.readouterr().err
    run = work / args[args.index("--run-dir") + 1]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    saved = load_config(run / "config.yaml")
    assert saved.data.train_file == cfg.data.train_file and Path(saved.model.path) == model


def test_config_file_paths_count_from_its_folder(tmp_path, monkeypatch, capsys):
    """Relative input paths in a config file resolve against the file's folder, on the command line against the
    current one; an error names the absolute path."""
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "c.yaml").write_text("data:\n  train_file: data/train.jsonl\n  val_file: ~/v.jsonl\n"
                                   "reward:\n  name: rewards.py:score\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(folder / "c.yaml")
    assert cfg.data.train_file == str(folder / "data" / "train.jsonl")
    assert cfg.data.val_file == str(Path.home() / "v.jsonl")
    assert cfg.reward.name == f"{folder / 'rewards.py'}:score"
    assert load_config("configs/c.yaml", ["data.train_file=t.jsonl"]).data.train_file == str(tmp_path / "t.jsonl")
    assert main(["train", "configs/c.yaml", "data.val_file=null", "--run-dir", "r"]) == 2
    assert capsys.readouterr().err.strip() == (f"twinplane: error: data.train_file {folder}/data/train.jsonl: "
                                               "no such file or directory")


@pytest.mark.parametrize("name", EIGHT_GPU)
def test_8gpu_layout(name):
    cfg = load_config(EXAMPLES / name)
    c = cfg.cluster
    assert (c.backend, c.train_devices, c.rollout_devices, c.colocate) == ("ray", 8, 8, True)
    assert (cfg.model.dtype, cfg.model.rollout_dtype) == ("float32", "bfloat16")  # fp32 master, bf16 engines
    assert cfg.train.max_tokens_per_micro_batch > 0
    assert cfg.reward.name == "gsm8k"


def test_8gpu_configs_differ_only_in_memory_switches():
    nv, mi = (load_config(EXAMPLES / n) for n in EIGHT_GPU)
    assert nv.train.activation_checkpointing and not nv.train.optimizer_offload  # 80 GB H100
    assert not mi.train.optimizer_offload and not mi.train.activation_checkpointing  # 192 GB MI300X
    a, b = nv.to_dict(), mi.to_dict()
    for d in (a, b):
        for k in MEMORY_KEYS:
            del d["train"][k]
    assert a == b

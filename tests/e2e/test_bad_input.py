"""Bad input, one row per case: exit code 2 (or as stated), no traceback, a message naming the culprit, and the
run dir that the command points at is byte for byte as it was (an earlier run in it is never touched).

`python tests/e2e/test_bad_input.py` prints the table: case, exit code, first line of stderr.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch

from twinplane.cli import main
from twinplane.config import Config

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=2",
        "train.steps=2", "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=8", "log.progress=false",
        "checkpoint.every=1", "eval.before=false"]


@dataclass
class Fx:
    """Paths every case can use; `run` holds an earlier run (the snapshot), `ck` a real finished tiny run."""
    tmp: Path
    run: Path
    ck: Path
    model: Path

    def file(self, name: str, text: str | bytes) -> str:
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)

    def model_copy(self, edit: Callable[[Path], None]) -> str:
        out = self.tmp / "model_copy"
        shutil.copytree(self.model, out)
        edit(out)
        return str(out)

    def ckpt_copy(self, edit: Callable[[Path], None] | None = None, reseal: bool = True) -> Path:
        """The finished run copied to `run` (replacing the fake one), its newest checkpoint edited and, with
        `reseal`, its manifest rewritten so the damage passes the checksum (a file written with the wrong shape)."""
        shutil.rmtree(self.run)
        shutil.copytree(self.ck, self.run)
        ckpt = sorted((self.run / "checkpoints").glob("step_*"))[-1]
        if edit:
            edit(ckpt)
            if reseal:
                files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
                manifest = {"step": 2, "files": {str(p.relative_to(ckpt)): {
                    "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files}}
                (ckpt / "manifest.json").write_text(json.dumps(manifest))
        return ckpt


@dataclass
class Case:
    id: str
    argv: Callable[[Fx], list[str]]  # builds the command line (and any bad files) for this case
    expect: str  # a part of the one-line message: the key, file or argument at fault
    code: int = 2


AGENT_OK = "def run(base_url, task):\n    return 1.0\n"


def T(*args: str) -> Callable[[Fx], list[str]]:
    """A train command over the earlier run in fx.run, with --overwrite: a bad input must leave it untouched."""
    return lambda fx: ["train", "--run-dir", str(fx.run), "--overwrite", *TINY, *args]


def TM(edit: Callable[[Path], None], *args: str) -> Callable[[Fx], list[str]]:
    """Train on a copy of the tiny model folder after `edit` broke it."""
    return lambda fx: ["train", "--run-dir", str(fx.run), "--overwrite", *TINY, f"model.path={fx.model_copy(edit)}",
                       *args]


def TD(name: str, text: str | bytes, *args: str) -> Callable[[Fx], list[str]]:
    """Train on a data file with this content (the tiny model's character tokenizer: digits, + and =)."""
    return lambda fx: ["train", "--run-dir", str(fx.run), "--overwrite", *TINY, f"model.path={fx.model}",
                       f"data.train_file={fx.file(name, text)}", "data.template=plain", *args]


def _damaged_parquet() -> bytes:
    """A Parquet file whose header and footer are intact but whose row data is zeroed (a damaged copy)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"question": [f"{i}+1=" for i in range(2000)], "answer": ["1"] * 2000}), sink)
    data = bytearray(sink.getvalue().to_pybytes())
    data[len(data) // 3:len(data) // 3 + 200] = bytes(200)
    return bytes(data)


def TR(spec: str, code: str | None = None, *args: str) -> Callable[[Fx], list[str]]:
    def make(fx: Fx) -> list[str]:
        if code is not None:
            fx.file("rewards_mod.py", code)
        name = spec.replace("FILE", str(fx.tmp / "rewards_mod.py"))
        return ["train", "--run-dir", str(fx.run), "--overwrite", *TINY, f"reward.name={name}", *args]
    return make


def TC(edit: Callable[[Path], None] | None, *args: str, reseal: bool = True, path: bool = True):
    """Resume the finished tiny run after damaging its newest checkpoint (by path, or --resume auto)."""
    def make(fx: Fx) -> list[str]:
        ckpt = fx.ckpt_copy(edit, reseal)
        return ["train", "--run-dir", str(fx.run), *TINY, "train.steps=3", *args, "--resume",
                str(ckpt) if path else "auto"]
    return make


def _write(rel: str, data: str | bytes) -> Callable[[Path], None]:
    return lambda d: (d / rel).write_bytes(data if isinstance(data, bytes) else data.encode())


def _integer_weight(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _json_edit(rel: str, **changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / rel).read_text())
        cfg.update(changes)
        (d / rel).write_text(json.dumps(cfg))
    return edit


def _yaml_edit(rel: str, section: str, **changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        import yaml

        cfg = yaml.safe_load((d / rel).read_text())
        cfg.setdefault(section, {}).update(changes)
        (d / rel).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return edit


def _truncate(rel: str) -> Callable[[Path], None]:
    return lambda d: (d / rel).write_bytes((d / rel).read_bytes()[:200])


def _ran(marker: str) -> None:
    """What a malicious pickle would call on loading: leaves a marker, so a test sees whether it ran."""
    Path(marker).touch()


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return _ran, (self.marker,)


def _write_code_pickle(rel: str) -> Callable[[Path], None]:
    """A torch.save file whose unpickling would call `_ran` (what `weights_only=True` must refuse)."""
    def edit(d: Path) -> None:
        import torch

        torch.save({"state": _RunsCode(str(d.parent.parent.parent / "code_ran"))}, d / rel)
    return edit


def _zip_bytes() -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("notes.txt", "not tensors")
    return buf.getvalue()


def _shrink_vocab(d: Path) -> None:
    """The folder's model (consistent weights and config) with 6 fewer embedding rows than its tokenizer's ids."""
    import dataclasses

    from twinplane.model import Transformer, load_model, save_pretrained

    cfg = load_model(d).config
    save_pretrained(Transformer(dataclasses.replace(cfg, vocab_size=cfg.vocab_size - 6)), d)


CASES = [
    # ---- config: types, ranges, choices, keys that depend on each other, sizes that cannot fit ----
    Case("config/unknown key", T("train.lrr=1"), "unknown key train.lrr (did you mean train.lr?)"),
    Case("config/unknown key, another trainer's name", T("train.learning_rate=1e-5"),
         "unknown key train.learning_rate (did you mean train.lr?)"),
    Case("config/unknown section", T("trian.steps=3"), "unknown key trian.steps (did you mean train.steps?)"),
    Case("config/removed key", T("cluster.async=true"),
         "unknown key cluster.async (did you mean cluster.max_staleness=1?)"),
    Case("config/wrong type", T("train.steps=abc"), "train.steps: expected an integer"),
    Case("config/not key=value", T("=5"), "is not key=value"),
    Case("config/missing file", lambda fx: ["train", "no_such.yaml"], "config file no_such.yaml not found"),
    Case("config/invalid YAML", lambda fx: ["train", fx.file("bad.yaml", "train:\n  lr: [1\n")], "invalid YAML"),
    Case("config/file not UTF-8", lambda fx: ["train", fx.file("bin.yaml", b"train:\n  lr: \xff\n")],
         "bin.yaml: not UTF-8 text (byte 13)"),
    Case("config/YAML not a mapping", lambda fx: ["train", fx.file("list.yaml", "- 1\n- 2\n")],
         "expected a mapping of sections"),
    Case("config/section not a mapping", T("train=3"), "train: expected a mapping"),
    Case("config/vllm with MoE routing replay", T("rollout.backend=vllm", "algo.routing_replay=true"),
         "algo.routing_replay: needs rollout.backend=twinplane"),
    Case("config/vllm recording routing",
         T("rollout.backend=vllm", "model.num_experts=4", "rollout.record_routing=true"),
         "rollout.backend: must be twinplane for rollout.record_routing"),
    Case("config/vllm with unmerged LoRA", T("rollout.backend=vllm", "train.lora.rank=4"),
         "rollout.backend: vllm with train.lora needs rollout.lora_merge=true"),
    Case("config/vllm log-probs at T=0.7 with top-k", T("rollout.backend=vllm", "rollout.temperature=0.7",
         "rollout.top_k=5"), "rollout.backend: vllm reports the log-probs the trainer scores"),
    Case("config/unset variable in a path", lambda fx: ["train", fx.file("v.yaml", "data:\n  train_file: "
                                                                        "${TWINPLANE_UNSET_XYZ}/t.jsonl\n")],
         "data.train_file: ${TWINPLANE_UNSET_XYZ}/t.jsonl uses ${TWINPLANE_UNSET_XYZ}, which is not set in the "
         "environment"),
    Case("config/fp16 master weights", T("model.dtype=float16"), "model.dtype=float16: the trained weights and "
         "AdamW's state"),
    Case("config/warmstart.batch_size=0", T("warmstart.batch_size=0"), "warmstart.batch_size: must be >= 1"),
    Case("config/warmstart.lr=-1", T("warmstart.lr=-1"), "warmstart.lr: must be > 0"),
    Case("config/rollout.top_k=-1", T("rollout.top_k=-1"), "rollout.top_k: must be >= 0"),
    Case("config/min_new_tokens > max", T("rollout.min_new_tokens=9"), "rollout.min_new_tokens: must be <="),
    Case("config/eval.temperature=-1", T("eval.temperature=-1"), "eval.temperature: must be >= 0"),
    Case("config/threads=-1", T("threads=-1"), "threads: must be >= 0"),
    Case("config/device=banana", T("device=banana"), "device: must be auto, cpu, cuda or cuda:N"),
    Case("config/sandbox=banana", T("sandbox=banana"), "sandbox: must be bwrap or unsafe-local"),
    Case("config/cluster.backend=slurm", T("cluster.backend=slurm"), "cluster.backend: must be local or ray"),
    Case("config/data.val_size=-1", T("data.val_size=-1"), "data.val_size: must be >= 0"),
    Case("config/rollout.n=1", T("rollout.n=1"), "rollout.n: must be >= 2"),
    Case("config/rollout.temperature=-1", T("rollout.temperature=-1"), "rollout.temperature: must be >= 0"),
    Case("config/top_p=0", T("rollout.top_p=0"), "rollout.top_p: must be in (0, 1]"),
    Case("config/train.lr=0", T("train.lr=0"), "train.lr: must be > 0"),
    Case("config/betas out of range", T("train.betas=[0.9,1.5]"), "train.betas: must each be in [0, 1)"),
    Case("config/betas length", T("train.betas=[0.9]"), "train.betas: must be two numbers"),
    Case("config/schedule", T("train.schedule=linear"), "train.schedule: must be constant, cosine or wsd"),
    Case("config/kl_estimator", T("algo.kl_estimator=k9"), "algo.kl_estimator: must be one of k1, k2, k3, abs"),
    Case("config/clip_low", T("algo.clip_low=1.5"), "algo.clip_low: must be in [0, 1)"),
    Case("config/mini_batches divide", T("train.mini_batches=3"), "train.mini_batches: must divide"),
    Case("config/kv heads divide", T("model.num_kv_heads=3"), "model.num_kv_heads: must divide model.num_heads"),
    Case("config/heads not a multiple of the kv heads: the key given is named", T("model.num_heads=3"),
         "model.num_heads: must be a multiple of model.num_kv_heads (4), got 3"),
    Case("config/heads not dividing the hidden size: the key given is named",
         lambda fx: ["train", "--run-dir", str(fx.run), "--overwrite", "model.num_heads=3", "model.num_kv_heads=1"],
         "model.num_heads: must divide model.hidden_size (128), got 3"),
    Case("config/hidden % heads", T("model.hidden_size=30"), "model.hidden_size: must be a multiple"),
    Case("config/seed=-1", T("seed=-1"), "seed: must be in [0, 2**32)"),
    Case("config/checkpoint.keep=0", T("checkpoint.keep=0"), "checkpoint.keep: must be >= 1"),
    Case("config/log.backends", T("log.backends=[console,splunk]"), "log.backends: must name"),
    Case("config/plain_template unknown field", T("data.plain_template={question}"),
         "data.plain_template: field {question} is not one of {prompt}, {raw_prompt}, {suffix}, {system}"),
    Case("config/plain_template format width", T("data.plain_template={prompt:>99999999999}"),
         "data.plain_template: field {prompt:>99999999999} has a format spec: fields are substituted as they are, "
         "write {prompt}"),
    Case("config/plain_template precision", T("data.plain_template=Q: {prompt:.3}"),
         "data.plain_template: field {prompt:.3} has a format spec"),
    Case("config/plain_template nested field", T("data.plain_template={prompt:{system}}"),
         "data.plain_template: field {prompt:{system}} has a format spec"),
    Case("config/plain_template conversion", T("data.plain_template={prompt!r}"),
         "data.plain_template: field {prompt!r} has a conversion"),
    Case("config/plain_template index", T("data.plain_template={prompt[0]}"),
         "data.plain_template: field {prompt[0]} is not one of"),
    Case("config/plain_template attribute", T("data.plain_template={prompt.__class__}"),
         "data.plain_template: field {prompt.__class__} is not one of"),
    Case("config/plain_template unbalanced", T("data.plain_template={prompt"),
         "data.plain_template: is not a str.format template (expected '}' before end of string)"),
    Case("config/plain_template without prompt", T("data.plain_template={system}"),
         "data.plain_template: has no {prompt} field"),
    Case("config/heldout too big", T("task.digits=1", "task.heldout_size=100"), "task.heldout_size: must leave"),
    Case("config/step_timeout_s=-1", T("reward.step_timeout_s=-1"), "reward.step_timeout_s: must be >= 0"),
    Case("config/format_weight=nan", T("reward.format_weight=.nan"), "reward.format_weight: must be a finite number"),
    Case("config/kv_cache_gb=inf", T("rollout.kv_cache_gb=inf"), "rollout.kv_cache_gb: must be a finite number"),
    Case("config/max_new_tokens=10**9", T("rollout.max_new_tokens=1000000000"), "GB (weights, grads and AdamW"),
    Case("config/hidden_size=10**6", T("model.hidden_size=1000000", "model.intermediate_size=64"),
         "params, 6+8 tokens"),
    Case("config/KV budget below one sequence", T("rollout.kv_cache_gb=1e-7"),
         "holds 0 blocks of 16 tokens (8192 bytes each); one sequence of 14 tokens needs 1: raise rollout.kv_cache_gb"),
    Case("config/val_file without train_file", T("data.val_file=x.jsonl"), "data.val_file: needs data.train_file"),
    Case("config/template=chat, no model", T("data.template=chat"), "data.template=chat needs model.path"),
    # ---- data files ----
    Case("data/missing file", T("data.train_file=/nonexistent/train.jsonl"), "data.train_file /nonexistent"),
    Case("data/empty file", TD("empty.jsonl", ""), "empty.jsonl"),
    Case("data/invalid JSON line", TD("bad.jsonl", '{"question": "1+1=", "answer": "2"}\n{oops\n'), "bad.jsonl:2"),
    Case("data/missing field", TD("nofield.jsonl", '{"q": "1+1=", "answer": "2"}\n'), "no field 'question'"),
    Case("data/invalid UTF-8", TD("latin1.jsonl", b'{"question": "1+1=\xe9", "answer": "2"}\n'), "invalid UTF-8"),
    Case("data/character the tokenizer lacks", TD("chars.jsonl", '{"question": "1+1=", "answer": "2"}\n'
                                                  '{"question": "1+x=", "answer": "2"}\n'), "chars.jsonl:2"),
    Case("data/unknown format", TD("data.txt", "1+1=\n"), "unknown data format '.txt'"),
    Case("data/not an object", TD("list.jsonl", '[1, 2]\n'), "list.jsonl:1"),
    Case("data/prompt wrong type", TD("num.jsonl", '{"question": 5, "answer": "2"}\n'), "num.jsonl:1"),
    Case("data/all prompts too long", TD("long.jsonl", '{"question": "11+11=", "answer": "22"}\n',
                                         "data.max_prompt_tokens=2"), "longer than data.max_prompt_tokens=2"),
    Case("data/folder without state.json", lambda fx: T(f"data.train_file={fx.tmp}", f"model.path={fx.model}")(fx),
         "not one written by datasets' save_to_disk"),
    Case("data/not gzip", TD("fake.jsonl.gz", "1+1=\n"), "fake.jsonl.gz: unreadable after line 0 (Not a gzipped file"),
    Case("data/gzip cut short", TD("cut.jsonl.gz", gzip.compress(b'{"question": "1+1=", "answer": "2"}\n' * 200)[:60]),
         "cut.jsonl.gz: unreadable after line"),
    Case("data/damaged Parquet", lambda fx: TD("bad.parquet", _damaged_parquet())(fx), "bad.parquet: not a readable"),
    Case("data/missing val_file", lambda fx: TD("ok.jsonl", '{"question": "1+1=", "answer": "2"}\n',
                                                "data.val_file=/nonexistent/val.jsonl")(fx), "data.val_file"),
    # ---- model folders ----
    Case("model/no such folder", T("model.path=/nonexistent/model"), "model.path /nonexistent/model: no such folder"),
    Case("model/no config.json", TM(lambda d: (d / "config.json").unlink()), "no config.json"),
    Case("model/config.json not JSON", TM(_write("config.json", "{not json")), "config.json: invalid JSON"),
    Case("model/string where int", TM(_json_edit("config.json", hidden_size="32")), "config.json"),
    Case("model/unknown model_type", TM(_json_edit("config.json", model_type="gpt9")), "model_type 'gpt9'"),
    Case("model/rope scaling factor 0", TM(_json_edit("config.json", rope_scaling={"type": "linear", "factor": 0})),
         "linear rope scaling needs factor as a finite number > 0, got 0"),
    Case("model/llama3 rope scaling incomplete",
         TM(_json_edit("config.json", rope_scaling={"rope_type": "llama3", "factor": 8})),
         "llama3 rope scaling needs low_freq_factor"),
    Case("model/rope_theta 0", TM(_json_edit("config.json", rope_theta=0)), "rope_theta must be a finite number > 0"),
    Case("model/sliding_window 0", TM(_json_edit("config.json", model_type="mistral", sliding_window=0)),
         "sliding_window must be a positive integer or null, got 0"),
    Case("model/heads not divisible", TM(_json_edit("config.json", num_key_value_heads=3)), "config.json"),
    Case("model/truncated safetensors", TM(_truncate("model.safetensors")), "model.safetensors: not a readable"),
    Case("model/no weights", TM(lambda d: (d / "model.safetensors").unlink()), "no model.safetensors"),
    Case("model/garbage tokenizer.json", TM(_write("tokenizer.json", "{garbage")), "tokenizer.json: not a valid"),
    Case("model/no tokenizer.json", TM(lambda d: (d / "tokenizer.json").unlink()), "no tokenizer.json"),
    Case("model/tokenizer_config not JSON", TM(_write("tokenizer_config.json", "{x")), "tokenizer_config.json"),
    Case("model/wrong tensor shape", TM(_json_edit("config.json", intermediate_size=48)), "checkpoint shape"),
    Case("model/integer weights", TM(_integer_weight), "model.norm.weight: checkpoint dtype torch.int32 is not a"),
    Case("model/vocab smaller than the tokenizer", TM(_shrink_vocab), "config.json's vocab_size is"),
    Case("model/quantized checkpoint", TM(_json_edit("config.json", quantization_config={"quant_method": "gptq"})),
         "quantized checkpoints are not supported (quantization_config: gptq)"),
    Case("model/hidden_act gelu", TM(_json_edit("config.json", hidden_act="gelu")),
         "hidden_act 'gelu' is not supported"),
    Case("model/eos_token not in the vocabulary", TM(_json_edit("tokenizer_config.json", eos_token="<nope>")),
         "tokenizer_config.json: eos_token '<nope>' is not in the vocabulary"),
    Case("cli/eval on a model whose vocab is smaller than its tokenizer",
         lambda fx: ["eval", "--model", fx.model_copy(_shrink_vocab)],
         "config.json's vocab_size is"),
    Case("model/tools the tokenizer can't spell", lambda fx: T(f"model.path={fx.model}",
                                                               "rollout.tools=[calculator]")(fx),
         "rollout.tools: the tokenizer of"),
    # ---- reward functions ----
    Case("reward/unknown name", T("reward.name=nope"), "nope"),
    Case("reward/module not importable", T("reward.name=no_such_module_xyz:f"), "no_such_module_xyz"),
    Case("reward/file missing", T("reward.name=/nonexistent/r.py:f"), "/nonexistent/r.py"),
    Case("reward/function missing", TR("FILE:missing", "def f(c, a):\n    return 1.0\n"), "missing"),
    Case("reward/syntax error", TR("FILE:f", "def f(c, a:\n"), "rewards_mod.py"),
    Case("reward/not callable", TR("FILE:f", "f = 3\n"), "f"),
    Case("model/critic folder missing", T("algo.name=ppo", "critic.model_path=/nonexistent/critic"),
         "critic.model_path /nonexistent/critic: no such folder"),
    Case("model/critic of another shape", lambda fx: T("algo.name=ppo", f"model.path={fx.model}",
                                                     f"critic.model_path={fx.model_copy(_shrink_vocab)}")(fx),
         "vocab_size 9 differs from the policy's 15"),
    Case("reward/model folder missing", T("reward.model=/nonexistent/rm"), "/nonexistent/rm"),
    Case("reward/model vocab smaller than its tokenizer",
         lambda fx: T(f"reward.model={fx.model_copy(_shrink_vocab)}")(fx), "config.json's vocab_size is"),
    Case("reward/model config.json unsupported",
         lambda fx: T(f"reward.model={fx.model_copy(_json_edit('config.json', hidden_act='relu'))}")(fx),
         "model_copy/config.json: hidden_act 'relu' is not supported"),
    Case("reward/timeout_s=0", T("reward.timeout_s=0"), "reward.timeout_s: must be > 0"),
    Case("reward/judge neither a URL nor a model folder", T("reward.judge=/nowhere"),
         "reward.judge: /nowhere is neither an http(s) URL nor a model folder"),
    Case("reward/judge_retries=-1", T("reward.judge_retries=-1"), "reward.judge_retries: must be >= 0"),
    # ---- agents ----
    Case("agent/entrypoint no such file", T("agent.entrypoint=no_such_agent.py:run"),
         "no_such_agent.py:run': cannot load (no such file"),
    Case("agent/entrypoint without a function", T("agent.entrypoint=agents_mod"),
         "agent.entrypoint: agent 'agents_mod': expected module:function or path/to/file.py:function"),
    Case("agent/entrypoint on colocated Ray planes",
         lambda fx: T(f"agent.entrypoint={fx.file('agent_ok.py', AGENT_OK)}:run", "cluster.backend=ray",
                      "cluster.colocate=true")(fx),
         "agent.entrypoint: on Ray needs engines of their own (cluster.colocate=false)"),
    Case("agent/concurrency=0", T("agent.concurrency=0"), "agent.concurrency: must be >= 1"),
    # ---- checkpoints ----
    Case("checkpoint/not a folder", lambda fx: ["train", "--run-dir", str(fx.run), *TINY, "--resume",
                                                str(fx.tmp / "nope")], "no such checkpoint folder"),
    Case("checkpoint/truncated file", TC(_truncate("optimizer.pt"), reseal=False), "is truncated"),
    Case("checkpoint/corrupt manifest", TC(_write("manifest.json", "{x"), reseal=False), "corrupt manifest"),
    Case("checkpoint/manifest wrong shape", TC(_write("manifest.json", "[1, 2]"), reseal=False),
         "malformed manifest"),
    Case("checkpoint/state.json wrong shape", TC(_write("state.json", "[1, 2, 3]")), "wrong shape"),
    Case("checkpoint/state.json missing keys", TC(_write("state.json", '{"step": 2}')), "wrong shape"),
    Case("checkpoint/rng file garbage", TC(_write("rng.safetensors", b"\x00" * 64)), "wrong shape"),
    Case("checkpoint/config.yaml garbage", TC(_write("config.yaml", "- [")), "config.yaml: not a readable config"),
    Case("checkpoint/optimizer not a torch file", TC(_write("optimizer.pt", b"not a torch file")),
         "optimizer.pt: not a file written by torch.save (unknown format)"),
    Case("checkpoint/optimizer pickles code", TC(_write_code_pickle("optimizer.pt")),
         "optimizer.pt: not loadable as weights only: it pickles "),
    Case("checkpoint/optimizer truncated, checksum right", TC(_truncate("optimizer.pt")),
         "optimizer.pt: truncated (not a complete torch.save archive)"),
    Case("checkpoint/optimizer a zip torch did not write", TC(_write("optimizer.pt", _zip_bytes())),
         "optimizer.pt: not a readable torch.save archive (file in archive is not in a subdirectory"),
    Case("checkpoint/optimizer legacy .tar file", TC(_write("optimizer.pt", bytes(1024))),
         "optimizer.pt: a legacy .tar torch.save file, which cannot be loaded as weights only"),
    Case("checkpoint/config changed on resume", TC(None, "algo.kl_coef=0.5"), "algo.kl_coef cannot change"),
    Case("checkpoint/config.yaml with a removed key that changed the run",
         TC(_yaml_edit("config.yaml", "cluster", **{"async": True})),
         "config.yaml: unknown key cluster.async (did you mean cluster.max_staleness=1?)"),
    # ---- command line ----
    Case("cli/run dir holds a run", lambda fx: ["train", "--run-dir", str(fx.run), *TINY],
         "already holds a run (config.yaml, metrics.jsonl"),
    Case("cli/--run-dir is a file", lambda fx: ["train", "--run-dir", fx.file("afile", "x"), *TINY],
         "exists and is not a folder"),
    Case("cli/--run-dir under a file", lambda fx: ["train", "--run-dir", fx.file("afile2", "x") + "/sub", *TINY],
         "is a file, not a folder"),
    Case("cli/--resume auto without --run-dir", lambda fx: ["train", *TINY, "--resume", "auto"],
         "--resume auto needs --run-dir"),
    Case("cli/--overwrite with --resume", lambda fx: ["train", "--run-dir", str(fx.run), *TINY, "--overwrite",
                                                      "--resume", "auto"], "--overwrite starts a new run"),
    Case("cli/--delete-old alone", lambda fx: ["train", "--run-dir", str(fx.run), *TINY, "--delete-old"],
         "--delete-old: only with --overwrite"),
    Case("cli/--max-restarts -1", lambda fx: ["train", "--run-dir", str(fx.run), *TINY, "--max-restarts", "-1"],
         "--max-restarts: must be >= 0"),
    Case("cli/export missing source", lambda fx: ["export", str(fx.tmp / "nowhere"), "--out", str(fx.tmp / "o")],
         "no such run dir"),
    Case("cli/export --out is a file", lambda fx: ["export", str(fx.ck), "--out", fx.file("out_file", "x")],
         "is a file"),
    Case("cli/export --out is the source", lambda fx: ["export", str(fx.ck / "final"), "--out",
                                                       str(fx.ck / "final")], "is the source folder"),
    Case("cli/export of a model folder", lambda fx: ["export", str(fx.ck / "final"), "--out", str(fx.tmp / "o2")],
         "already a Hugging Face model folder"),
    Case("cli/export --out not empty", lambda fx: ["export", str(fx.ck), "--out", str(fx.run)], "is not empty"),
    Case("cli/eval --out in a missing folder", lambda fx: ["eval", "--model", str(fx.model), "--out",
                                                           str(fx.tmp / "no" / "e.json")], "cannot be written"),
    Case("cli/eval --out where no file can be made (even as root)",
         lambda fx: ["eval", "--model", str(fx.model), "--out", "/proc/twinplane-eval.json"], "cannot be written"),
    Case("cli/eval --out is a folder", lambda fx: ["eval", "--model", str(fx.model), "--out", str(fx.tmp)],
         "is a folder"),
    Case("cli/eval --n 0", lambda fx: ["eval", "--model", str(fx.model), "--n", "0"], "--n must be >= 1"),
    Case("cli/eval missing model", lambda fx: ["eval", "--model", str(fx.tmp / "nomodel")], "no such folder"),
    Case("config/a Ray layout bigger than this machine, refused before any work",
         T("cluster.backend=ray", "cluster.cpus_per_worker=100000"),
         "cluster: 2 workers (cluster.train_devices + rollout_devices + critic_devices) of "
         "cluster.cpus_per_worker=100000 need 200000 CPUs; this machine has"),
    Case("cli/eval --data missing", lambda fx: ["eval", "--model", str(fx.model), "--data", "nope.jsonl"],
         "--data nope.jsonl: no such file or directory"),
    Case("cli/eval --model a run dir", lambda fx: ["eval", "--model", str(fx.ck)],
         "no config.json (a run dir: its model is "),
    Case("cli/train key without =", lambda fx: ["train", "train.steps", "10"],
         "config file train.steps not found (a key is set as key=value: did you mean train.steps=10?)"),
]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mode, p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))} if root.exists() else {}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, Path]:
    """A real tiny run with checkpoints, and its final/ as a model folder (character tokenizer)."""
    ck = tmp_path_factory.mktemp("finished")
    assert main(["train", "--run-dir", str(ck), *TINY]) == 0
    return ck, ck / "final"


@pytest.fixture
def fx(tmp_path, finished_run) -> Fx:
    run = tmp_path / "earlier_run"
    run.mkdir()
    for name, text in (("config.yaml", "seed: 0\n"), ("metrics.jsonl", '{"step": 1}\n'), ("summary.json", "{}")):
        (run / name).write_text(text)
    (run / "final").mkdir()
    (run / "final" / "model.safetensors").write_bytes(b"weights")
    return Fx(tmp_path, run, *finished_run)


def run_case(case: Case, fx: Fx, capsys) -> tuple[int, str]:
    argv = case.argv(fx)
    before = snapshot(fx.run)
    cwd = os.getcwd()
    os.chdir(fx.tmp)  # a command that would write a default run dir or eval.json writes it here
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors exit 2 with one line
        code = e.code
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert snapshot(fx.run) == before, f"{case.id}: the run dir changed"
    return code, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, fx: Fx, capsys):
    code, err = run_case(case, fx, capsys)
    assert "Traceback" not in err and "a bug in twinplane" not in err, err
    assert code == case.code, err
    errors = [line for line in err.splitlines() if line.startswith("twinplane: error:")]
    assert len(errors) == 1 and case.expect in errors[0], err
    assert not (fx.tmp / "code_ran").exists(), "a checkpoint's pickled code ran"


def test_good_inputs_still_work(finished_run, tmp_path, capsys):
    """Controls for the table: the demo's own evaluation, a string key with a colon, --version."""
    from twinplane.config import load_config

    out = tmp_path / "e.json"
    capsys.readouterr()
    assert main(["eval", "--model", str(finished_run[1]), "--out", str(out), "task.heldout_size=8"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out) == json.loads(out.read_text())  # stdout: the JSON alone
    assert printed.err.splitlines()[-1] == f"twinplane: wrote {out}"
    result = json.loads(out.read_text())
    assert result["prompts"] == 8 and 0 <= result["accuracy"] <= 1 and "built-in task" in result["data"]
    assert load_config(None, ["data.system_prompt=Answer: briefly"]).data.system_prompt == "Answer: briefly"
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and "twinplane" in capsys.readouterr().out


def test_a_bug_prints_its_traceback_and_says_so(monkeypatch, tmp_path, capsys):
    from twinplane.run import loop

    monkeypatch.setattr(loop, "train", lambda setup: 1 / 0)
    assert main(["train", "--run-dir", str(tmp_path / "r"), *TINY]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err and "this is a bug in twinplane" in err


def test_every_config_key_has_a_case(tmp_path, finished_run):
    """Each section of the config (and each top-level key) is set to something bad by some row: one added without
    a row fails here. A row counts for the keys it sets beyond the tiny run's own (run_dir is --run-dir's, whose
    rows are under cli/)."""
    tried = set()
    for i, case in enumerate(CASES):
        (tmp_path / f"{i}" / "earlier_run").mkdir(parents=True)
        argv = case.argv(Fx(tmp_path / f"{i}", tmp_path / f"{i}" / "earlier_run", *finished_run))
        tried |= {a.split("=")[0].split(".")[0] for a in argv if "=" in a and not a.startswith("-") and a not in TINY}
    assert {f.name for f in fields(Config)} - {"run_dir"} <= tried


if __name__ == "__main__":  # the table, from the rows above
    import contextlib
    import io
    import tempfile

    base = Path(tempfile.mkdtemp())
    ck = base / "finished"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--run-dir", str(ck), *TINY]) == 0
    print("| case | exit | first line of stderr |\n|---|---|---|")
    for i, case in enumerate(CASES):
        tmp = base / f"c{i}"
        tmp.mkdir()
        run = tmp / "earlier_run"
        run.mkdir()
        (run / "config.yaml").write_text("seed: 0\n")
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        f = Fx(tmp, run, ck, ck / "final")
        buf = io.StringIO()
        cwd = os.getcwd()
        os.chdir(tmp)
        with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(case.argv(f))
            except SystemExit as e:
                code = e.code
        os.chdir(cwd)
        first = next((ln for ln in buf.getvalue().splitlines() if ln.startswith("twinplane: error:")),
                     buf.getvalue().strip().splitlines()[:1] or [""])
        first = first if isinstance(first, str) else first[0]
        first = first.replace(str(tmp), "$TMP").replace(str(ck), "$RUN").replace("|", "\\|")
        print(f"| {case.id} | {code} | `{first[:150]}` |")

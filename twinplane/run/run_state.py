"""What a checkpoint holds of a running job, and putting it back: everything needed to continue bitwise."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import warnings
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from twinplane.config import PATH_KEYS, Config
from twinplane.errors import first_line
from twinplane.model import Transformer, iter_safetensors, load_weights
from twinplane.model.export import export_weights
from twinplane.model.lora_io import load_adapter, save_adapter
from twinplane.run.checkpoint import CheckpointError
from twinplane.run.run_dir import respect_umask
from twinplane.train import sharded

# Keys a resumed run may change (reported); changing any other key would make it a different run (an error).
# Where the planes run and how memory is traded for compute are mutable too: checkpoints hold full tensors by name
# or shards that load onto any rank count.
MUTABLE = ("train.steps", "log.", "eval.", "checkpoint.", "threads", "device", "reward.timeout_s",
           "rollout.max_num_seqs", "rollout.max_num_batched_tokens", "rollout.kv_cache_gb",
           "rollout.gpu_memory_utilization", "rollout.graphs", "rollout.graph_max_batch", "rollout.run_ahead",
           "rollout.kernels", "train.micro_batch_size",
           "train.max_tokens_per_micro_batch", "train.activation_checkpointing", "train.optimizer_offload",
           "cluster.backend", "cluster.address", "cluster.train_devices", "cluster.rollout_devices", "cluster.colocate",
           "cluster.critic_devices", "cluster.timeout_s", "cluster.sync_bucket_mb", "cluster.cpus_per_worker")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "options" else {prefix + k: v})
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(immutable keys that differ, mutable keys that differ), each as 'key: old -> new'. A key the saved config
    lacks (added to twinplane since) counts as its default."""
    a, b = _flatten(Config().to_dict()) | _flatten(saved), _flatten(current)
    for key in PATH_KEYS:  # a config saved with relative input paths read them from the current directory
        if isinstance(a.get(key), str):
            a[key] = os.path.abspath(a[key])
    bad, ok = [], []
    for key in sorted((set(a) | set(b)) - {"run_dir"}):  # where a run lives is not part of it (an unset one is named)
        if a.get(key) != b.get(key):
            (ok if key.startswith(MUTABLE) else bad).append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return bad, ok


def _rng_state() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            tensors[f"torch_cuda_{i}"] = torch.cuda.get_rng_state(i)
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [version, list(state), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    return tensors, plain


def _set_rng_state(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    for key, t in tensors.items():
        if key.startswith("torch_cuda_") and torch.cuda.is_available():
            i = int(key.rsplit("_", 1)[1])
            if i < torch.cuda.device_count():
                torch.cuda.set_rng_state(t, i)
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def write(out: Path, *, config: dict, policy: Transformer, save_policy_extras, reference: Transformer | None,
          planes_state: dict, stream, step: int, extra: dict, lora_base: dict | None = None) -> None:
    """Fill a checkpoint folder (see `twinplane.run.checkpoint` for the layout). `planes_state` is `Planes.state()`:
    optimizer state by parameter name with full tensors (loadable on any rank count), scheduler, engine RNGs; or
    (optimizer None) the ranks have written their shards into `out` already, and `policy` is not read for weights.
    `lora_base` ({path, sha256}): the policy is LoRA on that base; only its adapters are written."""
    shards = planes_state["optimizer"] is None
    if lora_base is not None:  # LoRA: the adapters only (PEFT folder); the base is referred to by path + sha256
        if not shards:
            save_adapter(policy, out / "adapter", lora_base["path"], lora_base.get("dropout", 0.0))
        extra = extra | {"lora_base": lora_base}
    else:  # HF folder: weights (not when sharded: policy/ holds them), config, tokenizer, generation config
        save_policy_extras(policy, out / "model", not shards)
    if reference is not None:
        save_file({n: t.contiguous().cpu() for n, t in export_weights(reference)},
                  out / "reference.safetensors")
    if not shards:
        torch.save(planes_state["optimizer"], out / "optimizer.pt")
    if planes_state.get("critic") is not None:  # PPO's value model and its AdamW state
        save_file({n: t.contiguous() for n, t in planes_state["critic"]["weights"].items()}, out / "critic.safetensors")
        torch.save(planes_state["critic"]["optimizer"], out / "critic_optimizer.pt")
    tensors, plain = _rng_state()
    tensors |= {f"engine_{i}": g for i, g in enumerate(planes_state["engine_rng"])}
    save_file(tensors, out / "rng.safetensors")
    state = {"step": step, "scheduler": planes_state["scheduler"], "stream": stream.state_dict(),
             "weight_version": planes_state["weight_version"], "rng": plain, **extra}
    (out / "state.json").write_text(json.dumps(state))
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    respect_umask(out)


def read_config(ckpt: Path) -> dict:
    try:
        saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt / 'config.yaml'}: not a readable config ({type(e).__name__})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt / 'config.yaml'}: expected a mapping of sections")
    return saved


def read_lora_base(ckpt: Path) -> dict | None:
    """{path, sha256} of the base a LoRA checkpoint's adapters belong to (None: a full-weight checkpoint)."""
    return json.loads((ckpt / "state.json").read_text()).get("lora_base")


def restore(ckpt: Path, *, policy: Transformer, reference: Transformer | None, stream) -> dict:
    """Load a checkpoint's weights into freshly built models (on any device), the data cursor and the process
    RNGs; returns state.json's contents plus `optimizer`, `engine_rng` and (with a critic) `critic`, for
    `Planes.load_state`. A sharded checkpoint leaves the policy as it is and returns `shards` (the folder) with
    `optimizer` None: the ranks read their own. A file of the wrong shape (its checksum can be right: it was
    written so) is a CheckpointError naming it."""
    try:
        return _restore(ckpt, policy=policy, reference=reference, stream=stream)
    except CheckpointError:
        raise
    except Exception as e:  # reading only the checkpoint's files: safetensors, torch and numpy raise many types
        raise CheckpointError(f"{ckpt}: a checkpoint file has the wrong shape ({first_line(e, typed=True)})") \
            from None


def _restore(ckpt: Path, *, policy: Transformer, reference: Transformer | None, stream) -> dict:
    state = json.loads((ckpt / "state.json").read_text())
    state["shards"] = ckpt if is_sharded(ckpt) else None
    if state["shards"] is not None:
        sharded.SafeReader(ckpt / "policy").read_metadata()  # readable before any worker is started for it
    elif (ckpt / "adapter").is_dir():  # LoRA: `policy` is the base with adapters applied; they take the saved ones
        load_adapter(policy, ckpt / "adapter")
    else:
        load_weights(policy, iter_safetensors(ckpt / "model"))
    if reference is not None and (ckpt / "reference.safetensors").exists():
        load_weights(reference, load_file(ckpt / "reference.safetensors").items())
    stream.load_state_dict(state["stream"])
    tensors = load_file(ckpt / "rng.safetensors")
    engines = sorted((k for k in tensors if k.startswith("engine_")), key=lambda k: int(k.split("_")[1]))
    state["engine_rng"] = [tensors.pop(k) for k in engines]
    _set_rng_state(tensors, state["rng"])
    state["optimizer"] = None if state["shards"] is not None else load_tensors(ckpt / "optimizer.pt")
    if (ckpt / "critic.safetensors").exists():
        state["critic"] = {"weights": load_file(ckpt / "critic.safetensors"),
                           "optimizer": load_tensors(ckpt / "critic_optimizer.pt")}
    return state


def is_sharded(ckpt: Path) -> bool:
    """The ranks wrote the policy's and optimizer's shards (`policy/`) rather than full tensors."""
    return sharded.is_sharded(ckpt / "policy")


def load_tensors(path: Path):
    """`torch.load(weights_only=True)`: tensors, numbers and containers only. Its refusals, which torch words in
    several paragraphs, become one line naming the file (CheckpointError)."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the refusal below says enough
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        text = " ".join(re.sub(r"\[enforce fail at [^]]*\][ .]*", "", str(e)).split())
        blocked = re.search(r"GLOBAL ([\w.]+)", text)
        if blocked:
            why = (f"not loadable as weights only: it pickles {blocked[1].rstrip('.')}, which unpickling would call "
                   "(refused: a checkpoint holds only tensors and numbers)")
        elif "legacy .tar format" in text:
            why = "a legacy .tar torch.save file, which cannot be loaded as weights only"
        elif isinstance(e, EOFError) or "central directory" in text:
            why = "truncated (not a complete torch.save archive)"
        elif isinstance(e, pickle.UnpicklingError):
            why = "not a file written by torch.save (unknown format)"
        else:
            why = f"not a readable torch.save archive ({text[:120]})"
        raise CheckpointError(f"{path}: {why}") from None

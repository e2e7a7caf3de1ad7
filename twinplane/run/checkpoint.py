"""Full-state checkpoints: written atomically, verified on load, pruned only after a newer one is complete.

Layout of `RUN_DIR/checkpoints/step_00000010/` (`checkpoint.format=full`, the default with one training rank):
  model/               the policy as an HF folder (config.json, model.safetensors, tokenizer, generation_config.json)
  adapter/             instead of model/ with LoRA: the adapters as a PEFT folder; the frozen base is not copied,
                       state.json's `lora_base` names it by path and sha256 (checked on resume and export)
  reference.safetensors the frozen reference policy, when it is not simply the unchanged `model.path`
  optimizer.pt         AdamW state (tensors and numbers only: loaded with `weights_only=True`)
  critic.safetensors, critic_optimizer.pt   PPO's value model and its AdamW state
  rng.safetensors      torch CPU / GPU generator states and the rollout engine's sampling generator
  state.json           step, scheduler, data cursor, weight version, python/numpy RNG, controller sums
  config.yaml          the resolved config of the run
  manifest.json        written last: every file's size and sha256. No manifest, no checkpoint.

`checkpoint.format=sharded` (the default with more than one training rank) keeps the rest but replaces the full
tensors with each rank's own shards, written by the ranks into the same temp folder (`twinplane.train.sharded`):
  policy/              the policy's trainable parameters and their AdamW state: DCP's .metadata, __R_0.distcp from
                       each training rank R, optimizer.json (param groups); with LoRA the adapters only
  critic/              the same for PPO's critic, from its ranks
  model/               the HF folder without its safetensors (export writes them from policy/); none with LoRA
A sharded checkpoint loads onto any number of ranks; the manifest covers its files like any others.

A checkpoint is assembled in `.tmp-step_*` beside its final name, each file fsynced, then renamed into place, so
a crash or a second SIGTERM mid-write leaves only a temp folder that resume ignores (and the next save removes).
Nothing here unpickles arbitrary objects: safetensors, JSON, YAML (safe), `torch.load(weights_only=True)` and DCP's
metadata through an unpickler that builds its own classes only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from twinplane.errors import InputError

MANIFEST = "manifest.json"
PREFIX = "step_"


class CheckpointError(InputError):
    """A checkpoint that was asked for by name is missing or damaged (bad input: exit code 2)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, step: int, write: Callable[[Path], None], keep: int,
         before_manifest: Callable[[], None] | None = None) -> Path:
    """`write(tmp_dir)` fills a temp folder; this seals it with a manifest and renames it to `step_N`."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a run killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    write(tmp)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for p in files:
        _fsync(p)
    if before_manifest is not None:
        before_manifest()
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                                        for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    for d in {tmp, *(p.parent for p in files)}:
        _fsync(d)
    if final.exists():  # re-saving a step after a resume: the new copy is complete before the old goes
        if verify(final) is None:
            shutil.rmtree(final)
        else:  # damaged: kept for inspection, never overwritten
            (root / "quarantine").mkdir(exist_ok=True)
            os.replace(final, root / "quarantine" / f"{final.name}.{os.getpid()}")
    os.replace(tmp, final)
    _fsync(root)
    complete = [c for c in list_checkpoints(run_dir) if verify(c) is None]
    for old in complete[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def step_of(ckpt: Path) -> int:
    """The step a verified checkpoint holds (its manifest's)."""
    return int(json.loads((ckpt / MANIFEST).read_text())["step"])


def verify(ckpt: Path) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except FileNotFoundError:
        return "incomplete (no manifest)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "corrupt manifest"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(m, dict) and isinstance(m.get("size"), int) and isinstance(m.get("sha256"), str)
            for m in files.values()):
        return "malformed manifest (expected files: {name: {size, sha256}})"
    for name, meta in files.items():
        p = ckpt / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            return f"malformed manifest (path {name!r} leaves the checkpoint)"
        if not p.is_file():
            return f"missing {name}"
        if p.stat().st_size != meta["size"]:
            return f"{name} is truncated ({p.stat().st_size} of {meta['size']} bytes)"
        if _sha256(p) != meta["sha256"]:
            return f"{name} fails its checksum"
    return None


def resolve(run_dir: Path, resume: str, log: Callable[[str], None] = print,
            damaged: list[tuple[Path, str]] | None = None) -> Path | None:
    """`auto`: the newest intact checkpoint in the run dir (None if there is none); a path: that one, verified.
    `damaged` collects (checkpoint, what is wrong) for every damaged one met, newer or older than the pick."""
    if resume != "auto":
        ckpt = Path(resume)
        if not ckpt.is_dir():
            raise CheckpointError(f"--resume {resume}: no such checkpoint folder")
        problem = verify(ckpt)
        if problem:
            raise CheckpointError(f"--resume {resume}: checkpoint is {problem}")
        return ckpt
    found = None
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify(ckpt)
        if problem is None:
            found = found or ckpt
            if damaged is None:
                return found
            continue
        log(f"skipping checkpoint {ckpt}: {problem}")
        if damaged is not None:
            damaged.append((ckpt, problem))
    return found

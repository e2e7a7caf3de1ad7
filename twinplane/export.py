"""`twinplane export`: a run's or a checkpoint's policy as a Hugging Face model folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from twinplane import checkpoint


def export(source: Path, out: Path) -> Path:
    """Copy the policy's HF folder (config.json, safetensors, tokenizer, generation_config.json) to `out`.

    `source` is a checkpoint folder (verified first) or a run dir (its newest intact checkpoint, else `final/`).
    The weights are plain safetensors written on whatever device trained them, so they load anywhere.
    """
    if not source.is_dir():
        raise checkpoint.CheckpointError(f"{source}: no such run dir or checkpoint folder")
    if out.exists() and out.resolve() == source.resolve():
        raise checkpoint.CheckpointError(f"--out {out}: is the source folder (choose a new one)")
    if (source / checkpoint.MANIFEST).exists():
        problem = checkpoint.verify(source)
        if problem:
            raise checkpoint.CheckpointError(f"{source}: checkpoint is {problem}")
        model_dir = source / "model"
    elif (ckpt := checkpoint.resolve(source, "auto", log=lambda m: None)) is not None:
        model_dir = ckpt / "model"
    elif (source / "final" / "config.json").exists():
        model_dir = source / "final"
    else:
        raise FileNotFoundError(f"{source}: not a checkpoint, and a run dir with no complete checkpoint or final/")
    if out.exists() and not out.is_dir():
        raise checkpoint.CheckpointError(f"--out {out}: is a file, not a folder")
    if out.resolve() in (source.resolve(), model_dir.resolve()) or model_dir.resolve() in out.resolve().parents:
        raise checkpoint.CheckpointError(f"--out {out}: is the source folder (choose a new one)")
    if out.is_dir() and any(out.iterdir()):
        raise checkpoint.CheckpointError(f"--out {out}: exists and is not empty (nothing is overwritten)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise checkpoint.CheckpointError(f"--out {out}: cannot create it ({e.strerror})") from None
    mode = 0o666 & ~_umask()  # readable by others under the usual umask, whatever the source's mode was
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copyfile(f, out / f.name)
            os.chmod(out / f.name, mode)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

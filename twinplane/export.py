"""`twinplane export`: a run's or a checkpoint's policy as a Hugging Face model folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from twinplane import checkpoint


def export(source: Path, out: Path) -> Path:
    """Copy the policy's HF folder (config.json, safetensors, tokenizer, generation_config.json) to `out`.

    `source` is a checkpoint folder (verified first) or a run dir (its newest intact checkpoint, else `final/`).
    The weights are plain safetensors written on whatever device trained them, so they load anywhere.
    """
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
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out

"""`twinplane export`: a run's or a checkpoint's policy as a Hugging Face model folder, or (LoRA) a PEFT adapter."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from twinplane.errors import InputError, first_line
from twinplane.run import checkpoint
from twinplane.run.run_dir import finished_steps

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json")


def _policy_dir(source: Path) -> Path:
    """The checkpoint (verified) or, for a run dir, its newest intact checkpoint, else `final/`."""
    if (source / checkpoint.MANIFEST).exists():
        problem = checkpoint.verify(source)
        if problem:
            raise checkpoint.CheckpointError(f"{source}: checkpoint is {problem}")
        return source
    if (ckpt := checkpoint.resolve(source, "auto", log=lambda m: None)) is not None:
        return ckpt
    if (source / "final" / "config.json").exists():
        return source / "final"
    if (source / "config.json").exists():  # e.g. RUN_DIR/final itself
        raise FileNotFoundError(f"{source}: already a Hugging Face model folder (transformers loads it as it is); "
                                "export takes a run dir or a checkpoint")
    raise FileNotFoundError(f"{source}: not a checkpoint, and a run dir with no complete checkpoint or final/")


def _adapter_dir(found: Path) -> Path | None:
    for d in (found / "adapter", found.parent / "final_adapter" if found.name == "final" else None):
        if d is not None and (d / "adapter_config.json").exists():
            return d
    return None


def export(source: Path, out: Path, fmt: str = "merged") -> tuple[Path, str]:
    """Write the policy to `out` (new or empty): `merged` (default) an HF folder (config.json, safetensors,
    tokenizer, generation_config.json) with any LoRA adapters folded in; `peft` the adapters alone
    (adapter_config.json + adapter_model.safetensors, for `peft.PeftModel.from_pretrained(base, out)`).

    `source` is a checkpoint folder (verified first) or a run dir (its newest intact checkpoint, else `final/`).
    The weights are plain safetensors written on whatever device trained them, so they load anywhere. Returns
    (`out`, which step it holds and where it came from)."""
    if fmt not in ("merged", "peft"):
        raise InputError(f"--format {fmt}: must be merged or peft")
    if not source.is_dir():
        raise checkpoint.CheckpointError(f"{source}: no such run dir or checkpoint folder")
    if out.exists() and out.resolve() == source.resolve():
        raise checkpoint.CheckpointError(f"--out {out}: is the source folder (choose a new one)")
    found = _policy_dir(source)
    what = _which_step(found)
    if found.name != "final" and (found / "policy" / ".metadata").is_file():
        return _from_shards(found, fmt, out), what
    adapter = _adapter_dir(found)
    if fmt == "peft":
        if adapter is None:
            raise InputError(f"{source}: no LoRA adapters to export (a full-weight run; use --format merged)")
        return _copy_files(adapter, _new_folder(out, adapter)), what
    if adapter is None or found.name == "final":  # full weights, or final/ (already merged)
        model_dir = found / "model" if (found / "model").is_dir() else found
        return _copy_files(model_dir, _new_folder(out, model_dir)), what
    return _merge(found, adapter, _new_folder(out, found)), what


def _which_step(found: Path) -> str:
    """'step N (FOLDER)': the RL step of a checkpoint (its manifest's) or of final/ (the run's summary.json)."""
    step = checkpoint.step_of(found) if found.name != "final" else finished_steps(found.parent)
    return f"step {step} ({found})" if step is not None else f"{found} (its step is not recorded)"


def _new_folder(out: Path, src: Path) -> Path:
    """`out`, created if needed: never a file, the source or inside it, nor a folder with files (no overwrite)."""
    if out.exists() and not out.is_dir():
        raise checkpoint.CheckpointError(f"--out {out}: is a file, not a folder")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise checkpoint.CheckpointError(f"--out {out}: is the source folder (choose a new one)")
    if out.is_dir() and any(out.iterdir()):
        raise checkpoint.CheckpointError(f"--out {out}: exists and is not empty (nothing is overwritten)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise checkpoint.CheckpointError(f"--out {out}: cannot create it ({e.strerror})") from None
    return out


def _copy_files(src: Path, out: Path, skip: tuple[str, ...] = ()) -> Path:
    mode = 0o666 & ~_umask()  # readable by others under the usual umask, whatever the source's mode was
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in skip):
            shutil.copyfile(f, out / f.name)
            os.chmod(out / f.name, mode)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _from_shards(ckpt: Path, fmt: str, out: Path) -> Path:
    """A sharded checkpoint's policy, built here from the `model.` entries of `policy/` alone (the optimizer's state
    is never read): an HF folder, or with LoRA the base with the adapters folded in, or the adapters (`peft`). The
    model is built through the implementation the run chose (`model.impl`), so the parameters carry its names."""
    # (torch and the model load only for the exports that rebuild weights, here and below)
    from twinplane.model.lora import apply_lora, merge_lora
    from twinplane.model.lora_io import save_adapter
    from twinplane.run.run_state import read_config, read_lora_base

    base = read_lora_base(ckpt)
    if base is None:
        if fmt == "peft":
            raise InputError(f"{ckpt}: no LoRA adapters to export (a full-weight run; use --format merged)")
        model = _empty_policy(ckpt)
        _read_shards(ckpt, model)
        _save(model, _new_folder(out, ckpt))
        _copy_files(ckpt / "model", out)  # (last: config.json as the run wrote it, as a full checkpoint holds it)
        return out
    lora = read_config(ckpt)["train"]["lora"]
    model = _lora_base(ckpt, base)  # (an hf base takes PEFT's layers: `apply_lora` hands it to the model)
    apply_lora(model, lora["rank"], float(lora["alpha"]), float(lora.get("dropout", 0.0)), lora["targets"])
    _read_shards(ckpt, model)  # the trainable parameters: the adapters
    if fmt == "peft":
        save_adapter(model, _new_folder(out, ckpt), base["path"], base.get("dropout", 0.0))
        return out
    _copy_files(Path(base["path"]), _new_folder(out, ckpt), skip=WEIGHT_FILES)
    _save(merge_lora(model), out)
    return out


def _empty_policy(ckpt: Path):
    """A full-weight checkpoint's model from its `model/config.json`, through the implementation the run chose,
    on the CPU with its weights left for the shards (which bring their own dtypes)."""
    import torch

    from twinplane.model import ModelConfig, Transformer
    from twinplane.model.impl import choose
    from twinplane.run.run_state import read_config

    model_dir, model_cfg = ckpt / "model", read_config(ckpt)["model"]
    if choose(model_dir, model_cfg.get("impl", "auto")).impl == "hf":
        return _hf_policy(ckpt, model_cfg)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_file(model_dir))
    dtype = json.loads((model_dir / "config.json").read_text()).get("torch_dtype", "float32")
    return model.to_empty(device="cpu").to(getattr(torch, dtype))


def _hf_policy(ckpt: Path, model_cfg: dict):
    """The transformers model of `model/config.json`. Parameters its code freezes (ERNIE-4.5-MoE's and Laguna's
    router correction biases) are in no shard (`policy/` holds the trainable ones): such a model is loaded from the
    run's `model.path`, which is where the run, resumed, takes them from too."""
    from twinplane.model.hf import build_hf, load_hf
    from twinplane.model.hf_config import HFConfig
    from twinplane.platform import runtime

    model = build_hf(HFConfig.from_folder(ckpt / "model"))
    frozen = next((n for n, p in model.named_parameters() if not p.requires_grad), None)
    if frozen is None:
        return model
    path = model_cfg.get("path")
    if not path or not (Path(path) / "config.json").is_file():
        raise checkpoint.CheckpointError(f"{ckpt}: {frozen} is frozen in {model.config.architecture}, so no shard "
                                         f"holds it, and the run's model.path {path} that does is missing")
    return load_hf(path, "cpu", runtime.resolve_dtype(model_cfg["dtype"]))


def _read_shards(ckpt: Path, model) -> None:
    from twinplane.train import sharded  # (loads torch.distributed.checkpoint)

    try:
        sharded.load_model_only(ckpt / "policy", model)
    except Exception as e:  # the checksums held, so the files are as written: by something else, or for another model
        raise checkpoint.CheckpointError(f"{ckpt / 'policy'}: not this run's sharded policy "
                                         f"({first_line(e, typed=True)})") from None


def _save(model, out: Path) -> None:
    """A merged model's config.json and safetensors: transformers' own config for a model run with its code."""
    from twinplane.model import save_pretrained
    from twinplane.model.hf import HFCausalLM

    model.save_pretrained(out) if isinstance(model, HFCausalLM) else save_pretrained(model, out)


def _lora_base(ckpt: Path, base: dict):
    """The LoRA base a checkpoint names, checked against its sha256, in the run's dtype on the CPU, through the
    implementation the run chose (`model.impl`)."""
    from twinplane.model import load_model  # (these load torch: see `_from_shards`)
    from twinplane.model.hf import load_hf
    from twinplane.model.impl import choose
    from twinplane.model.lora_io import base_sha256
    from twinplane.platform import runtime
    from twinplane.run.run_state import read_config

    base_dir = Path(base["path"])
    if not (base_dir / "config.json").exists():
        raise FileNotFoundError(f"{ckpt}: its LoRA base {base_dir} is missing")
    if base_sha256(base_dir) != base["sha256"]:
        raise checkpoint.CheckpointError(f"{ckpt}: its LoRA base {base_dir} changed since the checkpoint "
                                         "(sha256 differs)")
    model_cfg = read_config(ckpt)["model"]
    dtype = runtime.resolve_dtype(model_cfg["dtype"])
    if choose(base_dir, model_cfg.get("impl", "auto")).impl == "hf":
        return load_hf(base_dir, "cpu", dtype)
    return load_model(base_dir, device="cpu", dtype=dtype)


def _merge(ckpt: Path, adapter: Path, out: Path) -> Path:
    """A LoRA checkpoint's base (checked against its sha256) with the adapters folded in, as an HF folder; the
    tokenizer and generation config come from the base folder."""
    from twinplane.model.lora import merge_lora  # (these load torch: see `_from_shards`)
    from twinplane.model.lora_io import apply_adapter
    from twinplane.run.run_state import read_lora_base

    base = read_lora_base(ckpt)
    model = merge_lora(apply_adapter(_lora_base(ckpt, base), adapter))
    _copy_files(Path(base["path"]), out, skip=WEIGHT_FILES)
    _save(model, out)
    return out

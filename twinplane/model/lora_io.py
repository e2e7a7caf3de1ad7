"""LoRA adapters on disk in the PEFT format, and the identity (path + sha256) of the base they adapt.

A folder with `adapter_config.json` + `adapter_model.safetensors` is what `peft.PeftModel.from_pretrained(base, dir)`
loads: tensor names `base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]), the
same matrices as twinplane's `<module>.lora_A` / `<module>.lora_B` parameters and PEFT's own layers'
`<module>.lora_A.default.weight` (a model run with transformers' code: PEFT writes those, `hf_lora.save_peft`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from twinplane.model.lora import PEFT_ADAPTER, LoraLinear, adapted, apply_lora, is_adapter
from twinplane.model.weights import INDEX, checkpoint_files

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def base_sha256(path: str | Path) -> str:
    """sha256 over the base model's config.json and weight files, in order: what a LoRA checkpoint refers to."""
    path = Path(path)
    files = [path / "config.json", *(f for f in [path / INDEX] if f.exists()), *checkpoint_files(path)]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def save_adapter(model: torch.nn.Module, out: str | Path, base_path: str, dropout: float = 0.0,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write `model`'s adapters as a PEFT folder (`tensors`: full adapter tensors by twinplane name, e.g. gathered
    from FSDP shards; default: the model's own)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers = adapted(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    if tensors is None:
        tensors = {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}
    if not isinstance(layers[0].module, LoraLinear):  # PEFT's layers: PEFT writes its own
        from twinplane.model.hf_lora import save_peft

        save_peft(model, out, base_path, tensors)
        return
    state = {f"{_PREFIX}{n}.weight": t.detach().float().contiguous().cpu() for n, t in tensors.items()}
    first = layers[0].module
    targets = sorted({a.name.rsplit(".", 1)[-1] for a in layers})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
              "r": first.rank, "lora_alpha": first.alpha, "lora_dropout": dropout, "target_modules": targets,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "use_rslora": False, "use_dora": False, "modules_to_save": None}
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    save_file(state, out / WEIGHTS, metadata={"format": "pt"})


def read_adapter_config(path: str | Path) -> dict:
    path = Path(path) / CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable adapter config ({e})") from None
    if cfg.get("peft_type") != "LORA" or not isinstance(cfg.get("r"), int):
        raise ValueError(f"{path}: not a LoRA adapter config (peft_type {cfg.get('peft_type')!r})")
    return cfg


def file_key(name: str) -> str:
    """An adapter parameter's tensor name in PEFT's file: `x.lora_A` (twinplane's) and `x.lora_A.default.weight`
    (PEFT's layer) are both `base_model.model.x.lora_A.weight`."""
    return _PREFIX + (name.replace(f".{PEFT_ADAPTER}.", ".") if name.endswith(".weight") else f"{name}.weight")


def load_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a PEFT folder's adapter tensors into `model`, which must already carry matching adapters."""
    params = dict(model.named_parameters())
    state = load_file(Path(path) / WEIGHTS)
    by_key = {file_key(n): n for n in params if is_adapter(n)}
    wanted = set(by_key.values())
    got = {}
    for key, t in state.items():
        name = by_key.get(key.replace(f".{PEFT_ADAPTER}.", "."))
        if name is None:
            raise ValueError(f"{path}: adapter tensor {key!r} matches no LoRA layer of this model")
        if params[name].shape != t.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(t.shape)}, the model's is {tuple(params[name].shape)}")
        got[name] = t
    missing = sorted(wanted - set(got))
    if missing:
        raise ValueError(f"{path}: missing {len(missing)} adapter tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for name, t in got.items():
            params[name].copy_(t)


def apply_adapter(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Wrap `model` (a base) with the adapters of a PEFT folder, as configured there."""
    cfg = read_adapter_config(path)
    targets = cfg["target_modules"]  # PEFT's: a list of names, or a regex (all-linear is written resolved)
    apply_lora(model, cfg["r"], float(cfg["lora_alpha"]), 0.0, f"re:{targets}" if isinstance(targets, str) else targets)
    load_adapter(model, path)
    return model

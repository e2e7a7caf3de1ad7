"""HF-format safetensors in and out (single file or sharded with an index); one loop over name -> tensor."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from twinplane.model.config import ModelConfig
from twinplane.model.families import family
from twinplane.model.family import same_name, same_tensor
from twinplane.model.transformer import Transformer
from twinplane.platform import runtime

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Buffers some exporters write that have no parameter here (rope is recomputed from the config).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def checkpoint_files(path: Path) -> list[Path]:
    if (path / INDEX).exists():
        index = json.loads((path / INDEX).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    if (path / SINGLE).exists():
        return [path / SINGLE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no {SINGLE}, {INDEX} or *.safetensors")
    return files


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in checkpoint_files(Path(path)):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def naming(model: torch.nn.Module) -> tuple[Callable, Callable]:
    """(from_checkpoint, to_checkpoint) name maps of a model: its family's for the native decoder; any other model
    (transformers' own, model.impl=hf) has its parameters named as its checkpoints are."""
    if isinstance(model, Transformer):
        fam = family(model.config.model_type)
        return fam.from_checkpoint, fam.to_checkpoint
    return same_name, same_tensor


def skipped(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether a checkpoint tensor is one the model's family skips on load (`Family.ignored`)."""
    ignored = family(model.config.model_type).ignored if isinstance(model, Transformer) else None
    return (lambda name: False) if ignored is None else (lambda name: ignored.match(model.config, name))


def load_weights(model: Transformer, named: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
    """Copy named tensors into the model's parameters (casting dtype/device). Used for loading a checkpoint
    and for the trainer -> engine weight sync alike. Names are ours or the published per-expert ones
    (`...mlp.experts.E.gate_proj.weight`), which fill one expert's slice of a stacked parameter. FSDP2-sharded
    parameters (DTensors) take their shard of a full tensor given by our name: then a collective, every rank
    loads the same names in the same order."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    to_param, skip = naming(model)[0], skipped(model)
    if isinstance(model, Transformer):  # quantized tensors the family reads (`Family.dequantize`) made plain
        for plain in family(model.config.model_type).dequantize.values():
            named = plain(named)
    seen, slices = set(), {}
    with torch.no_grad():
        for name, tensor in named:
            if name.endswith(IGNORED_SUFFIXES) or skip(name):
                continue
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy of the embedding
            target, expert = to_param(name)
            p = params.get(target)
            if p is None or (expert is not None and expert >= p.shape[0]):
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {model.config.model_type} model")
            if expert is not None:
                p = p[expert]
            if not tensor.is_floating_point():  # a cast would turn it into plausible-looking weights
                raise ValueError(f"{name}: checkpoint dtype {tensor.dtype} is not a floating-point type")
            if p.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(p.shape)}")
            if isinstance(p, DTensor):
                tensor = distribute_tensor(tensor.to(p.device, p.dtype), p.device_mesh, p.placements)
            p.copy_(tensor)
            if expert is None:
                seen.add(target)
            else:
                slices.setdefault(target, set()).add(expert)
    seen |= {n for n, got in slices.items() if len(got) == params[n].shape[0]}
    missing = set(params) - seen
    if strict and missing:
        raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def save_pretrained(model: Transformer, out: str | Path, max_shard_bytes: int | None = None) -> None:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`) that transformers loads."""
    out = Path(out)
    save_config(model, out)
    from twinplane.model.export import export_weights  # lazily: it loads torch.distributed.tensor (seconds)

    published = naming(model)[1]
    state = {name: t.contiguous().cpu() for n, p in export_weights(model) for name, t in published(n, p)}
    if max_shard_bytes is None or sum(t.nbytes for t in state.values()) <= max_shard_bytes:
        save_file(state, out / SINGLE, metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name, t in state.items():
        if current and size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.nbytes for t in state.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_config(model: Transformer, out: str | Path) -> None:
    """config.json (transformers' form, with the weights' dtype), the folder created if needed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf()
    cfg["torch_dtype"] = str(model.output_weight().dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def load_model(path: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None) -> Transformer:
    """Build the model from `path/config.json` and load its safetensors. dtype defaults to fp32."""
    cfg = ModelConfig.from_file(path)
    device = torch.device(device) if device is not None else runtime.default_device()
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(runtime.resolve_dtype(dtype))
    load_weights(model, iter_safetensors(path))
    return model.eval()


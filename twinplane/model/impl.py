"""Which implementation runs a model folder (`model.impl`): twinplane's own decoder or transformers' code.

- native: `ModelConfig.from_file` accepts the folder (a family twinplane implements, with values it supports);
- hf: transformers builds its architecture as a causal LM (`AutoConfig`, local files only, no remote code);
- auto: native where it accepts the folder; hf for an architecture twinplane has no family for. A folder of a
  native family that native refuses (a value out of range, an unsupported option) keeps native's error, with the
  hint that `model.impl=hf` runs it through transformers: a typo is never silently run by other code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from twinplane.errors import InputError, first_line
from twinplane.model.config import ModelConfig
from twinplane.model.families import FAMILIES
from twinplane.model.layer import DecoderLayer

if TYPE_CHECKING:
    from torch import nn

IMPLS = ("auto", "native", "hf")


@dataclass
class Choice:
    impl: str  # "native" | "hf"
    reason: str  # one line: why this folder gets it
    architecture: str  # the config's architectures[0] (or its model_type)


def _hf_json(path: Path) -> dict:
    try:
        hf = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise InputError(f"{path / 'config.json'}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path / 'config.json'}: invalid JSON ({first_line(e)})") from None
    if not isinstance(hf, dict):
        raise InputError(f"{path / 'config.json'}: expected an object")
    return hf


def _architecture(hf: dict) -> str:
    arch = hf.get("architectures")
    return arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else str(hf.get("model_type"))


def native_family(model_type) -> bool:
    """Whether twinplane implements `model_type` (a declaration in twinplane/model/families/)."""
    return isinstance(model_type, str) and model_type in FAMILIES


def hf_problem(path: Path, hf: dict) -> str | None:
    """Why transformers cannot build the folder's architecture as a causal LM, or None."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if hf.get("model_type") not in CONFIG_MAPPING_NAMES:
        return f"transformers {transformers.__version__} does not know model_type {hf.get('model_type')!r}"
    try:
        cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # an unknown model_type, remote code, a bad value: transformers' many error types
        return f"transformers {transformers.__version__} cannot read it ({first_line(e)})"
    known = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
    arch = _architecture(hf)
    wanted = [a for a in (hf.get("architectures") or []) if isinstance(a, str)]
    if known is None or (wanted and not any(a.endswith("ForCausalLM") or a == known for a in wanted)):
        return f"{arch} is not a causal LM in transformers {transformers.__version__}"
    if hf.get("quantization_config"):
        return "quantized checkpoints are not supported (train the unquantized model)"
    return None


def choose(path: str | Path, impl: str = "auto") -> Choice:
    """The implementation for the model folder `path` under `model.impl=impl`; an InputError (one line naming the
    folder and the architecture) when none can run it."""
    if impl not in IMPLS:
        raise InputError(f"model.impl: must be one of {', '.join(IMPLS)}, got {impl!r}")
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: no such folder")
    hf = _hf_json(path)
    arch = _architecture(hf)
    native_error = None
    if impl != "hf":
        try:
            ModelConfig.from_file(path)
            return Choice("native", f"{arch}: a family twinplane implements (model.impl={impl})", arch)
        except (ValueError, FileNotFoundError) as e:
            native_error = first_line(e)
        if impl == "native" or native_family(hf.get("model_type")):
            hint = "" if impl == "native" else "; model.impl=hf runs it with transformers' code"
            raise InputError(f"{native_error}{hint}")
    problem = hf_problem(path, hf)
    if problem is not None:
        why = f"{path}: {arch} cannot run: {problem}"
        raise InputError(why if native_error is None else f"{why}; natively: {native_error}")
    if impl == "hf":
        return Choice("hf", f"{arch}: transformers' modeling code (model.impl=hf)", arch)
    return Choice("hf", f"{arch}: no native family for model_type {hf.get('model_type')!r}, so transformers' "
                  "modeling code (model.impl=auto)", arch)


def portable_paths(mc: ModelConfig) -> list[str]:
    """Where a native model leaves the fast kernels for the portable torch path, and why (the backends decide this
    per layer as they run; this says it up front)."""
    fam = FAMILIES[mc.model_type]
    out = []
    if fam.decoder_layer is not DecoderLayer:
        out.append(f"{mc.model_type}'s own blocks are not swapped for the engine's Triton or CPU-prepacked variants "
                   "(written for the shared Llama-style blocks)")
    if mc.attn_logit_softcapping is not None:
        out.append("soft-capped attention scores (attn_logit_softcapping): no flash/flex kernel caps scores (the "
                   "Triton paged decode does)")
    out += fam.portable
    if mc.kv_lora_rank:
        out.append("latent attention's compressed KV pool: wider than the fused kernels' head sizes")
    if mc.linear_layers:
        out.append("Gated DeltaNet layers: torch's chunked and recurrent forms, no fused kernel, no decode graphs")
    return out


def describe(path: str | Path, impl: str = "auto") -> list[str]:
    """`twinplane doctor --model DIR`: which implementation the folder gets and why, and what that means for a
    run, one fact per line (nothing is loaded but config.json: hf models are built on the meta device)."""
    choice = choose(path, impl)
    lines = [f"model: {path}", f"architecture: {choice.architecture}",
             f"implementation: {choice.impl} ({choice.reason})"]
    if choice.impl == "native":
        mc = ModelConfig.from_file(path)
        ignored = FAMILIES[mc.model_type].ignored
        note = None if ignored is None else ignored.note(mc)
        return lines + [f"parameters: {mc.num_params:,} (from config.json)",
                        "rollout: the own engine (paged KV cache, continuous batching) or vLLM",
                        *(f"portable path: {why}" for why in portable_paths(mc)), *([note] if note else [])]
    from twinplane.model.hf_config import HFConfig, build_meta, decoder_layers

    try:
        model = build_meta(path)
        layers = decoder_layers(model)
    except Exception as e:  # transformers' own errors for values its model code refuses
        raise InputError(f"{path}: transformers cannot build {choice.architecture} ({first_line(e)})") from None
    cfg = HFConfig.from_model(model, layers)
    return lines + [
        f"parameters: {cfg.num_params:,} (counted on the meta device; tied embeddings "
        f"{'yes' if cfg.tie_word_embeddings else 'no'})",
        f"decoder layers: {len(layers)} x {type(layers[0]).__name__} (FSDP2 units)",
        f"memory estimate: weights exact, activations and KV cache estimated as for a standard decoder "
        f"(hidden {cfg.hidden_size}, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, head dim {cfg.head_dim})",
        "packed training: checked on the first packed forward (padded rows where transformers' packing does not "
        "hold); shared prompts run as padded rows",
        f"gradient checkpointing: {'yes' if model.supports_gradient_checkpointing else 'no'}",
        lora_line(model),
        "rollout: twinplane.rollout.hf_engine (transformers' KV cache, static batches); no vLLM, no asynchronous "
        "RL, no agents, no MoE routing replay",
    ]


def lora_line(model: nn.Module) -> str:
    """What `train.lora.targets=all` adapts in a transformers model (built on the meta device), through PEFT."""
    from twinplane.model.hf_lora import adapted_names, peft_targets

    form = "all-linear" if peft_targets(model, "all") == "all-linear" else "the Llama-style projection names"
    try:
        return f"LoRA targets: {','.join(adapted_names(model, 'all'))} (train.lora.targets=all: {form}, through PEFT)"
    except ValueError as e:  # (PEFT missing, or nothing to adapt)
        return f"LoRA targets: none ({first_line(e)})"

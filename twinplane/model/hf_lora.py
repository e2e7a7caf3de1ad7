"""LoRA on a model run with transformers' code (`model.impl=hf`) through PEFT: `peft.LoraConfig` and
`peft.inject_adapter_in_model` put PEFT's own LoRA layers into the transformers model, so any linear layer PEFT can
target is adaptable, and the saved adapter is PEFT's own (`save_peft`).

`train.lora.targets` in PEFT's terms (`peft_targets`):
- `all` (default): the Llama-style projection names the model has (`q_proj` ... `down_proj`, `qkv_proj`,
  `gate_up_proj`: what twinplane's own LoRA targets), else PEFT's `all-linear`;
- `all-linear`: every linear layer (`nn.Linear`, transformers' `Conv1D`) but the output layer;
- a comma list of module names or dotted suffixes of them (`query_key_value`, `attention.dense`);
- `re:REGEX`: PEFT's regex form, matched against whole module names.
PEFT's linear LoRA layers only: the LM head is refused (twinplane makes logits from its weight directly, so an
adapter there would never run), as are embeddings and other layer types (a merge is W + s B A).

Parameters keep PEFT's names (`...query_key_value.base_layer.weight`, `...lora_A.default.weight`): the trainer,
the engine's copy, checkpoints and the adapter-only sync use them as they are; a merged export folds the adapters
in and drops `base_layer` (`twinplane.model.lora.adapted`). As with twinplane's own LoRA, the adapters are fp32
whatever the base's dtype, A is drawn from the run's seed (kaiming-uniform, PEFT's default) and B = 0, and the
global RNG stream is left as it was.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from twinplane.errors import first_line
from twinplane.model.lora import PEFT_ADAPTER, TARGETS, adapted, is_adapter

NO_PEFT = "train.lora.rank: LoRA on a model run with transformers' code goes through PEFT: pip install peft"


def peft_targets(hf: nn.Module, targets: str | Sequence[str]) -> str | list[str]:
    """PEFT's `target_modules` for `train.lora.targets` (a list is taken as PEFT's list)."""
    if not isinstance(targets, str):
        return list(targets)
    t = targets.strip()
    if t == "all":
        present = {name.rsplit(".", 1)[-1] for name, m in hf.named_modules() if type(m) is nn.Linear}
        return [n for n in TARGETS if n in present] or "all-linear"
    if t.startswith("re:"):
        return t[3:]
    return t if t == "all-linear" else [n.strip() for n in t.split(",") if n.strip()]


def lora_config(hf: nn.Module, rank: int, alpha: float, dropout: float, targets: str | Sequence[str]):
    """A fresh `peft.LoraConfig` (PEFT writes the modules it resolved into the one it injects with)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError(NO_PEFT) from None
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=peft_targets(hf, targets),
                      bias="none", task_type="CAUSAL_LM")


def inject(hf: nn.Module, config) -> list[str]:
    """PEFT's LoRA layers put into the transformers model `hf` in place; the adapted modules' names. A target that
    matches nothing, the LM head or a layer other than a linear one is a ValueError naming train.lora.targets."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear, LoraLayer

    head = hf.get_output_embeddings()  # (before PEFT may wrap it)
    t = config.target_modules
    wanted = t if isinstance(t, str) else ",".join(sorted(t))
    try:
        with warnings.catch_warnings():  # (a Conv1D target: PEFT turns on fan_in_fan_out and says so)
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            inject_adapter_in_model(config, hf, adapter_name=PEFT_ADAPTER)
    except ValueError as e:  # PEFT's: targets that match no module (NoMatchingPeftModuleError), or a layer it lacks
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in hf.named_modules() if _linear(m) and m is not head})
        why = f"{wanted} matches no module" if type(e).__name__ == "NoMatchingPeftModuleError" else first_line(e)
        raise ValueError(f"train.lora.targets: {why} of {type(hf).__name__} (its linear layers: "
                         f"{', '.join(linears)})") from None
    names = []
    for name, m in hf.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        base = m.get_base_layer()
        if base is head:
            raise ValueError(f"train.lora.targets: {name} is the LM head, whose weight twinplane multiplies directly "
                             "(an adapter there would never run); it is never a LoRA target")
        if not isinstance(m, Linear):
            raise ValueError(f"train.lora.targets: {name} is a {type(base).__name__}; LoRA here adapts linear layers "
                             "only (nn.Linear, Conv1D)")
        names.append(name)
    return names


def _linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def apply_peft(model: nn.Module, rank: int, alpha: float, dropout: float, targets: str | Sequence[str],
               seed: int = 0) -> int:
    """PEFT's LoRA on an `HFCausalLM` (its transformers model's children are the wrapper's own, so the layers PEFT
    replaces are the wrapper's too); PEFT freezes the rest. Returns the number of adapted layers."""
    with torch.random.fork_rng(devices=[]):  # PEFT draws A from the global RNG: drawn again below, from `seed`
        names = inject(model.hf, lora_config(model.hf, rank, alpha, dropout, targets))
    gen = torch.Generator().manual_seed(seed)
    for a in adapted(model):
        bound = 1 / math.sqrt(a.a.shape[1])  # kaiming_uniform_(a=sqrt(5)), PEFT's default
        a.a.data = torch.empty(a.a.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen).to(a.a.device)
        a.b.data = torch.zeros(a.b.shape, dtype=torch.float32, device=a.b.device)
    return len(names)


def adapted_names(hf: nn.Module, targets: str) -> list[str]:
    """The layer names (last component) `targets` adapts in `hf`, found by injecting into it (build it on the meta
    device: nothing is allocated for the base)."""
    return sorted({n.rsplit(".", 1)[-1] for n in inject(hf, lora_config(hf, 1, 1.0, 0.0, targets))})


def save_peft(model: nn.Module, out: Path, base_path: str, tensors: dict[str, torch.Tensor]) -> None:
    """The adapters as PEFT's `save_pretrained` writes them (`adapter_config.json`: the config injected with;
    `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight` ...), from the full adapter tensors by
    parameter name."""
    from peft.utils import get_peft_model_state_dict

    config = copy.deepcopy(model.hf.peft_config[PEFT_ADAPTER])
    if isinstance(config.target_modules, set):  # (written as a list: a set's order differs between processes)
        config.target_modules = sorted(config.target_modules)
    config.base_model_name_or_path, config.inference_mode = base_path, True
    config.save_pretrained(str(out))
    full = {n: t.detach().float().contiguous().cpu() for n, t in tensors.items() if is_adapter(n)}
    state = get_peft_model_state_dict(model.hf, state_dict=full, adapter_name=PEFT_ADAPTER,
                                      save_embedding_layers=False)
    save_file({f"base_model.model.{k}": v for k, v in state.items()}, out / "adapter_model.safetensors",
              metadata={"format": "pt"})

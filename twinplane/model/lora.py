"""LoRA (Hu et al. 2021): low-rank adapters on the linear layers of attention and MLP, by module replacement.

`apply_lora(model, rank, alpha, dropout, targets)` swaps each targeted `nn.Linear` for a `LoraLinear` that keeps
the same `weight`/`bias` Parameters (no copy; HF names unchanged) and adds `lora_A` [r, in] and `lora_B` [out, r]:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

Deviations from / choices beyond the paper: A is initialised like PEFT's default (kaiming-uniform, a=sqrt(5)) and
B = 0, so step 0 is exactly the base model. The base stays frozen in its storage dtype (bf16 on GPU); the adapters
are fp32 parameters wherever they live (trainer and engines), and the low-rank product is computed in fp32 and
cast to the base output's dtype, as PEFT does. No attention or MLP code changes: the model only sees Linears.

`adapters_disabled(model)` turns the adapters off (the reference policy is the base itself), `merge_lora(model)`
folds them into plain Linears (for an engine that decodes at base speed, and for a merged export).

This is the native decoder's LoRA. A model run with transformers' code (`model.impl=hf`) takes PEFT's own LoRA
layers instead (`twinplane.model.hf_lora`, which `apply_lora` hands it to); `adapted(model)` sees both kinds, so
the exports, the merge, the reference and the weight sync work on either.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.precision import fp32_names

# The targetable layers: every linear of attention and MLP (never the embedding or the LM head).
# (qkv_proj, gate_up_proj: the fused projections of the families that publish them so, GLM's MLP and Phi-3)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
PEFT_ADAPTER = "default"  # the adapter name PEFT's layers hold the run's one adapter under
_PEFT_TENSOR = re.compile(rf"\.lora_[AB]\.{PEFT_ADAPTER}\.weight$")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter tensor (`...q_proj.lora_A`, PEFT's `...lora_A.default.weight`)."""
    return name.endswith(ADAPTER_SUFFIXES) or _PEFT_TENSOR.search(name) is not None


class LoraLinear(nn.Linear):
    """An `nn.Linear` (same `weight` and `bias` Parameters) plus a low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: nothing is copied
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        dev = base.weight.device
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)), PEFT's and nn.Linear's default
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(dev))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=torch.float32, device=dev))  # [out, r]
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = super().forward(x)  # the base: nn.Linear's, or a prepacked one (twinplane.rollout.prepacked)
        if not self.enabled:
            return y
        h = self.dropout(x).to(self.lora_A.dtype)
        return y + (F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling).to(y.dtype)

    def delta(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        """The weight update scaling * B A [out, in] in fp32 (full `a`/`b` may be passed in for sharded params)."""
        a = self.lora_A if a is None else a
        b = self.lora_B if b is None else b
        return (b.float() @ a.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def parse_targets(targets: str | Sequence[str]) -> list[str]:
    """"all" (or empty) = every attention and MLP linear; otherwise the named ones ("q_proj,v_proj" or a list)."""
    if isinstance(targets, str):
        targets = targets.split(",")
    names = [t.strip() for t in targets if t.strip()]
    return list(TARGETS) if not names or names == ["all"] else names


def targets_problem(targets: str, native: bool) -> str | None:
    """Why `train.lora.targets` cannot be taken, or None: its form (all, all-linear, re:REGEX or a comma list of
    module names) for any model; for the native decoder (`native`) also a form or name only PEFT takes."""
    t = targets.strip()
    if t.startswith("re:"):
        try:
            re.compile(t[3:])
        except re.error as e:
            return f"{t} is not a regular expression ({e})"
    elif t not in ("all", "all-linear") and not all(re.fullmatch(r"[\w.]+", n.strip()) for n in t.split(",")):
        return "must be all, all-linear, re:REGEX or a comma list of module names"
    peft_only = t == "all-linear" or t.startswith("re:") or not set(parse_targets(t)) <= set(TARGETS)
    if native and t != "all" and peft_only:
        return (f"must be all or a comma list of {','.join(TARGETS)} for the native decoder (all-linear, re:REGEX and "
                "other module names are PEFT's, for models run with transformers' code: model.impl=hf)")
    return None


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets: str | Sequence[str] = "all",
               seed: int = 0) -> int:
    """Freeze `model` and wrap its targeted Linears in place; returns the number of layers wrapped.

    Adapters are initialised from their own generator (`seed`), so the global RNG stream is untouched. A model run
    with transformers' code brings its own: PEFT's LoRA layers (`HFCausalLM.apply_lora`)."""
    if hasattr(model, "apply_lora"):
        return model.apply_lora(rank, alpha, dropout, targets, seed)
    names = parse_targets(targets)
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        raise ValueError(f"train.lora.targets: unknown layer {unknown[0]!r} (choose from {', '.join(TARGETS)})")
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    wrapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in names and type(child) is nn.Linear:
                setattr(parent, child_name, LoraLinear(child, rank, alpha, dropout, gen))
                wrapped += 1
    return wrapped


@dataclass
class Adapted:
    """One adapted layer as the exports, the merge and the reference see it: a `LoraLinear`, or PEFT's LoRA layer
    (`model.impl=hf`), whose base parameters sit in its `base_layer`."""
    name: str  # the layer's module name
    module: nn.Module
    base: str  # the module name of its base `weight` / `bias`
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float
    transposed: bool  # a base weight stored [in, out] (transformers' Conv1D: PEFT's fan_in_fan_out)

    def delta(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        """The base weight's update scaling * B A in fp32, in the base weight's layout (full `a`/`b` may be passed
        in for sharded params)."""
        d = ((self.b if b is None else b).float() @ (self.a if a is None else a).float()) * self.scaling
        return d.T if self.transposed else d

    @property
    def enabled(self) -> bool:
        return self.module.enabled if isinstance(self.module, LoraLinear) else not self.module.disable_adapters

    @enabled.setter
    def enabled(self, on: bool) -> None:
        if isinstance(self.module, LoraLinear):
            self.module.enabled = on
        else:  # (PEFT's switch: it freezes the adapters while off and makes them trainable again)
            self.module.enable_adapters(on)


def adapted(model: nn.Module) -> list[Adapted]:
    """Every adapted layer of `model`, in module order."""
    peft = sys.modules.get("peft.tuners.lora")  # (PEFT's layers exist only once PEFT is imported)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            out.append(Adapted(name, m, name, m.lora_A, m.lora_B, m.scaling, False))
        elif peft is not None and isinstance(m, peft.LoraLayer):
            out.append(Adapted(name, m, f"{name}.base_layer", m.lora_A[PEFT_ADAPTER].weight,
                               m.lora_B[PEFT_ADAPTER].weight, m.scaling[PEFT_ADAPTER], m.fan_in_fan_out))
    return out


def has_lora(model: nn.Module) -> bool:
    return bool(adapted(model))


def merged_names(model: nn.Module) -> dict[str, str]:
    """Base parameter names that merging changes (PEFT's `x.base_layer.weight` -> `x.weight`): the names a merged
    export gives."""
    prefixes = {f"{a.base}.": f"{a.name}." for a in adapted(model) if a.base != a.name}
    out = {}
    for name, _ in model.named_parameters():
        prefix = name[:name.rfind(".") + 1]
        if prefix in prefixes:
            out[name] = prefixes[prefix] + name[len(prefix):]
    return out


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model for the duration: the reference policy with no second copy in memory."""
    layers = adapted(model)
    states = [a.enabled for a in layers]
    for a in layers:
        a.enabled = False
    try:
        yield model
    finally:
        for a, s in zip(layers, states, strict=True):
            a.enabled = s


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += scaling * B A, computed in fp32) and put plain layers back:
    the result is an ordinary model with base parameter names. In place; returns `model`."""
    for a in adapted(model):
        parent_name, _, child_name = a.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(a.module, LoraLinear):
            w = a.module.weight
            plain = nn.Linear(a.module.in_features, a.module.out_features, bias=a.module.bias is not None,
                              device="meta")
            plain.weight, plain.bias = a.module.weight, a.module.bias
        else:  # PEFT's layer: its base layer itself
            plain = a.module.get_base_layer()
            w = plain.weight
        w.copy_((w.float() + a.delta()).to(w.dtype))
        setattr(parent, child_name, plain)
    return model


def cast_base(model: nn.Module, dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Module:
    """Move the model's parameters to `device` with the base in `dtype`, the adapters and the parameters a family
    holds in fp32 (`precision.fp32_names`) kept in fp32 (casting the whole model with `.to(dtype)` would round
    the adapters)."""
    fp32 = fp32_names(model)
    for name, p in model.named_parameters():
        p.data = p.data.to(device=device, dtype=torch.float32 if is_adapter(name) or name in fp32 else dtype)
    return model


def adapter_numel(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))

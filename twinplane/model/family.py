"""What a model family is to twinplane: one declaration per `model_type`, one file each in twinplane/model/families/.

A family says
- how its config.json reads (`read`: the ModelConfig fields that differ by family, from both the transformers 4.x
  and 5.x forms) and writes back (`write`);
- which options of its transformers config it does not implement (`unsupported`): each is accepted at its neutral
  value only and otherwise refused with one line naming the feature, so that a model never runs as a slightly
  different one;
- its decoder layer (`decoder_layer`, Llama's pre-norm block unless the family's differs) and MLP block (`mlp`);
- its checkpoint names where they differ from the parameters' (`from_checkpoint`, `to_checkpoint`), and the
  checkpoint tensors it has no parameters for and skips on load (`ignored`).
What every family shares (sizes, rope, norm epsilon, activation, token ids) ModelConfig.from_hf reads itself. Both
planes, `save_pretrained` and the vLLM weight mapping read the declaration; none of them tests a family's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from twinplane.model.blocks import RMSNorm, dense_mlp
from twinplane.model.layer import DecoderLayer

if TYPE_CHECKING:
    from twinplane.model.config import ModelConfig


@dataclass(frozen=True)
class Option:
    """An option of the family's transformers config that twinplane does not implement."""

    neutral: Any  # the value that leaves the model as implemented; a callable: a test of the value
    feature: str  # what any other value turns on (the refusal names it)

    def accepts(self, value) -> bool:
        return self.neutral(value) if callable(self.neutral) else value == self.neutral


def same_name(name: str) -> tuple[str, int | None]:
    return name, None


def same_tensor(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor)]


@dataclass(frozen=True)
class Ignored:
    """Checkpoint tensors a family's model has no parameters for, skipped on load as transformers skips them
    (`_keys_to_ignore_on_load_unexpected`): never trained, synced or saved. Any other unknown tensor is refused."""

    match: Callable[[ModelConfig, str], bool]  # (config, checkpoint tensor name) -> one of them
    note: Callable[[ModelConfig], str | None]  # what `doctor --model` says of them for a config (None: nothing)


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # transformers' class name, written to config.json
    read: Callable[[dict], dict]  # config.json -> the family's ModelConfig fields
    write: Callable[[ModelConfig], dict]  # the family's config.json keys
    mlp: Callable[[ModelConfig, int], nn.Module] = dense_mlp  # (cfg, layer) -> the layer's MLP block
    # (cfg, layer, mlp builder) -> the decoder layer: the pre-norm block, or a subclass overriding `block`
    decoder_layer: Callable[..., nn.Module] = DecoderLayer
    unsupported: Mapping[str, Option] = field(default_factory=dict)
    # the config key whose activation ModelConfig.from_hf holds to silu; None: the family's `read` checks its own
    activation_key: str | None = "hidden_act"
    norm: Callable[[int, float], nn.Module] = RMSNorm  # (dim, eps) -> the final norm
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the weights' dtype (Gemma)
    # checkpoint tensor name -> (parameter name, expert index of a stacked parameter or None)
    from_checkpoint: Callable[[str], tuple[str, int | None]] = same_name
    # (parameter name, tensor) -> its tensors by published name
    to_checkpoint: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] = same_tensor
    ignored: Ignored | None = None  # checkpoint tensors skipped on load (multi-token-prediction layers)
    # quantization method (`quantization_config.quant_method`) -> what turns a checkpoint's (name, tensor) stream of
    # that method into plain weights on load (`weights.load_weights`); any other quantized checkpoint is refused
    dequantize: Mapping[str, Callable[[Iterable[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]]] = \
        field(default_factory=dict)

    # what in this family's layers no fused kernel implements, so they run the portable path (`doctor --model`)
    portable: tuple[str, ...] = ()

    def layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return self.decoder_layer(cfg, index, self.mlp)

    def check(self, hf: dict) -> None:
        """Refuse, with one line naming the feature, an option set to anything but its neutral value."""
        for key, option in self.unsupported.items():
            if key in hf and not option.accepts(hf[key]):
                raise ValueError(f"{self.model_type}: {key}={hf[key]!r} turns on {option.feature}, which twinplane "
                                 "does not implement")


def layer_windows(hf: dict, window: int | None, derived: Callable[[int], bool]) -> dict:
    """`sliding_window` and `layer_types` of a config whose layers may differ (transformers 5.x's `layer_types`,
    else `derived(i)`: whether layer i slides): `layer_types` stays None where every layer attends alike. A kind
    other than full or sliding attention, or sliding layers without a window, is refused by name."""
    types = hf.get("layer_types") or ["sliding_attention" if window and derived(i) else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
    kinds = set(types)
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"{hf.get('model_type')}: layer_types {sorted(kinds)}: only full_attention and "
                         "sliding_attention are implemented")
    if kinds == {"full_attention"}:
        return dict(sliding_window=None, layer_types=None)
    if not window:
        raise ValueError(f"{hf.get('model_type')}: layer_types has sliding_attention layers but no sliding_window "
                         "is in use (use_sliding_window / sliding_window)")
    return dict(sliding_window=window, layer_types=None if kinds == {"sliding_attention"} else list(types))


# Options several families' transformers configs define that change what the model computes.
DROPOUT = {"attention_dropout": Option(lambda v: not v, "dropout on the attention weights in training")}

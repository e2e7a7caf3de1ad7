"""The transformers fallback: any `AutoModelForCausalLM` run with transformers' own modeling code, behind the
interface of `Transformer`, so that the trainer, the reference, checkpoints, weight sync and saving use it
unchanged (`model.impl=hf`; which folders get it: `twinplane.model.impl`); LoRA puts PEFT's own layers into it
(`twinplane.model.hf_lora`).

`HFCausalLM` holds the transformers model's children as its own (`model`, `lm_head`, or `gpt_neox`, `embed_out`,
...), so `named_parameters()` yields the checkpoint's names and `load_weights` / `export_weights` work by name as
for the native decoder. The forward takes what `Transformer`'s does:
- padded rows with a mask: transformers' own masking, positions counting real tokens (left padding works);
- packed rows (`AttentionMetadata.packed`): one row with positions restarting per sequence and no mask, from which
  transformers builds a block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`). Whether the
  model's attention honours it is measured once (`packing_agrees`); where it does not, and for shared prompts
  (`meta.prefix`, which position restarts cannot express), the sequences run as padded rows instead;
- logits are `hidden @ output_weight().T`, then the final soft-cap where the config has one (the trainer's chunked
  log-probs and the engines compute that); a scale after the LM head is folded into the hidden states. `check_head`
  proves it at load against the model's own logits; a bias or another transform is refused.
MoE routing record/replay is twinplane's own experts' and is refused here.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.attention import AttentionMetadata
from twinplane.model.hf_config import HFConfig, decoder_layers
from twinplane.model.transformer import cap_logits

NO_ROUTING = ("MoE routing record/replay needs a native model: model.impl=hf runs transformers' experts, whose "
              "choices twinplane does not see")


class HFCausalLM(nn.Module):
    def __init__(self, hf: nn.Module):
        super().__init__()
        if next(hf.parameters(recurse=False), None) is not None:
            raise ValueError(f"{type(hf).__name__} holds parameters outside its submodules")
        object.__setattr__(self, "hf", hf)  # not a child: its children are ours, so the names stay transformers'
        for name, child in hf.named_children():
            self.add_module(name, child)
        self.config = HFConfig.from_model(hf, decoder_layers(hf))
        # What some families do to the LM head's output, which the shared head path (the trainer's chunked
        # log-probs, the engine's sampling) reproduces: a scale, folded into the hidden states (the LM head is
        # linear), and Gemma 2's tanh soft-cap, applied wherever logits are made. `check_head` proves the result.
        c = hf.config
        self.logit_scale = float(getattr(c, "logit_scale", None) or 1.0) / float(getattr(c, "logits_scaling", None)
                                                                                  or 1.0)
        self.config.final_logit_softcapping = getattr(c, "final_logit_softcapping", None)
        self._checkpointing = False
        self._compiled = False
        self._packs: bool | None = None  # measured on the first packed forward (`packing_agrees`)

    # --- what the planes read, as on `Transformer` ---------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return decoder_layers(self.hf)

    def output_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        self.hf.training = mode  # (the wrapped model's own flag: transformers reads it too)
        return self

    @property
    def activation_checkpointing(self) -> bool:
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        """transformers' gradient checkpointing of each decoder layer (training forwards only, as native)."""
        if on and not self.hf.supports_gradient_checkpointing:
            raise ValueError(f"train.activation_checkpointing: {self.config.architecture} does not support "
                             "transformers' gradient checkpointing")
        if on:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self._checkpointing:
            self.hf.gradient_checkpointing_disable()
        self._checkpointing = bool(on)

    @property
    def compile_layers(self) -> bool:
        return self._compiled

    @compile_layers.setter
    def compile_layers(self, on: bool) -> None:
        """Each decoder layer's forward compiled for training forwards (eval forwards stay eager), inside the
        layer's call so that FSDP2's hooks stay outside the compiled region, as the native layers do."""
        if on and not self._compiled:
            for layer in self.layers:
                layer.forward = TrainingCompiled(layer)
        self._compiled = self._compiled or bool(on)

    # --- forwards ---------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, logits_start: int = 0,
                meta: AttentionMetadata | None = None,
                head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None, routing=None) -> torch.Tensor:
        """As `Transformer.forward`: logits [B, T - logits_start, V], or `head(hidden, output weight)`."""
        h = self.hidden_states(input_ids, attention_mask, meta, routing)
        if head is not None:  # (the head applies `config.final_logit_softcapping` itself)
            return head(h, self.output_weight())
        return cap_logits(F.linear(h[:, logits_start:], self.output_weight()), self.config.final_logit_softcapping)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      meta: AttentionMetadata | None = None, routing=None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D]."""
        if routing is not None:
            raise ValueError(NO_ROUTING)
        if meta is not None and meta.paged is not None:
            raise ValueError("model.impl=hf: the paged KV layout is the native engine's (hf rolls out with "
                             "twinplane.rollout.hf_engine)")
        if meta is not None and meta.varlen:
            if meta.prefix is None and self.packs():
                return self.backbone(input_ids, None, meta.positions)
            return self.unpacked(input_ids, meta)
        if meta is not None:
            return self.backbone(input_ids, attention_mask, meta.positions)
        valid = None if attention_mask is None else attention_mask.bool()
        positions = None if valid is None else (valid.long().cumsum(1) - 1).clamp(min=0)
        return self.backbone(input_ids, attention_mask, positions)

    def backbone(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 positions: torch.Tensor | None, cache=None) -> torch.Tensor:
        """transformers' decoder (embedding, layers, final norm). No cache unless given: transformers detects
        packed rows only without one."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        extra = {} if cache is None else {self.cache_argument: cache}
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                 use_cache=cache is not None, **extra)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h if self.logit_scale == 1.0 else h * self.logit_scale

    @functools.cached_property
    def decoder(self) -> nn.Module:
        """The module that owns the decoder layers (embedding, layers, final norm: hidden states out). Not
        `base_model` or `get_decoder()`, which some causal LMs (Llama 4's) answer with themselves."""
        layers = decoder_layers(self.hf)
        return next(m for m in self.hf.modules() if any(c is layers for c in m.children()))

    @functools.cached_property
    def cache_argument(self) -> str:
        """The KV cache's keyword: `cache` from transformers 5.2x on, `past_key_values` before (which newer versions
        would take as an unknown keyword and ignore, decoding without the context)."""
        forward = inspect.signature(self.decoder.forward).parameters
        return "cache" if "cache" in forward else "past_key_values"

    def unpacked(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A packed row [1, T] run as right-padded rows, one per sequence (a sequence continuing a parent, shared
        prompts, runs after a copy of the parent's tokens); back to [1, T, D]."""
        cu = meta.offsets()
        spans = list(zip(cu[:-1], cu[1:], strict=True))
        prefix = meta.prefix or [-1] * len(spans)
        rows = [(list(range(*spans[p])) if p >= 0 else []) + list(range(*spans[s])) for s, p in enumerate(prefix)]
        width = max(len(r) for r in rows)
        dev = input_ids.device
        index = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], device=dev)  # [S, W]
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=dev)
        h = self.backbone(input_ids[0][index], mask, torch.arange(width, device=dev)[None].expand_as(index))
        own = [i * width + (len(r) - (b - a)) + j for i, (r, (a, b)) in enumerate(zip(rows, spans, strict=True))
               for j in range(b - a)]
        return h.flatten(0, 1)[torch.tensor(own, device=dev)][None]

    def packs(self) -> bool:
        if self._packs is None:
            self._packs = self.packing_agrees()
        return self._packs

    @torch.no_grad()
    def packing_agrees(self) -> bool:
        """Whether a packed row (positions restarting, no mask) keeps its sequences apart in this model: the second
        sequence's hidden states packed vs alone, against the same row with a full causal mask (the leak a model
        that ignores packing shows). Agreement is judged relative to that leak, so it needs no dtype tolerance."""
        was = self.training
        self.eval()
        try:
            dev, V = self.output_weight().device, self.config.vocab_size
            a, b = (torch.arange(6, device=dev) * 7 + 3) % V, (torch.arange(5, device=dev) * 11 + 5) % V
            row, pos = torch.cat([a, b])[None], torch.cat([torch.arange(6, device=dev), torch.arange(5, device=dev)])
            alone = self.backbone(b[None], None, pos[None, 6:]).float()
            packed = self.backbone(row, None, pos[None])[:, 6:].float()
            leak = self.backbone(row, torch.ones_like(row), pos[None])[:, 6:].float()
        finally:
            self.train(was)
        return bool((packed - alone).norm() <= 0.1 * (leak - alone).norm())

    @torch.no_grad()
    def check_head(self) -> None:
        """Refuse a model whose logits are not `hidden @ output_weight().T` (see the module docstring): the LM head
        module's input and output are caught in one forward, so that a bias, a scale or soft-capping after it shows
        at any logit size, whatever the dtype (the same tensors, compared as they are)."""
        dev, V = self.output_weight().device, self.config.vocab_size
        ids = ((torch.arange(8, device=dev) * 13 + 1) % V)[None]
        seen = {}
        head = self.hf.get_output_embeddings()
        hook = head.register_forward_hook(lambda m, args, out: seen.update(h=args[0], out=out))
        try:
            logits = self.hf(input_ids=ids, use_cache=False).logits
        finally:
            hook.remove()
        h, out = seen["h"], seen["out"]
        plain = F.linear(h, self.output_weight())
        made = cap_logits(out.float() * self.logit_scale, self.config.final_logit_softcapping)
        try:  # (and this adapter's own path to the hidden states gives them)
            ours = self(ids).float()
        except RuntimeError:  # a shape that does not fit: not hidden states
            ours = torch.full_like(made, float("nan"))
        if not bool(made.isfinite().all()):
            raise ValueError(f"{self.config.architecture}: its logits on a test input are not finite (NaN or inf): "
                             f"its weights or activations overflow in {self.output_weight().dtype}")
        if not (torch.allclose(logits.float(), made, rtol=1e-5, atol=1e-5 * made.abs().max().item())
                and torch.allclose(ours, made, rtol=1e-3, atol=1e-3 * made.abs().max().item())
                and torch.allclose(out.float(), plain.float(), rtol=1e-3, atol=1e-3 * plain.abs().max().item())):
            raise ValueError(f"{self.config.architecture}: its logits are not the final hidden states times the "
                             "output embedding (a bias, soft-capping or scaling), which twinplane's log-probs and "
                             "sampling compute; model.impl=hf cannot train it")

    # --- saving -------------------------------------------------------------------------------------------------
    def save_config(self, out: str | Path) -> None:
        """config.json as transformers writes it, with the weights' dtype."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.hf.config.to_dict()
        cfg.pop("transformers_version", None)
        cfg["dtype"] = str(self.output_weight().dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))

    def apply_lora(self, rank: int, alpha: float, dropout: float, targets, seed: int) -> int:
        """LoRA through PEFT's layers (`twinplane.model.lora.apply_lora` hands a model run with transformers' code
        here)."""
        from twinplane.model.hf_lora import apply_peft

        return apply_peft(self, rank, alpha, dropout, targets, seed)

    def save_pretrained(self, out: str | Path) -> None:
        """config.json + model.safetensors by parameter name (the names transformers loads)."""
        from safetensors.torch import save_file

        from twinplane.model.export import export_weights

        self.save_config(out)
        state = {n: t.contiguous().cpu() for n, t in export_weights(self)}
        save_file(state, Path(out) / "model.safetensors", metadata={"format": "pt"})


class TrainingCompiled:
    """A decoder layer's forward: compiled (once, dynamic shapes) in training forwards with grad, eager otherwise.
    A plain object in the layer's `__dict__`, so a deep copy of the model gets one for its own layer."""

    def __init__(self, layer: nn.Module):
        self.layer, self.compiled = layer, None

    def __call__(self, *args, **kwargs):
        layer = self.layer
        eager = type(layer).forward.__get__(layer)
        if layer.training and torch.is_grad_enabled():
            if self.compiled is None:
                self.compiled = torch.compile(eager, dynamic=True)
            return self.compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    def __deepcopy__(self, memo):
        import copy

        return TrainingCompiled(copy.deepcopy(self.layer, memo))


def load_hf(path: str | Path, device: torch.device | str | None = None,
            dtype: torch.dtype | str | None = None) -> HFCausalLM:
    """A model folder through transformers (`AutoModelForCausalLM`, local files only), wrapped; fp32 by default."""
    import transformers

    from twinplane.platform import runtime

    device = torch.device(device) if device is not None else runtime.default_device()
    transformers.utils.logging.disable_progress_bar()  # (one bar per load on the console otherwise)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=runtime.resolve_dtype(dtype),
                                                           local_files_only=True)
    model = HFCausalLM(hf.to(device))
    model.check_head()
    return model.eval()


def build_hf(config: HFConfig, device: torch.device | str = "cpu") -> HFCausalLM:
    """The model `config` describes, its weights left uninitialised for a load by name to fill (a Ray worker's copy
    of the driver's model, an export's model of a sharded checkpoint); buffers (rope tables) are computed, on
    `device`."""
    import transformers

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    cfg = transformers.AutoConfig.for_model(**config.hf_dict)
    with no_init_weights():
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.tie_weights()  # (transformers 5.x's no_init_weights skips the tying too: a tied head would be a weight apart)
    return HFCausalLM(hf.to(device))

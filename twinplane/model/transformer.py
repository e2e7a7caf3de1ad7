"""One decoder implementation for every native family (twinplane/model/families/), serving both planes: embeddings,
the family's decoder layers, the final norm and the LM head, with the ropes and per-layer attention the config asks.

- training plane: `model(input_ids, attention_mask)` over a padded batch (left- or right-padded), or
  `model(input_ids, meta=AttentionMetadata.packed(lengths))` over packed sequences;
- rollout plane: `model.hidden_states(ids [1, T], meta=...)` with a paged-KV `AttentionMetadata` built by the
  engine (prefill chunks and decodes of many sequences in one row).
Attention only sees an `AttentionMetadata` (twinplane.model.attention): the layout of the tokens is the caller's.
Module and parameter names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`),
so checkpoints load with no renaming and what we save loads in transformers (stacked experts are the one
exception, mapped by the family's declaration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.attention import VARLEN_PREPARE, AttentionMetadata, build_mask
from twinplane.model.config import ModelConfig
from twinplane.model.families import family
from twinplane.model.moe import RoutingState
from twinplane.model.rope import longrope_inv_freq, longrope_pick, rope_attention_factor, rope_inv_freq


def cap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final-logit soft-capping, cap * tanh(logits / cap), in the logits' dtype (None: as they are); every
    maker of logits from `hidden_states` and `output_weight()` applies it (trainer log-probs, engine sampling)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(family(cfg.model_type).layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = family(cfg.model_type).norm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # Recompute each decoder block in backward instead of storing its activations (training forwards only).
        self.activation_checkpointing = False
        # Run each decoder block compiled (`compiled_layer`), training forwards only: eval forwards (scoring, a
        # rollout engine's copy) stay eager.
        self.compile_layers = False
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # fp32 and outside the module's buffers, so model.to(bf16) never rounds the rope frequencies.
        self._inv_freq = {torch.device("cpu"): rope_inv_freq(cfg)}
        self._rope_factor = rope_attention_factor(cfg)  # yarn scales cos and sin (1 otherwise)
        # Gemma 3: sliding layers rope with a base of their own, unscaled
        self._local_inv_freq = None if cfg.rope_local_theta is None else {torch.device("cpu"): rope_inv_freq(
            dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None))}
        self._layer_attention = [cfg.layer_attention(i) for i in range(cfg.num_layers)]  # None: as the metadata
        self._embed_scale = cfg.hidden_size ** 0.5 if family(cfg.model_type).scale_embeddings else None
        # longrope: the short and the long set, picked per token (`AttentionMetadata.rope_long`) or per forward
        self.longrope_limit = cfg.longrope_limit
        if self.longrope_limit is not None:
            self._inv_freq = {torch.device("cpu"): torch.stack((rope_inv_freq(cfg), longrope_inv_freq(cfg, True)))}

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False,
             long: torch.Tensor | None = None):
        """cos and sin [B, 1, T, hd] of the global rope, or with `local` of the sliding layers' own. `long` [B, T]:
        longrope's set per token (see `longrope_pick`)."""
        table = self._local_inv_freq if local else self._inv_freq
        inv_freq = table.get(positions.device)
        if inv_freq is None:
            inv_freq = table[positions.device] = table[torch.device("cpu")].to(positions.device)
        if self.longrope_limit is not None and not local:
            inv_freq = longrope_pick(positions, inv_freq[0], inv_freq[1], self.longrope_limit, long)
        freqs = positions[..., None].float() * inv_freq  # [B, T, rotary_dim/2], fp32 as in HF
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, rotary_dim]
        if self._rope_factor != 1.0 and not local:
            return (emb.cos() * self._rope_factor).to(dtype), (emb.sin() * self._rope_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, T], 1 = token, 0 = padding
        logits_start: int = 0,  # only compute logits for positions >= this (the response region)
        meta: AttentionMetadata | None = None,  # the caller's token layout (packed rows); None = from the mask
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,  # replaces the LM head, see below
        routing: RoutingState | None = None,  # MoE: record / replay expert choices, tokens in [B*T] order
    ) -> torch.Tensor:  # logits [B, T - logits_start, V]
        """`head(hidden [B, T, D], output weight [V, D])`, when given, is returned instead of the logits: the trainer's
        chunked log-probs read the LM head weight here, inside the forward, where FSDP has gathered it."""
        h = self.hidden_states(input_ids, attention_mask, meta, routing)
        if head is not None:  # (the head applies `config.final_logit_softcapping` itself)
            return head(h, self.output_weight())
        return cap_logits(F.linear(h[:, logits_start:], self.output_weight()), self.config.final_logit_softcapping)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      meta: AttentionMetadata | None = None, routing: RoutingState | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D] (what the LM head, or a reward head, reads)."""
        if meta is None:
            meta = self.dense_metadata(input_ids, attention_mask)
        x = self.model.embed_tokens(input_ids)
        if self._embed_scale is not None:  # (the scale rounded to the weights' dtype first, as transformers)
            x = x * torch.full((), self._embed_scale, device=x.device).to(x.dtype)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # mixed precision: the residual stream and cos/sin in the compute dtype,
            x = x.to(torch.get_autocast_dtype(dev))  # as with FSDP's params cast to it (half the elementwise bytes)
        cos, sin = self.rope(meta.positions, x.dtype, long=meta.rope_long)
        local = None if self._local_inv_freq is None else self.rope(meta.positions, x.dtype, local=True)
        training = self.training and torch.is_grad_enabled()
        recompute, compiled = self.activation_checkpointing and training, self.compile_layers and training
        # each layer's metadata: the forward's, or a view with the layer's own window / scale / soft-cap
        metas = [meta if a is None else meta.for_layer(*a) for a in self._layer_attention]
        if compiled:
            for m in {id(m): m for m in metas}.values():
                if m.varlen and m.backend in VARLEN_PREPARE:
                    VARLEN_PREPARE[m.backend](m)  # (host work: it would break a compiled graph)
        for layer, m in zip(self.model.layers, metas, strict=True):
            c, s = local if local is not None and m.window is not None else (cos, sin)
            x = layer(x, c, s, m, recompute, routing, compiled)
        return self.model.norm(x)

    def dense_metadata(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> AttentionMetadata:
        """Metadata for padded rows [B, T]: positions count real tokens only. A host mask without padding takes the
        fused causal kernel; a device mask is used as given (looking would wait for the device: a caller that knows
        its rows are whole passes None)."""
        B, T = input_ids.shape
        dev = input_ids.device
        valid = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        if attention_mask is not None and dev.type == "cpu" and bool(valid.all()):
            attention_mask = None  # no padding at all
        window, mask = self.config.sliding_window, None
        if attention_mask is not None or (window is not None and T > window):
            mask = build_mask(positions, positions, valid, torch.arange(T, device=dev), window)
        meta = AttentionMetadata(positions, mask=mask, window=window)
        meta.cache["valid"] = None if attention_mask is None else valid  # (per-layer windows rebuild the mask)
        return meta

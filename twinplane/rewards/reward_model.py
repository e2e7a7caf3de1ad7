"""A learned reward: a local sequence-classification checkpoint scored with twinplane's own decoder.

The checkpoint is transformers' `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification` layout
(and the other families `Transformer` reads): decoder weights under `model.*` plus `score.weight`
[num_labels, hidden], no LM head. The reward is the label-0 logit at each text's last token, which is what
those classes return for a right-padded batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from twinplane.model import ModelConfig, Transformer, iter_safetensors, load_weights
from twinplane.platform import runtime
from twinplane.tokenizer import load_tokenizer


class RewardModel:
    """`RewardModel(path)(texts) -> [score per text]`. Texts are tokenised with the checkpoint's tokenizer
    (its special tokens added, as transformers' tokenizer call does) and scored `batch_size` at a time,
    longest first, in inference mode."""

    def __init__(self, path: str | Path, device: str | torch.device | None = None,
                 dtype: torch.dtype | str | None = None, batch_size: int = 8):
        path = Path(path)
        self.device = runtime.resolve_device(None if device is None else str(device))
        self.dtype = runtime.resolve_dtype(dtype)
        self.batch_size = batch_size
        self.tokenizer = load_tokenizer(path)
        # Tied embeddings = no LM head module: a classifier checkpoint has none, and nothing reads one.
        cfg = dataclasses.replace(ModelConfig.from_file(path), tie_word_embeddings=True)
        why = self.tokenizer.vocab_mismatch(cfg.vocab_size)
        if why:
            raise ValueError(f"{path}: {why}")
        with torch.device("meta"):
            self.transformer = Transformer(cfg)
        self.transformer = self.transformer.to_empty(device=self.device).to(self.dtype).eval()
        backbone, score = [], None
        for name, tensor in iter_safetensors(path):
            if name == "score.weight":
                score = tensor
            elif name.startswith("model."):
                backbone.append((name, tensor))
            # anything else (an lm_head some exporters keep, score.bias-free heads' extras) is unused
        if score is None:
            raise KeyError(f"{path}: no score.weight (not a sequence-classification checkpoint)")
        if score.shape[1] != cfg.hidden_size:
            raise ValueError(f"{path}: score.weight {tuple(score.shape)} does not match hidden size {cfg.hidden_size}")
        load_weights(self.transformer, backbone)
        self.score = nn.Linear(cfg.hidden_size, score.shape[0], bias=False, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            self.score.weight.copy_(score)
        self.config_pad_id = cfg.pad_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else cfg.pad_token_id
        self.pad_id = pad if pad is not None else 0  # padding positions are masked out, so any id will do

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Right-padded ids/mask [B, T] -> logits [B, num_labels] at each row's last token.

        As transformers does, that is the last token whose id is not the config's `pad_token_id`: with
        eos-as-pad checkpoints a trailing eos is skipped, exactly as when the model was trained."""
        h = self.transformer.hidden_states(input_ids, attention_mask)  # [B, T, D]
        keep = attention_mask.bool()
        if self.config_pad_id is not None:
            keep &= input_ids != self.config_pad_id
        cols = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (cols * keep).argmax(-1)  # [B]; 0 when a row is all pad, as in transformers
        return self.score(h[torch.arange(len(h), device=h.device), last]).float()

    def __call__(self, texts: Sequence[str]) -> list[float]:
        ids = [self.tokenizer.encode(t, add_special_tokens=True) or [self.pad_id] for t in texts]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # similar lengths share a batch
        out = [0.0] * len(ids)
        for b in range(0, len(order), self.batch_size):
            rows = order[b:b + self.batch_size]
            width = max(len(ids[i]) for i in rows)
            x = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                x[r, :len(ids[i])] = torch.tensor(ids[i])
                mask[r, :len(ids[i])] = 1
            scores = self.logits(x.to(self.device), mask.to(self.device))[:, 0].tolist()
            for i, s in zip(rows, scores, strict=True):
                out[i] = s
        return out

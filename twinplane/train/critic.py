"""The critic of PPO: a value model (the policy's decoder family with a scalar `score` head, the layout of
transformers' `...ForTokenClassification` with one label) and its own optimizer.

`Critic.values(batch)` gives V(s_t) [N, R] for the state before each response token (the position whose logits
predict it, as verl's critic); `Critic.train_step(batch)` regresses them on `batch.returns` with the clipped value
loss. Micro-batching follows the policy's, so accumulation never changes the result.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from twinplane.algos import value_loss
from twinplane.model import ModelConfig, Transformer, load_weights
from twinplane.model.export import export_weights
from twinplane.train import fsdp, trainer
from twinplane.train.batch import Batch
from twinplane.train.logprobs import device_micro_batches
from twinplane.train.optim import build_optimizer, load_named_optimizer_state, named_optimizer_state


class ValueModel(Transformer):
    """The decoder (`model.*`, no LM head) and `score` = Linear(hidden, 1): HF names `model.*`, `score.weight`,
    `score.bias`, as `LlamaForTokenClassification(num_labels=1)`. The head starts at zero, so V = 0 at first."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True}))  # no lm_head parameter
        self.score = nn.Linear(cfg.hidden_size, 1)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                logits_start: int = 0) -> torch.Tensor:  # values [B, T - logits_start]
        if self.longrope_limit is not None and cache is None:  # each row with the set it takes alone, not the batch's
            cache = self.dense_metadata(input_ids, attention_mask)
            pos = cache.positions
            cache.rope_long = (pos.amax(1, keepdim=True) + 1 > self.longrope_limit).expand_as(pos)
        h = self.hidden_states(input_ids, attention_mask, cache)
        return self.score(h[:, logits_start:]).squeeze(-1).float()

    def output_weight(self) -> torch.Tensor:  # where the model lives (device, dtype), as for the policy
        return self.score.weight


def build_value_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                      dtype: torch.dtype) -> ValueModel:
    """A value model initialised from `weights`: a policy's (its decoder; the LM head is not used) or a value/reward
    model folder's (which may carry `score.*` too). Tensors the value model has no parameter for are skipped."""
    model = ValueModel(config)
    names = {n for n, _ in model.named_parameters()}
    state = [(n, t) for n, t in weights if n in names]
    missing = {n for n in names if not n.startswith("score.")} - {n for n, _ in state}
    if missing:
        raise KeyError(f"critic: starting weights lack {len(missing)} decoder tensors, e.g. {sorted(missing)[:3]}")
    load_weights(model, state, strict=False)
    return model.to(device=device, dtype=dtype)


def response_values(model: ValueModel, batch: Batch, padded: bool = True) -> torch.Tensor:
    """V(s_t) [N, R]: the value at each response token's predicting position (column P-1+t). `padded=False`: the
    caller knows the rows have no padding (the fused causal kernel, no mask), so the forward need not look."""
    mask = batch.attention_mask if padded else None
    return model(batch.input_ids, mask, logits_start=batch.prompt_len - 1)[:, :-1]


class Critic:
    """The value model with its AdamW (constant lr) and the PPO value loss; `group`: its FSDP2 ranks when sharded
    (each rank trains on its rows of the global batch, as `Trainer`)."""

    def __init__(self, model: ValueModel, lr: float, betas, weight_decay: float, value_clip: float, grad_clip: float,
                 micro_batch_size: int, max_tokens: int = 0, group=None, loss_agg: str = "token-mean"):
        """`loss_agg`: the value loss's aggregation over the global batch, token-mean or token-sum."""
        self.model, self.value_clip, self.grad_clip, self.loss_agg = model, value_clip, grad_clip, loss_agg
        self.micro_batch_size, self.max_tokens, self.group = micro_batch_size, max_tokens, group
        self.opt, self.sched = build_optimizer(model.parameters(), lr, betas, weight_decay, 0, 1, "constant")
        self.device = model.output_weight().device

    def _micro_batches(self, batch: Batch):
        """Padded micro-batches on the device, planned on the host (`device_micro_batches`), as the trainer's."""
        return device_micro_batches(batch, self.device, self.micro_batch_size, self.group, self.max_tokens,
                                    packed=False)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """[N, R] values of the response positions (0 at padding), micro-batched, without grad."""
        self.model.eval()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)
        i = 0
        for _, mb, weight, _, tokens in self._micro_batches(batch):
            v = response_values(self.model, mb, padded=tokens < mb.attention_mask.numel())
            if weight:
                out[i:i + len(mb), :v.shape[1]] = v * (mb.attention_mask[:, mb.prompt_len:] > 0)
                i += len(mb)
        return out

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the clipped value loss on `batch` (needs `old_values` and `returns`), a token mean
        (or sum, `loss_agg`) over the global batch. Metrics: critic/vf_loss, critic/vf_clipfrac, critic/grad_norm,
        kept on the device until the step's one read."""
        self.model.train()
        num_tokens = batch.num_response_tokens
        if self.group is not None:
            num_tokens = fsdp.all_reduce(num_tokens, self.group)
        num_tokens = max(num_tokens, 1)
        sums = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
        for _, mb, weight, _, tokens in self._micro_batches(batch):
            v = response_values(self.model, mb, padded=tokens < mb.attention_mask.numel())
            m = mb.response_mask
            loss, frac = value_loss(v, mb.old_values, mb.returns, m, clip=self.value_clip, agg=self.loss_agg,
                                    norm=num_tokens)
            (loss * weight).backward()
            sums["vf_loss"] = sums["vf_loss"] + weight * loss.detach().double()
            sums["vf_clipfrac"] = sums["vf_clipfrac"] + weight * frac.double() * m.sum(dtype=torch.float64) / num_tokens
        grad_norm = trainer.clip_and_step(self.model, self.opt, self.sched, self.grad_clip, self.device, readback=False)
        sums, grad_norm = trainer.step_readback(sums, grad_norm, self.group, self.device)
        return {f"critic/{k}": v for k, v in sums.items()} | {"critic/grad_norm": grad_norm}

    def named_weights(self):
        return export_weights(self.model)

    def state(self) -> dict:
        """Full weights and AdamW state by parameter name on the CPU, so they load on any layout. A collective when
        sharded: every rank calls. (No RNG: the value model has no dropout; the lr is constant.)"""
        return {"weights": {n: t.cpu().clone() for n, t in self.named_weights()},
                "optimizer": named_optimizer_state(self.model, self.opt)}

    def load_state(self, state: dict) -> None:
        load_weights(self.model, state["weights"].items())
        load_named_optimizer_state(self.model, self.opt, state["optimizer"])


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens (1 = perfect critic, 0 = no better than a constant)."""
    m = mask.float()
    n = m.sum().clamp(min=1)

    def var(x):
        mean = (x * m).sum() / n
        return ((x - mean) ** 2 * m).sum() / n

    vr = var(returns)
    return float(1 - var(returns - values) / vr) if vr > 0 else float("nan")


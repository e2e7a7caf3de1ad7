"""The training plane: scores batches and takes optimizer steps on the policy loss.

Interface used by the controller: `logprobs(batch)`, `train_step(batch) -> metrics`, `named_weights()`, `config`.
`Reference` is the frozen reference policy behind the same `logprobs(batch)` call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from twinplane.algos import Algorithm, as_algorithm, token_sum
from twinplane.config import AlgoSection, TrainSection
from twinplane.model import ModelConfig, Transformer
from twinplane.model.checksum import tensor_checksum
from twinplane.model.export import export_weights
from twinplane.model.lora import adapters_disabled, has_lora, is_adapter
from twinplane.platform import backends, runtime
from twinplane.train import fsdp
from twinplane.train.batch import Batch
from twinplane.train.logprobs import device_micro_batches, response_logprobs, score
from twinplane.train.offload import move_optimizer_state
from twinplane.train.optim import build_optimizer
from twinplane.train.routing import RoutingStats, routing_state


class Reference:
    """Frozen reference policy for the KL term."""

    def __init__(self, model: Transformer, temperature: float, micro_batch_size: int, group=None,
                 max_tokens: int = 0, train: TrainSection | None = None, routing_replay: bool = False):
        """`group`: the data-parallel process group when `model` is FSDP-sharded; `max_tokens`: the micro-batch
        token budget (0 = off), as `train.max_tokens_per_micro_batch`; `train`: packing, log-prob chunk and
        compute dtype as the trainer's (defaults when None); `routing_replay`: MoE, run the engine's recorded
        experts (`algo.routing_replay`). A `model` with LoRA adapters is the policy itself: the reference is its
        frozen base, scored with the adapters switched off (no second copy)."""
        self.shared = has_lora(model)
        self.model = model if self.shared else model.eval().requires_grad_(False)
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.group, self.max_tokens, self.replay = group, max_tokens, routing_replay
        self.train = train or TrainSection()
        self.device = model.output_weight().device
        self.precision = runtime.train_precision(self.device, model.output_weight().dtype, self.train.compute_dtype)
        self.chunk_tokens = backends.logprob_chunk_tokens(self.device, self.train.logprob_chunk_tokens)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        t = self.train
        self.model.eval()  # (the trainer puts a shared model back in train mode for its own forwards)
        with adapters_disabled(self.model) if self.shared else contextlib.nullcontext():
            return score(self.model, batch, self.temperature, self.micro_batch_size, self.group, self.max_tokens,
                         t.packing, self.chunk_tokens, self.precision, self.replay, t.share_prompts, self.device)


class Trainer:
    def __init__(self, model: Transformer, train: TrainSection, algo: Algorithm | AlgoSection, temperature: float,
                 total_steps: int, group=None, *, tis_cap: float | None = None, horizon: int = 0):
        """`algo`: the run's algorithm, or its config section alone (a trainer built by itself).
        `group`: the data-parallel process group when `model` is FSDP-sharded (`twinplane.train.fsdp`) and each
        rank passes its own rows to `train_step`; token means and metrics are then over the global batch.
        `tis_cap`: the off-policy correction (`Algorithm.off_policy`, truncating at `tis_cap`) for batches that
        carry both `old_logprobs` and `rollout_logprobs`, i.e. when the engine's weights may lag the trainer's;
        None = off.
        `horizon`: with `algo` a section, the generation cap (`Algorithm`'s `max_new_tokens`)."""
        self.model, self.cfg, self.temperature = model, train, temperature
        self.algo = as_algorithm(algo, horizon)
        self.group, self.tis_cap = group, tis_cap
        model.activation_checkpointing = train.activation_checkpointing
        self.opt, self.sched = build_optimizer(
            model.parameters(), train.lr, train.betas, train.weight_decay, train.warmup_steps, total_steps,
            train.schedule, train.min_lr_ratio)
        self.device = model.output_weight().device
        model.compile_layers = backends.compile_layers(self.device, train.compile)
        # one policy for 1 and N ranks: FSDP casts the gathered params (shard_model), autocast does the rest
        self.precision = runtime.train_precision(self.device, model.output_weight().dtype, train.compute_dtype)
        self.chunk_tokens = backends.logprob_chunk_tokens(self.device, train.logprob_chunk_tokens)
        self._frozen_sums: dict[torch.dtype, dict[str, int]] = {}
        # a training forward that draws dropout masks (LoRA dropout) is not the policy itself (`Batch.old_is_current`)
        self.stochastic = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def logprobs(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        c = self.cfg
        return score(self.model, batch, self.temperature, c.micro_batch_size, self.group,
                     c.max_tokens_per_micro_batch, c.packing, self.chunk_tokens, self.precision,
                     self.algo.cfg.routing_replay, c.share_prompts, self.device)

    def named_weights(self, dtype: torch.dtype | None = None, *, adapters_only: bool = False,
                      merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by name (`twinplane.model.export.export_weights`)."""
        return export_weights(self.model, dtype, adapters_only=adapters_only, merged=merged)

    def frozen_checksums(self, dtype: torch.dtype) -> dict[str, int]:
        """Per-tensor checksums of the frozen (non-adapter) weights in `dtype`, computed once: with LoRA the base
        never changes, so an adapter-only sync still verifies the engines' whole model without re-reading it here.
        A collective on the first call when sharded."""
        if dtype not in self._frozen_sums:
            self._frozen_sums[dtype] = {n: tensor_checksum(t) for n, t in export_weights(self.model, dtype)
                                        if not is_adapter(n)}
        return self._frozen_sums[dtype]

    def _global(self, x: float, op=None) -> float:
        return x if self.group is None else fsdp.all_reduce(x, self.group, *(() if op is None else (op,)))

    def _off_policy(self, batch: Batch) -> tuple[Batch, dict[str, torch.Tensor]]:
        """`batch` with the off-policy correction's weights and its masked tokens out of `response_mask`, and the
        correction's metrics (this rank's shares), computed on the device and read back with the step's others."""
        dev, mask = self.device, batch.response_mask
        ranks = 1 if self.group is None else dist.get_world_size(self.group)
        old, rollout, on_dev = (runtime.to_device(t, dev) for t in (batch.old_logprobs, batch.rollout_logprobs, mask))
        w, keep, stats = self.algo.off_policy(old, rollout, on_dev, self.tis_cap,
                                              max(self._global(float(mask.sum())), 1), ranks)
        if keep is not None:
            mask = mask * keep.to(mask.device, mask.dtype)
        return replace(batch, response_mask=mask, is_weights=w), stats

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch` (gradient-accumulated over micro-batches): the mechanics. The loss of each
        micro-batch is the algorithm's (`algos.Algorithm.loss`), normalised by the global batch's denominator, so
        micro-batching and data parallelism change nothing.

        The ratio's denominator is `old_logprobs` when recomputed, else the engine's `rollout_logprobs`. With
        `batch.old_is_current` pi_old is the policy this step's forwards evaluate, so each micro-batch takes its old
        log-probs from its own forward (detached) for the ratio and the correction, and the correction's metrics
        are taken over the whole batch after the last one: as a separate scoring pass would give, one forward
        fewer. A band mask (`algo.is_mask`) needs pi_old before the first micro-batch (it sets the loss's
        denominator) and a forward with dropout is not the policy itself: both score pi_old first instead.
        Every token-level metric is a token mean over the whole batch; `actor/logprob_gap` compares the
        engine's log-probs with this forward pass (meaningful on the first mini-batch, before any update).
        With `tis_cap` and both old and rollout log-probs, the off-policy correction (`Algorithm.off_policy`:
        by default each token's loss weighted by min(pi_old / pi_rollout, tis_cap)) is made on the whole batch
        first: tokens it masks leave the loss and its denominator. Its metrics are `actor/tis_*`.
        """
        tis = self.tis_cap is not None and batch.rollout_logprobs is not None
        if batch.old_is_current and (self.stochastic or (tis and self.algo.cfg.is_mask != "off")):
            batch = replace(batch, old_logprobs=self.logprobs(batch), old_is_current=False)
        current = batch.old_is_current
        tis = tis and (current or batch.old_logprobs is not None)
        corrected = {}
        if tis and not current:
            batch, corrected = self._off_policy(batch)
        self.model.train()
        num_tokens = max(self._global(batch.num_response_tokens), 1)  # for token-mean metrics
        norm = max(self._global(self.algo.normaliser(batch.response_mask)), 1)  # the loss's global denominator
        horizon = self.algo.loss_horizon(lambda: int(self._global(batch.response_mask.shape[1], dist.ReduceOp.MAX)))
        sums = dict.fromkeys(["pg_loss", "kl", "entropy", "clip_frac", "logprob_gap", "ratio"], 0.0) | corrected
        c = self.cfg
        moe = RoutingStats(self.config, self.device) if self.config.num_experts else None
        share = c.share_prompts and batch.routing is None and moe is None  # (MoE: see packed_layout)
        mbs = device_micro_batches(batch, self.device, c.micro_batch_size, self.group, c.max_tokens_per_micro_batch,
                                   c.packing, share)
        shared = 0  # prompt tokens not recomputed (train.share_prompts), for the FLOP count
        olds = torch.zeros(batch.response_mask.shape, device=self.device) if current and tis else None  # pi_old
        for rows, mb, weight, layout, tokens in mbs:
            rs = routing_state(mb, self.algo.cfg.routing_replay, c.packing, keep_logits=moe is not None)
            if layout is not None and weight:
                shared += tokens - sum(layout.lengths)
            with runtime.autocast(self.precision, self.device):
                lp, ent = response_logprobs(self.model, mb, self.temperature, with_entropy=True, packed=c.packing,
                                            chunk_tokens=self.chunk_tokens, routing=rs, layout=layout)
            m = mb.response_mask
            old = mb.old_logprobs if mb.old_logprobs is not None else mb.rollout_logprobs
            is_weights = mb.is_weights
            if current:  # whole rows: the sequence-level correction sees each sequence at once
                old = lp.detach() * m
                if tis:
                    is_weights = self.algo.off_policy(old, mb.rollout_logprobs, m, self.tis_cap)[0]
                    if weight:
                        olds[runtime.to_device(rows, self.device), :old.shape[1]] = old
            loss, stats = self.algo.loss(lp, old, mb.advantages, m, entropy=ent, ref_logprobs=mb.ref_logprobs,
                                         is_weights=is_weights, norm=norm, num_tokens=num_tokens, horizon=horizon)
            if moe is not None:  # load-balancing loss, weighted by the micro-batch's share of the step's tokens
                share = weight * mb.num_response_tokens / num_tokens
                loss = loss + c.router_aux_loss_coef * share * moe.aux_loss(rs, mb, share, c.packing)
            if mb.rollout_logprobs is not None:
                stats["logprob_gap"] = token_sum((lp.detach() - mb.rollout_logprobs).abs(), m, num_tokens)
            (loss * weight).backward()
            for k, v in stats.items():  # kept on the device: no host sync between micro-batches
                sums[k] = sums[k] + weight * torch.as_tensor(v).detach().to(self.device, torch.float64)
        if olds is not None:  # the correction's metrics over this rank's batch (the quantiles need all of it)
            sums |= self._off_policy(replace(batch, old_logprobs=olds))[1]
        lr = self.sched.get_last_lr()[0]  # the rate this update uses, read before the scheduler steps
        grad_norm = clip_and_step(self.model, self.opt, self.sched, self.cfg.grad_clip, self.device,
                                  self.cfg.optimizer_offload, readback=False)
        sums, grad_norm = step_readback(sums, grad_norm, self.group, self.device)
        out = {f"actor/{k}": v for k, v in sums.items()} | {"actor/grad_norm": grad_norm, "actor/lr": lr,
                                                             "actor/prompt_tokens_shared": self._global(shared)}
        return out | (moe.metrics(self.group) if moe is not None else {})


def step_readback(sums: dict[str, float | torch.Tensor], grad_norm: torch.Tensor, group,
                  device: torch.device) -> tuple[dict[str, float], float]:
    """A step's metric sums, reduced over `group`'s ranks, and its grad norm (global already): the step's one read
    from the device."""
    keys = list(sums)
    vals = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device) for k in keys])
    if group is not None:
        vals = runtime.collective_tensor(vals, group)
        dist.all_reduce(vals, group=group)
    *vals, norm = torch.cat([vals, grad_norm.detach().to(vals.device, torch.float64).reshape(1)]).tolist()
    return dict(zip(keys, vals, strict=True)), norm


def clip_and_step(model: torch.nn.Module, opt, sched, grad_clip: float, device: torch.device,
                  offload: bool = False, readback: bool = True) -> float | torch.Tensor:
    """Clip the global grad norm (0 = off), take the optimizer and scheduler steps, zero the grads; returns the
    norm before clipping (a device tensor unless `readback`). Shared by the policy and the critic."""
    clip = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    if offload:  # the moments visit the device only for the update
        move_optimizer_state(opt, device)
    opt.step()
    if offload:
        move_optimizer_state(opt, "cpu")
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(grad_norm) if readback else grad_norm

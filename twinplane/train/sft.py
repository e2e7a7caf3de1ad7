"""Supervised warm start: next-token cross-entropy on response tokens, through the same scoring path as RL."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from twinplane.model import Transformer
from twinplane.train.batch import Batch
from twinplane.train.logprobs import response_logprobs
from twinplane.train.optim import build_optimizer


def warm_start(model: Transformer, prompts: Sequence[list[int]], responses: Sequence[list[int]], steps: int,
               batch_size: int, lr: float, pad_id: int, seed: int, warmup_steps: int = 20,
               on_step: Callable[[int, float], bool] | None = None) -> list[float]:
    """`steps` AdamW steps on random batches of (prompt, response) pairs; returns the losses. The rate stays at its
    peak until the last 30% of the steps, which decay to 10% (warmup-stable-decay): a cosine from the start left the
    demo's model on its loss plateau for some seeds, with the rate already too low to leave it.
    `on_step(step, loss)` is called after each step (progress); returning True stops early (a stop request)."""
    rng = random.Random(seed)
    device = model.output_weight().device
    opt, sched = build_optimizer(model.parameters(), lr, (0.9, 0.98), 0.0, min(warmup_steps, steps), steps,
                                 "wsd", 0.1)
    model.train()
    losses = []
    for _ in range(steps):
        idx = rng.sample(range(len(prompts)), min(batch_size, len(prompts)))
        batch = Batch.collate([prompts[i] for i in idx], [responses[i] for i in idx], pad_id).to(device)
        lp, _ = response_logprobs(model, batch, temperature=1.0)
        loss = -(lp * batch.response_mask).sum() / batch.response_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None and on_step(len(losses), losses[-1]):
            break
    return losses

"""Supervised warm start: next-token cross-entropy on response tokens, through the same scoring path as RL.

Its schedule is warmup-stable-decay, and the decay waits for the model to have learned. A tiny model imitating a
task sits on a loss plateau (it predicts the answers' digit frequencies, not the answers) until its attention
finds the operands, and how long that takes depends on the initialisation and the data order: on an unlucky seed
the plateau outlasts a fixed stable phase, the rate decays while the model is still on it, and the warm start ends
having learned almost nothing. So when the decay is due, a progress check runs (greedy answers on held-out
examples); while it fails, the stable phase goes on, up to a step cap, and the result says what happened.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from twinplane.model import Transformer
from twinplane.train.batch import Batch
from twinplane.train.logprobs import response_logprobs
from twinplane.train.optim import build_optimizer


@dataclass
class Schedule:
    """The learning-rate factor per step: linear warmup, then the peak, then a cosine to `min_ratio` over the last
    `decay_steps`. The decay starts at `decay_from`, which `hold` moves later while the model has not learned."""
    warmup: int
    decay_from: int
    decay_steps: int
    min_ratio: float = 0.1

    @property
    def total(self) -> int:
        return self.decay_from + self.decay_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step < self.decay_from:
            return 1.0
        progress = min(1.0, (step - self.decay_from) / max(1, self.decay_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class WarmStartResult:
    losses: list[float] = field(default_factory=list)
    held: int = 0  # steps the decay waited beyond its planned start for the check to pass
    progress: float | None = None  # the check's last value (None: no check)
    learned: bool = True  # the check passed before the decay (or there was none)

    @property
    def steps(self) -> int:
        return len(self.losses)


@torch.no_grad()
def greedy_match(model: Transformer, prompts: Sequence[list[int]], responses: Sequence[list[int]],
                 pad_id: int) -> float:
    """The share of prompts whose greedy continuation is exactly `responses[i]` (EOS included): one teacher-forced
    forward, since greedy decoding reproduces a response iff each of its tokens is the argmax after its prefix."""
    was_training = model.training
    model.eval()
    batch = Batch.collate(prompts, responses, pad_id).to(model.output_weight().device)
    P, R = batch.prompt_len, batch.response_mask.shape[1]
    logits = model(batch.input_ids, batch.attention_mask, logits_start=P - 1)[:, :R]  # [N, R, V]
    hit = (logits.argmax(-1) == batch.response_ids) | (batch.response_mask == 0)
    model.train(was_training)
    return float(hit.all(-1).float().mean())


def warm_start(model: Transformer, prompts: Sequence[list[int]], responses: Sequence[list[int]], steps: int,
               batch_size: int, lr: float, pad_id: int, seed: int, warmup_steps: int = 20,
               on_step: Callable[[int, float], bool] | None = None, check: Callable[[], float] | None = None,
               target: float = 0.0, max_steps: int | None = None, check_every: int = 25) -> WarmStartResult:
    """AdamW steps on random batches of (prompt, response) pairs. The rate stays at its peak until the last 30% of
    `steps`, which decay to 10%; with a `check` (a score in [0, 1], e.g. `greedy_match` on held-out pairs), the
    decay starts only once the check reaches `target`, looked at every `check_every` steps from then on, and at
    the latest so that the run ends at `max_steps`. `on_step(step, loss)` is called after each step (progress);
    returning True stops early (a stop request)."""
    rng = random.Random(seed)
    device = model.output_weight().device
    decay = int(0.3 * steps)
    sched = Schedule(min(warmup_steps, steps), steps - decay, decay)
    last_start = max(max_steps or steps, steps) - decay  # the latest the decay may start
    opt, lr_sched = build_optimizer(model.parameters(), lr, (0.9, 0.98), 0.0, sched.warmup, sched.total, sched)
    out = WarmStartResult(learned=check is None)
    model.train()
    while out.steps < sched.total:
        idx = rng.sample(range(len(prompts)), min(batch_size, len(prompts)))
        batch = Batch.collate([prompts[i] for i in idx], [responses[i] for i in idx], pad_id).to(device)
        lp, _ = response_logprobs(model, batch, temperature=1.0)
        loss = -(lp * batch.response_mask).sum() / batch.response_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if check is not None and not out.learned and out.steps + 1 == sched.decay_from:
            out.progress = check()  # the decay is due: has the model learned?
            out.learned = out.progress >= target
            if not out.learned and sched.decay_from < last_start:
                sched.decay_from = min(sched.decay_from + check_every, last_start)
        lr_sched.step()
        opt.zero_grad(set_to_none=True)
        out.losses.append(loss.item())
        if on_step is not None and on_step(out.steps, out.losses[-1]):
            break
    out.held = sched.decay_from - (steps - decay)
    if check is not None and out.learned:
        out.progress = check()
    return out

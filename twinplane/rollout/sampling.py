"""Sampling parameters and the per-step token choice."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from twinplane.errors import InputError


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32
    min_new_tokens: int = 0  # stop tokens are masked out until this many tokens exist
    n: int = 1  # samples per request
    stop_token_ids: list[int] = field(default_factory=list)  # besides the engine's EOS
    seed: int | None = None
    # Stop once the generated tokens end with one of these token sequences (kept in the output). Like a stop
    # token, a sequence only counts when its last token is at index >= min_new_tokens. Last field, so
    # positional construction is unchanged.
    stop_sequences: list[list[int]] = field(default_factory=list)
    top_logprobs: int = 0  # per generated token, also the k most likely tokens and their log-probs (a server's)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.n < 1 or self.max_new_tokens < 1 or self.top_logprobs < 0:
            raise ValueError("top_k and top_logprobs must be >= 0, n >= 1 and max_new_tokens >= 1")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} > max_new_tokens={self.max_new_tokens}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")


def policy_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(. | context) [..., V] in fp32: the distribution the trainer scores, i.e. logits / T with no
    top-k/top-p truncation (greedy scores at T = 1). Shared by engine and trainer so both compute one thing."""
    x = logits.float()
    if temperature > 0 and temperature != 1.0:  # (x / 1 is x: one op fewer per step)
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


def sample(logprobs: torch.Tensor, p: SamplingParams, uniforms: torch.Tensor, banned: torch.Tensor | None = None,
           banned_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Choose next tokens [B] from policy log-probs [B, V] after banning the token ids `banned` [K] (in the rows
    where `banned_rows` [B] is true; in all rows when it is None) and applying top-k/top-p.

    Inverse-CDF sampling with one uniform in [0, 1) per row (`uniforms` [B], drawn from each sequence's own
    stream): a row's token depends on its own logits and its own stream only, never on the rest of the batch."""
    if banned is not None:
        masked = logprobs.index_fill(-1, banned, float("-inf"))
        logprobs = masked if banned_rows is None else torch.where(banned_rows[:, None], masked, logprobs)
    if p.temperature == 0:
        return logprobs.argmax(-1)
    if p.top_k > 0 and p.top_k < logprobs.shape[-1]:
        kth = logprobs.topk(p.top_k, dim=-1).values[:, -1:]
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_lp, idx = logprobs.sort(dim=-1, descending=True)
        cum = sorted_lp.softmax(-1).cumsum(-1)
        drop = cum - sorted_lp.softmax(-1) >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        logprobs = logprobs.scatter(-1, idx, sorted_lp.masked_fill(drop, float("-inf")))
    return inverse_cdf(logprobs.softmax(-1), uniforms)


class NonFiniteLogits(InputError):
    """The model's next-token distribution is NaN: its weights or activations overflowed (a diverged run, or a
    dtype too narrow for the model). Sampling again cannot help."""


def check_logprobs(logprobs: list[float], where: str) -> None:
    """Sampled tokens' log-probs as they reach the host: a NaN one means the logits were not finite."""
    if any(map(math.isnan, logprobs)):  # (on every step's host list: map keeps the loop in C)
        raise NonFiniteLogits(f"{where}: the model's next-token log-probs are NaN (its logits are not finite): its "
                              "weights or activations overflowed; a diverged run needs a lower train.lr, and float16 "
                              "weights overflow where bfloat16 and float32 do not")


CDF_CHUNK = 4096  # `inverse_cdf` sums in chunks of this many tokens above it


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token [B] of each row of `probs` [B, V] (>= 0, not necessarily normalised) whose cumulative mass first
    exceeds u * total, u from `uniforms` [B] in [0, 1): strictly, so a zero-probability token (flat cdf step) is
    never chosen, also when u * total rounds up to the total.

    Above CDF_CHUNK tokens, two levels: the mass of each chunk of CDF_CHUNK tokens (a reduction), its cumulative
    sum over the chunks, then a cumulative sum within the chosen chunk only. The same inverse CDF summed in another
    order (identical where the sums are exact, tested), and each row still depends on its own probabilities and
    uniform only. Why: a scan along a 150k-token row is a serial loop per row in torch (~40 GB/s on GPUs,
    pytorch#37487; vLLM measured its top-p cumsum over 32k tokens at 6.8 ms on an A100; 15 ms for 64 rows on a
    2-vCPU AMD EPYC), while a reduction and short scans are not. (top-p still sorts and scans the whole row.)"""
    B, V = probs.shape
    if V <= CDF_CHUNK:
        row = probs.cumsum(-1)  # [B, V]
        return _first_above(row, uniforms.to(row)[:, None] * row[:, -1:])[:, 0].clamp_(max=V - 1)
    L, full = CDF_CHUNK, V // CDF_CHUNK
    mass = probs[:, :full * L].view(B, full, L).sum(-1)  # [B, C] (rows of length V: a view)
    if full * L < V:
        mass = torch.cat([mass, probs[:, full * L:].sum(-1, keepdim=True)], dim=1)
    totals = mass.cumsum(-1)  # [B, C]: mass up to the end of each chunk
    target = uniforms.to(totals)[:, None] * totals[:, -1:]  # [B, 1]
    chunk = _first_above(totals, target)  # [B, 1]
    before = torch.where(chunk > 0, totals.gather(1, (chunk - 1).clamp(min=0)), 0.0)  # mass of earlier chunks
    cols = chunk * L + torch.arange(L, device=probs.device)  # [B, L]
    row = probs.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0).cumsum(-1)  # the chunk's cdf [B, L]
    # (target - before >= 0 by the choice; the clamps: a NaN row, not a distribution, would index past the
    # vocabulary; its NaN log-prob is refused where it reaches the host, `check_logprobs`)
    return (chunk[:, 0] * L + _first_above(row, target - before)[:, 0]).clamp_(max=V - 1)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index [B, 1] of the first entry of each non-decreasing row of `cdf` [B, N] above `target` [B, 1]. A target
    that rounding put at (or past) the row's total is taken just below it: the result is then the first entry that
    reaches the total, i.e. the last one with mass."""
    total = cdf[:, -1:]
    return torch.searchsorted(cdf, torch.minimum(target, torch.nextafter(total, torch.zeros_like(total))), right=True)

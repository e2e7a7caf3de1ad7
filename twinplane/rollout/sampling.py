"""Sampling parameters and the per-step token choice."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0, n >= 1 and max_new_tokens >= 1")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} > max_new_tokens={self.max_new_tokens}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")


def policy_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(. | context) [..., V] in fp32: the distribution the trainer scores, i.e. logits / T with no
    top-k/top-p truncation (greedy scores at T = 1). Shared by engine and trainer so both compute one thing."""
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, dim=-1)


def sample(logprobs: torch.Tensor, p: SamplingParams, uniforms: torch.Tensor,
           banned: torch.Tensor | None = None) -> torch.Tensor:
    """Choose next tokens [B] from policy log-probs [B, V] after banning tokens [B, V] and applying top-k/top-p.

    Inverse-CDF sampling with one uniform in [0, 1) per row (`uniforms` [B], drawn from each sequence's own
    stream): a row's token depends on its own logits and its own stream only, never on the rest of the batch."""
    if banned is not None:
        logprobs = logprobs.masked_fill(banned, float("-inf"))
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
    cdf = logprobs.softmax(-1).cumsum(-1)  # [B, V]
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # scaled by the total: fp rounding never overshoots it
    # the first token whose cdf passes the target (strictly: zero-probability tokens have flat cdf steps)
    tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tok.clamp_(max=logprobs.shape[-1] - 1)

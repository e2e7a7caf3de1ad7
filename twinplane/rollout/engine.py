"""The rollout plane's engine: batched generation over the shared model with a KV cache.

Scheduling is static batching with compaction: prompts are left-padded and prefilled once (each prompt once,
however many samples it has), the cache is expanded to n rows per prompt, and rows that finish are dropped
from the cache after each step, so finished sequences cost no further compute.
Interface: `generate(requests, sampling) -> samples`, `load_weights(named_tensors)`, `checksum()`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from twinplane.model import Transformer, load_weights
from twinplane.rollout.sampling import SamplingParams, policy_logprobs, sample
from twinplane.sync import weights_checksum


@dataclass
class Sample:
    request_index: int
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, including the stop token when there is one
    logprobs: list[float]  # log pi(token) under the engine's weights, per generated token
    finish_reason: str  # "stop" (EOS / stop token / stop sequence) or "length" (max_new_tokens)
    weight_version: int  # which weight sync generated it
    # Multi-turn fields (filled by multi_turn.py), here so every consumer reads one type: a plain generation is
    # one turn of model tokens only.
    loss_mask: list[int] | None = None  # per token: 1 = model-generated (trained on), 0 = tool output; None = all 1
    num_turns: int = 1
    num_tool_calls: int = 0
    num_tool_errors: int = 0

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.token_ids)


class RolloutEngine:
    def __init__(self, model: Transformer, eos_token_id: int | None, pad_token_id: int = 0,
                 max_num_seqs: int = 512, seed: int = 0):
        self.model = model.eval().requires_grad_(False)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_num_seqs = max_num_seqs
        self.device = model.output_weight().device
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.weight_version = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.model.output_weight().dtype

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     strict: bool = True) -> None:
        """`strict=False`: a subset (LoRA adapters only)."""
        load_weights(self.model, named, strict=strict)
        self.weight_version = self.weight_version + 1 if version is None else version

    def checksum(self) -> int:
        return weights_checksum(self.model.named_parameters())

    @torch.no_grad()
    def generate(self, requests: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Sample]:
        """Samples ordered request by request, `sampling.n` per request."""
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        per_chunk = max(1, self.max_num_seqs // sampling.n)
        samples = []
        for start in range(0, len(requests), per_chunk):
            chunk = requests[start:start + per_chunk]
            samples += self._generate_chunk(chunk, start, sampling)
        return samples

    def _generate_chunk(self, prompts, offset: int, sp: SamplingParams) -> list[Sample]:
        dev, n, max_new = self.device, sp.n, sp.max_new_tokens
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        plen = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), plen), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), plen, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every row's next write at the same column
            ids[i, plen - len(p):] = torch.tensor(p)
            mask[i, plen - len(p):] = 1
        cache = self.model.new_cache(len(prompts), plen + max_new)
        logits = self.model(ids.to(dev), mask.to(dev), cache=cache, logits_start=plen - 1)[:, -1]  # [P, V]
        cache.repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)  # [P*n, V]

        total = len(prompts) * n
        stop_ids = [t for t in [self.eos_token_id, *sp.stop_token_ids] if t is not None]
        stop = torch.zeros(logits.shape[-1], dtype=torch.bool, device=dev)
        stop[stop_ids] = True
        stop_seqs = [torch.tensor(s, dtype=torch.long, device=dev) for s in sp.stop_sequences]
        longest = max((len(s) for s in sp.stop_sequences), default=0)
        out_tok = torch.full((total, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(total, max_new, dtype=torch.float32, device=dev)
        lengths = torch.full((total,), max_new, dtype=torch.long, device=dev)
        stopped = torch.zeros(total, dtype=torch.bool, device=dev)
        rows = torch.arange(total, device=dev)  # which output row each cache row is
        for step in range(max_new):
            lp = policy_logprobs(logits, sp.temperature)  # [B, V]
            tok = sample(lp, sp, self.generator, banned=stop if step < sp.min_new_tokens else None)
            out_tok[rows, step] = tok
            out_lp[rows, step] = lp.gather(-1, tok[:, None]).squeeze(-1)
            done = stop[tok]
            if stop_seqs and step >= sp.min_new_tokens:  # only with stop sequences: the plain path is untouched
                done = done | ends_with_any(out_tok[rows, max(0, step + 1 - longest):step + 1], stop_seqs)
            if step + 1 == max_new:
                break
            if done.any():
                lengths[rows[done]] = step + 1
                stopped[rows[done]] = True
                if done.all():
                    break
                keep = (~done).nonzero().squeeze(-1)
                cache.select(keep)
                rows, tok = rows[keep], tok[keep]
            logits = self.model(tok[:, None], cache=cache)[:, -1]
        if step + 1 == max_new:  # rows still running at the last step may have stopped on it
            stopped[rows[done]] = True

        out_tok, out_lp, lengths, stopped = out_tok.cpu(), out_lp.cpu(), lengths.tolist(), stopped.tolist()
        samples = []
        for r in range(total):
            i = r // n
            samples.append(Sample(
                request_index=offset + i,
                prompt_ids=list(prompts[i]),
                token_ids=out_tok[r, :lengths[r]].tolist(),
                logprobs=out_lp[r, :lengths[r]].tolist(),
                finish_reason="stop" if stopped[r] else "length",
                weight_version=self.weight_version,
            ))
        return samples


def ends_with_any(tail: torch.Tensor, seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Which rows of `tail` [B, W] (the last W generated tokens) end with one of `seqs`: [B] bool.
    Runs on the device tensor, so stop sequences add no host sync to the decode step."""
    hit = torch.zeros(tail.shape[0], dtype=torch.bool, device=tail.device)
    for s in seqs:
        if len(s) <= tail.shape[1]:
            hit |= (tail[:, tail.shape[1] - len(s):] == s).all(-1)
    return hit

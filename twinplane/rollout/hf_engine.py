"""The rollout engine for a model run with transformers' code (`model.impl=hf`, `twinplane.model.hf`): static
batches over transformers' KV cache (`DynamicCache`), behind the interface the planes use of `RolloutEngine`
(`generate`, `submit`, `load_weights`, `weights_loaded`, `checksum`, `pop_stats`, `pop_metrics`, `generator`,
`weight_version`, `dtype`).

Each request's n samples are n rows; rows go through in batches of at most `max_num_seqs`, prompts left-padded
(positions count real tokens only), then one decode step for every row until all have finished. There is no
continuous batching, no paged pool and no preemption: memory is the batch's cache, `rows x longest sequence`.

Samples are chosen as the native engine chooses them: `policy_logprobs` of the logits (the final hidden state times
`output_weight()`, soft-capped where the model caps, as the trainer scores them) and `sampling.sample` with one
uniform per token from each sample's own stream, seeded from (call seed, request index, sample index). So
temperature, top-k/top-p, min_new_tokens, stop tokens and sequences, seeds and the returned log-probs mean what they
mean there.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from twinplane.model.checksum import weights_checksum
from twinplane.model.hf import HFCausalLM
from twinplane.model.transformer import cap_logits
from twinplane.model.weights import load_weights
from twinplane.rollout.engine import call_seed, request_caps
from twinplane.rollout.sampling import SamplingParams, check_logprobs, policy_logprobs, sample
from twinplane.rollout.sequence import Sample, sample_seed
from twinplane.rollout.sequence import Sequence as Seq
from twinplane.rollout.stats import Done, EngineStats


class HFEngine:
    def __init__(self, model: HFCausalLM, eos_token_id: int | None, pad_token_id: int | None = 0,
                 max_num_seqs: int = 512, seed: int = 0):
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        self.model = model.eval().requires_grad_(False)
        self.device = model.output_weight().device
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id or 0
        self.max_num_seqs = max_num_seqs
        self.generator = torch.Generator(self.device).manual_seed(seed)  # one draw per call: that call's seed
        self.weight_version = 0
        self.on_weights = None
        self.stats = EngineStats()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.output_weight().dtype

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     strict: bool = True) -> None:
        """Copied in place by name; `strict=False`: a subset (LoRA adapters only)."""
        load_weights(self.model, named, strict=strict)
        self.weights_loaded(self.weight_version + 1 if version is None else version)

    def weights_loaded(self, version: int) -> None:
        self.weight_version = version
        if self.on_weights is not None:
            self.on_weights()

    def checksum(self) -> int:
        return weights_checksum(self.model.named_parameters())

    def release(self) -> None:
        """Nothing is kept between calls (each batch's cache is its own)."""

    def pop_stats(self) -> EngineStats:
        s, self.stats = self.stats, EngineStats()
        return s

    def pop_metrics(self) -> dict[str, float]:
        return self.pop_stats().metrics()

    def submit(self, requests: Sequence[Sequence[int]], sampling: SamplingParams,
               max_new_tokens: Sequence[int] | None = None) -> Done:
        return Done(self.generate(requests, sampling, max_new_tokens))

    @torch.no_grad()
    def generate(self, requests: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Sample]:
        """Samples ordered request by request, `sampling.n` per request; `max_new_tokens`: per request, a cap of
        its own below `sampling.max_new_tokens`."""
        seed, caps = call_seed(self.generator, sampling), request_caps(len(requests), sampling, max_new_tokens)
        stops = frozenset(t for t in [self.eos_token_id, *sampling.stop_token_ids] if t is not None)
        rows = []
        for i, (prompt, cap) in enumerate(zip(requests, caps, strict=True)):
            if len(prompt) == 0:
                raise ValueError(f"request {i}: empty prompt")
            rows += [Seq(list(prompt), i, sampling, [sample_seed(seed, i, j)], stops, [j], cap)
                     for j in range(sampling.n)]
        t0 = time.perf_counter()
        for start in range(0, len(rows), self.max_num_seqs):
            self._run(rows[start:start + self.max_num_seqs], sampling)
        self.stats.seconds += time.perf_counter() - t0
        return [s.to_sample(self.weight_version) for s in rows]

    def _run(self, seqs: list[Seq], sp: SamplingParams) -> None:
        """One static batch to completion: a left-padded prefill, then a decode step per token."""
        from transformers import DynamicCache

        dev, B = self.device, len(seqs)
        width = max(s.prompt_len for s in seqs)
        ids = torch.tensor([[self.pad_token_id] * (width - s.prompt_len) + s.tokens for s in seqs], device=dev)
        mask = torch.tensor([[0] * (width - s.prompt_len) + [1] * s.prompt_len for s in seqs], device=dev)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.hf.config)
        live = list(range(B))
        self.stats.prefill_tokens += int(mask.sum())
        while live:
            h = self.model.backbone(ids, mask, positions, cache)[:, -1]  # [B, D]
            logits = cap_logits(F.linear(h, self.model.output_weight()), self.model.config.final_logit_softcapping)
            tokens, chosen = self._choose(logits[live], [seqs[i] for i in live], sp)
            check_logprobs(chosen, "rollout")
            self.stats.steps += 1
            self.stats.running_sum += len(live)
            self.stats.decode_tokens += len(live)
            step = torch.full((B,), self.pad_token_id, dtype=torch.long)
            for i, t, lp in zip(live, tokens, chosen, strict=True):
                seqs[i].append(t, lp, self.weight_version)
                step[i] = t
            live = [i for i in live if seqs[i].finish_reason is None]
            if not live:
                break
            # finished rows ride along (their tokens are never read): the cache stays one tensor per layer
            ids = step[:, None].to(dev)
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], 1)

    def _choose(self, logits: torch.Tensor, seqs: list[Seq], sp: SamplingParams) -> tuple[list[int], list[float]]:
        """Tokens and their policy log-probs for rows `seqs` (one uniform each from its own stream, as the native
        engine draws them); stop tokens banned where a row is short of min_new_tokens; top log-probs if asked."""
        lp = policy_logprobs(logits, sp.temperature)  # [R, V]
        u = torch.tensor([s.rngs[0].random() for s in seqs], dtype=torch.float32).to(logits.device)
        banned = rows = None
        early = [s.num_generated < sp.min_new_tokens for s in seqs]
        if any(early) and seqs[0].stop_ids:
            banned = torch.tensor(sorted(seqs[0].stop_ids), device=logits.device)
            rows = None if all(early) else torch.tensor(early, device=logits.device)
        tok = sample(lp, sp, u, banned, rows)
        if sp.top_logprobs:
            values, ids = lp.topk(min(sp.top_logprobs, lp.shape[-1]), dim=-1)
            for s, i, v in zip(seqs, ids.tolist(), values.tolist(), strict=True):
                s.top.append(list(zip(i, v, strict=True)))
        tok, chosen = torch.stack([tok.double(), lp.gather(-1, tok[:, None]).squeeze(-1).double()]).tolist()
        return [int(t) for t in tok], chosen

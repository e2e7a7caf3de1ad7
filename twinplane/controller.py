"""The controller: drives one RL step through the two planes' interfaces and times every phase.

rollout -> reward -> ref log-probs -> (old log-probs) -> advantages -> update -> weight sync.
It only calls `engine.generate/load_weights/checksum`, `trainer.logprobs/train_step/named_weights` and
`reference.logprobs`, so the planes can move into other processes without this loop changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinplane.algos import grpo_advantages
from twinplane.evaluation import Scorer
from twinplane.flops import forward_flops_per_token, train_flops_per_token
from twinplane.metrics import PhaseTimer
from twinplane.prompts import Prompt
from twinplane.rollout import RolloutEngine, SamplingParams, multi_turn_metrics
from twinplane.sync import weights_checksum
from twinplane.tokenizer import Tokenizer
from twinplane.train import Batch, Reference, Trainer


class WeightSyncError(RuntimeError):
    pass


class Controller:
    """`rollout` generates (the engine itself, or a multi-turn tool driver around it); `engine` takes weights."""

    def __init__(self, engine: RolloutEngine, trainer: Trainer, reference: Reference | None, scorer: Scorer,
                 tokenizer: Tokenizer, sampling: SamplingParams, mini_batches: int = 1,
                 recompute_old_logprobs: bool = False, norm_adv_by_std: bool = True, rollout=None, on_phase=None,
                 peak_flops: float | None = None):
        self.engine, self.trainer, self.reference = engine, trainer, reference
        self.rollout = rollout or engine
        self.scorer, self.tokenizer, self.sampling = scorer, tokenizer, sampling
        self.mini_batches, self.recompute_old = mini_batches, recompute_old_logprobs
        self.norm_adv_by_std = norm_adv_by_std
        self.on_phase = on_phase
        self.peak_flops = peak_flops  # per device, for MFU; None (unknown device) reports MFU as null
        self.version = engine.weight_version

    def step(self, prompts: Sequence[Prompt]) -> dict[str, float]:
        timer = PhaseTimer(self.trainer.device, self.on_phase)
        n = self.sampling.n
        with timer("step"):
            with timer("rollout"):
                samples = self.rollout.generate([p.ids for p in prompts], self.sampling)
            with timer("reward"):
                completions = self.tokenizer.batch_decode([s.token_ids for s in samples])
                source = [prompts[s.request_index] for s in samples]
                rewards, reward_metrics = self.scorer(completions, [p.answer for p in source], [p.text for p in source])
                rewards = torch.tensor(rewards, dtype=torch.float32)
                correct = torch.tensor(self.scorer.last_verifier) >= 1.0
            batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples],
                                  self.tokenizer.pad_token_id, [s.logprobs for s in samples],
                                  [s.loss_mask for s in samples])
            if self.reference is not None:
                with timer("ref_logprob"):
                    batch.ref_logprobs = self.reference.logprobs(batch)
            if self.recompute_old:
                with timer("old_logprob"):
                    batch.old_logprobs = self.trainer.logprobs(batch)
            adv = grpo_advantages(rewards, n, self.norm_adv_by_std)  # [N]
            batch.advantages = adv[:, None] * batch.response_mask  # [N, R]: outcome reward on every token
            with timer("train"):
                per_mb = len(batch) // self.mini_batches  # whole groups per mini-batch
                updates = [self.trainer.train_step(batch.select(slice(i, i + per_mb)))
                           for i in range(0, len(batch), per_mb)]
            with timer("weight_sync"):
                self.sync_weights()
        m = self._metrics(samples, rewards, batch, updates, timer.times) | reward_metrics | multi_turn_metrics(samples)
        return m | timer.memory | {"reward/accuracy": correct.float().mean().item()}

    def sync_weights(self) -> None:
        """Push the trainer's weights to the engine and verify the engine holds exactly them."""
        self.version += 1
        self.engine.load_weights(self.trainer.named_weights(), version=self.version)
        expected = weights_checksum(self.trainer.named_weights(), dtype=self.engine.dtype)
        got = self.engine.checksum()
        if got != expected:
            raise WeightSyncError(f"weight sync to version {self.version} failed: engine checksum {got} != "
                                  f"trainer checksum {expected}; refusing to roll out with stale weights")

    def _metrics(self, samples, rewards, batch: Batch, updates: list[dict], times: dict) -> dict[str, float]:
        n = self.sampling.n
        lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
        groups = rewards.view(-1, n)
        gen_tokens = int(lengths.sum())
        train_tokens = int(batch.attention_mask.sum())
        m = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "rollout/response_length_mean": lengths.mean().item(),
            "rollout/response_length_max": lengths.max().item(),
            "rollout/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/zero_var_groups": (groups.max(1).values == groups.min(1).values).float().mean().item(),
            "rollout/weight_version": samples[0].weight_version,
            "perf/rollout_tokens_per_s": gen_tokens / max(times["time/rollout"], 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(times["time/train"], 1e-9),
        }
        cfg = self.trainer.model.config
        prompt_lens = [len(s.prompt_ids) for s in samples]
        mean_prompt = sum(prompt_lens) / len(samples)
        train_flops = train_flops_per_token(cfg, train_tokens / len(samples)) * train_tokens
        rollout_flops = (gen_tokens * forward_flops_per_token(cfg, mean_prompt + lengths.mean().item() / 2)
                         + sum(prompt_lens) / n * forward_flops_per_token(cfg, mean_prompt / 2))  # prefill once
        for name, flops, t in (("train", train_flops, times["time/train"]), ("rollout", rollout_flops,
                                                                            times["time/rollout"])):
            m[f"perf/tflops_{name}"] = flops / max(t, 1e-9) / 1e12
            m[f"perf/mfu_{name}"] = flops / max(t, 1e-9) / self.peak_flops if self.peak_flops else None
        # Means over the (equal-sized) mini-batches; the gap only from the first (pre-update) mini-batch.
        for k in updates[0]:
            m[k] = sum(u[k] for u in updates) / len(updates)
        m["actor/logprob_gap"] = updates[0]["actor/logprob_gap"]
        m["actor/lr"] = updates[-1]["actor/lr"]
        return m | times

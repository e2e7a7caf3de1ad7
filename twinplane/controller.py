"""The controller: drives one RL step through the two planes' interfaces and times every phase.

rollout -> reward -> ref log-probs -> (old log-probs) -> advantages -> update -> weight sync.
It only calls `rollout.generate` (or `submit`), `trainer.logprobs/train_step`, `reference.logprobs` and a weight
`sync(version)`, so the same loop drives one process (`cluster.LocalPlanes`) and a Ray cluster (`RayPlanes`).

One-step off-policy (`async_`): the rollout for step k+1 is submitted before step k trains, so it runs on the
weights before step k's update while the trainer updates (on Ray, on other devices at the same time; in one
process it simply runs first, with the same result). Staleness is bounded at one version, old log-probs are
recomputed by the trainer, and the trainer corrects the rollout/trainer mismatch by truncated importance sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import torch

from twinplane.algos import grpo_advantages
from twinplane.evaluation import Scorer
from twinplane.flops import forward_flops_per_token, train_flops_per_token
from twinplane.metrics import PhaseTimer
from twinplane.prompts import Prompt
from twinplane.rollout import RolloutEngine, Sample, SamplingParams, multi_turn_metrics
from twinplane.sync import SyncReport, sync_in_process
from twinplane.tokenizer import Tokenizer
from twinplane.train import Batch, Reference, Trainer


class WeightSyncError(RuntimeError):
    pass


class Controller:
    """`rollout` generates (the engine itself, or a multi-turn tool driver around it); `engine` takes weights."""

    def __init__(self, engine: RolloutEngine, trainer: Trainer, reference: Reference | None, scorer: Scorer,
                 tokenizer: Tokenizer, sampling: SamplingParams, mini_batches: int = 1,
                 recompute_old_logprobs: bool = False, norm_adv_by_std: bool = True, rollout=None, on_phase=None,
                 peak_flops: float | None = None, sync=None, async_: bool = False, devices: tuple[int, int] = (1, 1)):
        """`sync(version) -> SyncReport` moves weights to the engines (default: in-process into `engine`);
        `devices`: (training, rollout) device counts, for per-device MFU."""
        self.engine, self.trainer, self.reference = engine, trainer, reference
        self.sync = sync or (lambda version: sync_in_process(engine, trainer, version))
        self.async_, self.devices = async_, devices
        self.pending = None  # (prompts, rollout in flight) in async mode
        self.rollout = rollout or engine
        self.scorer, self.tokenizer, self.sampling = scorer, tokenizer, sampling
        self.mini_batches, self.recompute_old = mini_batches, recompute_old_logprobs or async_
        self.norm_adv_by_std = norm_adv_by_std
        self.on_phase = on_phase
        self.peak_flops = peak_flops  # per device, for MFU; None (unknown device) reports MFU as null
        self.version = engine.weight_version

    def step(self, prompts: Sequence[Prompt], next_prompts: Sequence[Prompt] | None = None) -> dict[str, float]:
        """One RL step on `prompts`. In async mode `next_prompts` (the following step's) start rolling out before
        this step trains; `prompts` must then be those of the previous call's `next_prompts`, if it had any."""
        timer = PhaseTimer(self.trainer.device, self.on_phase)
        n = self.sampling.n
        with timer("step"):
            with timer("rollout"):
                samples = self._rollout(prompts, next_prompts)
            with timer("reward"):
                completions = self.tokenizer.batch_decode([s.token_ids for s in samples])
                source = [prompts[s.request_index] for s in samples]
                rewards, reward_metrics = self.scorer(completions, [p.answer for p in source], [p.text for p in source])
                rewards = torch.tensor(rewards, dtype=torch.float32)
                correct = torch.tensor(self.scorer.last_verifier) >= 1.0
            batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples],
                                  self.tokenizer.pad_token_id, [s.logprobs for s in samples],
                                  [s.loss_mask for s in samples],
                                  [s.routing for s in samples] if samples[0].routing is not None else None)
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
                report = self.sync_weights()
        m = self._metrics(samples, rewards, batch, updates, timer.times) | reward_metrics | multi_turn_metrics(samples)
        m |= getattr(self.rollout, "last_metrics", {})  # remote engines: their busy time (load balance)
        m |= {"sync/bytes": report.bytes, "sync/gb_per_s": report.bytes / max(timer.times["time/weight_sync"], 1e-9)
              / 1e9, "rollout/staleness": self.version - 1 - min(s.weight_version for s in samples)}
        memory = {} if getattr(self.trainer, "remote", False) else timer.memory  # remote: rank 0 reports its own
        return m | memory | {"reward/accuracy": correct.float().mean().item()}

    def _rollout(self, prompts: Sequence[Prompt], next_prompts: Sequence[Prompt] | None) -> list:
        if self.pending is not None:
            expected, handle = self.pending
            if list(expected) != list(prompts):
                raise ValueError("async rollout: step() was not given the prompts submitted as next_prompts")
            samples = handle.result()
        else:
            samples = self.rollout.generate([p.ids for p in prompts], self.sampling)
        self.pending = None
        if self.async_ and next_prompts:
            self.pending = (list(next_prompts), self.submit([p.ids for p in next_prompts]))
        oldest = min(s.weight_version for s in samples)
        if oldest < self.version - (1 if self.async_ else 0):  # never train on staler samples than allowed
            raise WeightSyncError(f"samples from weight version {oldest} at trainer version {self.version}: "
                                  f"staleness above the allowed {int(self.async_)}")
        return samples

    def submit(self, requests):
        if hasattr(self.rollout, "submit"):
            return self.rollout.submit(requests, self.sampling)
        return _Done(self.rollout.generate(requests, self.sampling))  # one process: run it now, same weights

    def pending_state(self) -> dict | None:
        """The rollout in flight (async mode), finished and as plain data, for a checkpoint: its samples came from
        weights that exist nowhere else, so resuming bitwise needs them."""
        if self.pending is None:
            return None
        prompts, handle = self.pending
        self.pending = (prompts, _Done(handle.result()))
        samples = [asdict(s) | {"routing": None if s.routing is None else s.routing.tolist()}  # JSON
                   for s in self.pending[1].samples]
        return {"prompts": [asdict(p) for p in prompts], "samples": samples}

    def load_pending(self, state: dict | None) -> None:
        def sample(s: dict) -> Sample:
            routing = s.get("routing")
            return Sample(**s | {"routing": None if routing is None else torch.tensor(routing, dtype=torch.int16)})

        self.pending = None if state is None else (
            [Prompt(**p) for p in state["prompts"]], _Done([sample(s) for s in state["samples"]]))

    def sync_weights(self) -> SyncReport:
        """Push the trainer's weights to every engine and verify each holds exactly them."""
        self.version += 1
        report = self.sync(self.version)
        bad = report.mismatched()
        if bad:
            raise WeightSyncError(f"weight sync to version {self.version} failed on {', '.join(bad)}: checksum "
                                  f"{report.checksums[bad[0]]} != trainer's {report.expected}; refusing to roll out "
                                  f"with stale weights")
        return report

    def _metrics(self, samples, rewards, batch: Batch, updates: list[dict], times: dict) -> dict[str, float]:
        n = self.sampling.n
        # Remote engines report their own busy time: with an overlapped rollout the phase timer only saw the wait.
        rollout_s = getattr(self.rollout, "last_metrics", {}).get("rollout/engine_busy_s_max", times["time/rollout"])
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
            "perf/rollout_tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(times["time/train"], 1e-9),
        }
        cfg = self.trainer.config
        prompt_lens = [len(s.prompt_ids) for s in samples]
        mean_prompt = sum(prompt_lens) / len(samples)
        train_flops = train_flops_per_token(cfg, train_tokens / len(samples)) * train_tokens
        rollout_flops = (gen_tokens * forward_flops_per_token(cfg, mean_prompt + lengths.mean().item() / 2)
                         + sum(prompt_lens) / n * forward_flops_per_token(cfg, mean_prompt / 2))  # prefill once
        for name, flops, t, devices in (("train", train_flops, times["time/train"], self.devices[0]),
                                        ("rollout", rollout_flops, rollout_s, self.devices[1])):
            m[f"perf/tflops_{name}"] = flops / max(t, 1e-9) / 1e12
            peak = self.peak_flops * devices if self.peak_flops else None
            m[f"perf/mfu_{name}"] = flops / max(t, 1e-9) / peak if peak else None
        # Means over the (equal-sized) mini-batches; the gap only from the first (pre-update) mini-batch.
        for k in updates[0]:
            m[k] = sum(u[k] for u in updates) / len(updates)
        for k in ("actor/logprob_gap", "rollout/routing_agreement", "moe/router_agreement"):
            if k in updates[0]:  # engine-vs-trainer comparisons: before any update
                m[k] = updates[0][k]
        m["actor/lr"] = updates[-1]["actor/lr"]
        return m | times


class _Done:
    def __init__(self, samples):
        self.samples = samples

    def result(self):
        return self.samples

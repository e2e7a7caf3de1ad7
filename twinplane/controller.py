"""The controller: drives one RL step through the two planes' interfaces and times every phase.

rollout -> reward -> (more rollouts: dynamic sampling) -> ref log-probs -> (old log-probs) -> (values) ->
advantages -> (critic update) -> policy update -> weight sync.
It only calls the `cluster.Planes` protocol (`submit`, `trainer.logprobs/train_step`, `reference.logprobs`,
`critic.values/train_step`, `sync(version)`), so the same loop drives one process (`cluster.LocalPlanes`) and a Ray
cluster (`RayPlanes`). What is algorithm-specific comes from the `algos.Algorithm` it is given: the roles, which
groups train (DAPO's filter), the scores' shaping, the per-token rewards (PPO's KL-in-reward), the estimator; the
controller imports no algorithm module and has no algorithm-specific arguments.

Asynchronous RL (`producer`, `cluster.max_staleness` >= 1): the step's groups come from a `producer.Producer`
that keeps the engines generating, already scored and filtered, up to k policy versions stale; while the trainer
works the engines run on (`Producer.overlap`). Old log-probs are then the trainer's (a separate forward, or with
one update per batch its training forward's), and the off-policy correction (`algo.is_*`, `algo.tis_cap`) weighs
the rollout/trainer mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch

from twinplane.algos import Algorithm
from twinplane.cluster import Planes
from twinplane.cluster.sync import SyncReport
from twinplane.data.prompts import Prompt
from twinplane.model.flops import forward_flops_per_token, train_flops
from twinplane.platform import hardware
from twinplane.producer import Producer
from twinplane.rewards import Scorer
from twinplane.rollout import Sample, SamplingParams, multi_turn_metrics
from twinplane.rollout.stats import EngineStats
from twinplane.tokenizer import Tokenizer
from twinplane.train import Batch
from twinplane.train.critic import explained_variance


class WeightSyncError(RuntimeError):
    pass


class PhaseTimer:
    """`with timer("rollout"): ...` records seconds under `time/rollout` (device work included)."""

    def __init__(self, device: torch.device, on_enter=None):
        self.device, self.on_enter = device, on_enter  # on_enter(phase): a hook (fault injection in tests)
        self.times: dict[str, float] = {}
        self.memory: dict[str, float] = {}  # peak memory per phase (device memory on GPU, process RSS on CPU)

    @contextmanager
    def __call__(self, phase: str):
        if self.on_enter is not None:
            self.on_enter(phase)
        hardware.synchronize(self.device)
        hardware.reset_peak_memory(self.device)
        t0 = time.perf_counter()
        yield
        hardware.synchronize(self.device)
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - t0
        if phase != "step":  # the step's peak is the max of its phases
            self.memory[f"mem/peak_gb_{phase}"] = hardware.peak_memory_bytes(self.device) / 1e9


class Controller:
    """Drives RL steps through `planes`; the algorithm-specific parts are `algo`'s."""

    def __init__(self, planes: Planes, scorer: Scorer, tokenizer: Tokenizer, sampling: SamplingParams,
                 mini_batches: int = 1, recompute_old_logprobs: bool = False, algo: Algorithm | None = None,
                 critic_warmup: int = 0, more_prompts=None, on_phase=None, peak_flops: float | None = None,
                 producer: Producer | None = None, agents=None):
        """`algo`: the run's algorithm (default: the in-process trainer's); the critic plane (when the algorithm
        needs one) trains alone for the first `critic_warmup` steps; `more_prompts()` gives the next prompt batch for
        dynamic sampling; `on_phase(phase)` is called as each phase starts (fault injection); `agents`: the rollout
        and its rewards come from the user's agent instead (`agents.AgentRollout`)."""
        self.planes, self.trainer, self.reference, self.critic = planes, planes.trainer, planes.reference, planes.critic
        self.algo = algo if algo is not None else planes.trainer.algo
        self.critic_warmup, self.more_prompts = critic_warmup, more_prompts
        self.producer, self.agents = producer, agents
        self.draws: dict[str, list[int]] = {}  # asynchronous: the data-order places of the step's prompts
        self.rollout_stats = EngineStats()  # the engines' counters for the samples of the current step
        self.scorer, self.tokenizer, self.sampling = scorer, tokenizer, sampling
        self.mini_batches, self.recompute_old = mini_batches, recompute_old_logprobs
        # One update per rollout batch: pi_old is the policy the update's own forward evaluates, so the trainer takes
        # it from there (`Batch.old_is_current`), one forward fewer, unless something reads it before: the
        # KL-in-reward term (and its metrics), or a band mask (it sets the loss's denominator).
        self.old_in_update = (recompute_old_logprobs and mini_batches == 1 and not self.algo.cfg.kl_in_reward
                              and self.algo.cfg.is_mask == "off")
        self.on_phase = on_phase
        self.peak_flops = peak_flops  # per device, for MFU; None (unknown device) reports MFU as null
        self.version = planes.weight_version

    def step(self, prompts: Sequence[Prompt] = ()) -> dict[str, float]:
        """One RL step on `prompts`, or with a producer on the groups it hands over."""
        timer = PhaseTimer(self.trainer.device, self.on_phase)
        extra, reward_metrics = {}, {}
        with timer("step"):
            if self.producer is not None:
                with timer("rollout"):
                    samples, rewards, correct, groups, reward_metrics = self._take()
                if self.agents is not None:  # (the episodes that ended while the step waited and trained before)
                    reward_metrics |= self.agents.streamed.pop_metrics()
            elif self.agents is not None:
                with timer("rollout"):
                    samples, rewards, correct, reward_metrics = self.agents.run(prompts, self.version)
                self.rollout_stats = self.agents.stats
                groups = torch.tensor([s.request_index for s in samples])
            else:
                with timer("rollout"):
                    samples = self._rollout(prompts)
                with timer("reward"):
                    source = [prompts[s.request_index] for s in samples]
                    rewards, correct, reward_metrics = self._score(samples, source)
                groups = torch.tensor([s.request_index for s in samples])  # [N] one label per prompt
                if self.algo.filters_groups:
                    samples, source, rewards, correct, groups, extra = self._dynamic_sampling(
                        timer, len(prompts), samples, source, rewards, correct, groups)
            with self.producer.overlap() if self.producer else nullcontext():
                t_train = time.perf_counter()
                batch, updates, critic_updates, more = self._learn(timer, samples, rewards, groups)
                t_train = time.perf_counter() - t_train
            extra |= more
            with timer("weight_sync"):
                report = self.sync_weights()
                if self.producer is not None:
                    self.producer.weights_updated()
                    self.rollout_stats = self.producer.counts.stats  # (the engines ran on while training)
        m = self._metrics(samples, rewards, groups, batch, updates + critic_updates, timer.times)
        m |= reward_metrics | multi_turn_metrics(samples) | extra
        m |= self.rollout_stats.metrics()  # occupancy, preemptions, KV usage, tokens/s (and remote busy time)
        m |= {"sync/bytes": report.bytes, "sync/gb_per_s": report.bytes / max(timer.times["time/weight_sync"], 1e-9)
              / 1e9, "rollout/staleness": self.version - 1 - min(s.oldest_version for s in samples)}
        if self.producer is not None:
            m |= self.producer.metrics(timer.times["time/step"], t_train)
        memory = timer.memory if self.planes.in_process else {}  # remote: rank 0 reports its own
        return m | memory | {"reward/accuracy": correct.float().mean().item()}

    def _take(self):
        """The producer's groups for this step, as the synchronous path's (samples, rewards, correct, labels,
        reward metrics)."""
        p = self.producer
        taken = p.take()
        p.run_ahead()
        samples = [s for g in taken for s in g.samples]
        rewards = torch.tensor([r for g in taken for r in g.rewards], dtype=torch.float32)
        correct = torch.tensor([c for g in taken for c in g.correct])
        labels = torch.tensor([i for i, g in enumerate(taken) for _ in g.samples])
        self.draws = {"trained": [g.draw for g in taken], "filtered": list(p.counts.filtered_draws)}
        calls = p.counts.reward_metrics
        keys = dict.fromkeys(k for d in calls for k in d)
        metrics = {k: sum(d[k] for d in calls if k in d) / sum(k in d for d in calls) for k in keys}
        return samples, rewards, correct, labels, metrics

    def _learn(self, timer, samples: list[Sample], rewards: torch.Tensor, groups: torch.Tensor):
        """Everything on the training side after the rollout: (batch, actor updates, critic updates, metrics)."""
        extra = {}
        batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples],
                              self.tokenizer.pad_token_id, [s.logprobs for s in samples],
                              [s.loss_mask for s in samples],
                              [s.routing for s in samples] if samples[0].routing is not None else None)
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        lengths = torch.tensor([len(s.token_ids) for s in samples])
        scores = self.algo.shape_scores(rewards, lengths, self.sampling.max_new_tokens)  # [N]
        if self.algo.cfg.mask_truncated:
            batch.response_mask = batch.response_mask * (~truncated).float()[:, None]
        if self.reference is not None:
            with timer("ref_logprob"):
                batch.ref_logprobs = self.reference.logprobs(batch)
        if self.old_in_update:
            batch.old_is_current = True
        elif self.recompute_old:
            with timer("old_logprob"):
                batch.old_logprobs = self.trainer.logprobs(batch)
        values = None
        if self.critic is not None:
            with timer("values"):
                values = self.critic.values(batch).cpu()  # [N, R]
        mask = batch.response_mask
        old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
        token_rewards, reward_terms = self.algo.token_rewards(scores, mask, old, batch.ref_logprobs)  # [N, R]
        extra |= reward_terms
        batch.advantages, batch.returns = self.algo.advantages(token_rewards, mask, groups, values)
        batch.old_values = values
        parts = self._mini_batches(batch, groups)
        critic_updates = []
        if self.critic is not None:
            with timer("critic_train"):
                critic_updates = [self.critic.train_step(mb) for mb in parts]
            extra |= {"critic/values_mean": float((values * mask).sum() / mask.sum().clamp(min=1)),
                      "critic/explained_variance": explained_variance(values, batch.returns, mask)}
        updates = []
        with timer("train"):
            if self.critic is None or self.version >= self.critic_warmup:  # critic warmup: the actor waits
                updates = [self.trainer.train_step(mb) for mb in parts]
        return batch, updates, critic_updates, extra

    def _score(self, samples, source: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(rewards [N], verifier-correct [N] bool, reward metrics) of `samples` against their prompts."""
        completions = self.tokenizer.batch_decode([s.token_ids for s in samples])
        rewards, metrics = self.scorer(completions, [p.answer for p in source], [p.text for p in source])
        return torch.tensor(rewards, dtype=torch.float32), torch.tensor(self.scorer.last_verifier) >= 1.0, metrics

    def _dynamic_sampling(self, timer, target: int, samples, source, rewards, correct, groups):
        """DAPO's dynamic sampling: keep the groups whose rewards differ; while fewer than `target` are kept, roll
        out and score further prompt batches (`more_prompts`, at most `algo.max_gen_batches` batches in all), then
        keep the first `target` informative groups. With none at all, the last batch trains (all advantages 0)."""
        parts, total_groups, batches = [], 0, 1
        while True:
            keep = self.algo.keep_groups(rewards, groups)
            parts.append((samples, source, rewards, correct, groups, keep))
            total_groups += len(set(groups.tolist()))
            kept = sum(len(set(p[4][p[5]].tolist())) for p in parts)
            if kept >= target or batches >= self.algo.cfg.max_gen_batches or self.more_prompts is None:
                break
            more = self.more_prompts()
            offset = int(groups.max()) + 1
            with timer("rollout"):
                samples = self._collect(self.planes.submit([p.ids for p in more], self.sampling))
            with timer("reward"):
                source = [more[s.request_index] for s in samples]
                rewards, correct, _ = self._score(samples, source)
            groups = torch.tensor([s.request_index for s in samples]) + offset
            batches += 1
        metrics = {"rollout/gen_batches": batches, "rollout/groups_kept": kept,
                   "rollout/groups_dropped": total_groups - kept,
                   "rollout/accuracy_all": float(torch.cat([p[3] for p in parts]).float().mean())}
        if kept == 0:
            return (*parts[-1][:5], metrics)
        rows = [(p, i) for p in parts for i in p[5].nonzero().squeeze(1).tolist()]
        labels = set(list(dict.fromkeys(int(p[4][i]) for p, i in rows))[:target])  # the first `target` groups
        rows = [(p, i) for p, i in rows if int(p[4][i]) in labels]
        return ([p[0][i] for p, i in rows], [p[1][i] for p, i in rows], torch.stack([p[2][i] for p, i in rows]),
                torch.stack([p[3][i] for p, i in rows]), torch.tensor([int(p[4][i]) for p, i in rows]), metrics)

    def _mini_batches(self, batch: Batch, groups: torch.Tensor) -> list[Batch]:
        """`mini_batches` consecutive parts holding whole groups (as equal as the group count allows)."""
        starts = [0] + [i for i in range(1, len(groups)) if groups[i] != groups[i - 1]]
        k = len(starts)
        bounds = [starts[(j * k) // self.mini_batches] for j in range(self.mini_batches)] + [len(batch)]
        return [batch.select(slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]

    def state_dict(self) -> dict:
        """What the step loop carries between steps besides the planes: the algorithm's, and the producer's."""
        return self.algo.state_dict() | ({"producer": self.producer.state()} if self.producer else {})

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        producer = state.pop("producer", None)
        if (producer is None) != (self.producer is None):
            raise ValueError("cluster.max_staleness changed between 0 and >= 1 (a synchronous and an asynchronous "
                             "run do not continue each other)")
        if producer is not None:
            self.producer.load_state(producer)
        self.algo.load_state_dict(state)

    def _rollout(self, prompts: Sequence[Prompt]) -> list[Sample]:
        self.rollout_stats = EngineStats()
        samples = self._collect(self.planes.submit([p.ids for p in prompts], self.sampling))
        oldest = min(s.oldest_version for s in samples)
        if oldest < self.version:  # never train a synchronous step on stale samples
            raise WeightSyncError(f"samples from weight version {oldest} at trainer version {self.version}")
        return samples

    def _collect(self, handle) -> list[Sample]:
        samples = handle.result()
        self.rollout_stats += handle.stats  # the step's metrics describe the rollouts it trains on
        return samples

    def sync_weights(self) -> SyncReport:
        """Push the trainer's weights to every engine and verify each holds exactly them."""
        self.version += 1
        with self.agents.held() if self.agents is not None else nullcontext():  # (episodes' calls wait)
            report = self.planes.sync(self.version)
        bad = report.mismatched()
        if bad:
            raise WeightSyncError(f"weight sync to version {self.version} failed on {', '.join(bad)}: "
                                  f"{report.describe(bad[0])}; refusing to roll out with stale weights")
        return report

    def _metrics(self, samples, rewards, labels: torch.Tensor, batch: Batch, updates: list[dict],
                 times: dict) -> dict[str, float]:
        n = self.sampling.n
        # Remote engines report their own busy time: with an overlapped rollout the phase timer only saw the wait.
        # So does the in-process engine with a producer, whose steps also generate groups for later steps.
        remote = self.rollout_stats.seconds_min is not None
        rollout_s = self.rollout_stats.seconds if remote or self.producer else times["time/rollout"]
        lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
        spread = [rewards[labels == g] for g in labels.unique()]  # (an agent's groups may differ in size)
        gen_tokens = int(lengths.sum())
        train_tokens = int(batch.attention_mask.sum())
        computed = train_tokens - int(sum(u.get("actor/prompt_tokens_shared", 0) for u in updates))  # shared prompts
        m = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "rollout/response_length_mean": lengths.mean().item(),
            "rollout/response_length_max": lengths.max().item(),
            "rollout/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/zero_var_groups": sum(bool(r.max() == r.min()) for r in spread) / len(spread),
            "rollout/weight_version": samples[0].weight_version,
            "perf/rollout_tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(times["time/train"], 1e-9),
        }
        cfg = self.trainer.config
        prompt_lens = [len(s.prompt_ids) for s in samples]
        mean_prompt = sum(prompt_lens) / len(samples)
        actor_flops = train_flops(cfg, computed, train_tokens / len(samples), gen_tokens)  # logits: responses
        # decode: logits for every generated token (the first from its prefill's last row); prefill: each group's
        # prompt once, without logits
        rollout_flops = (gen_tokens * forward_flops_per_token(cfg, mean_prompt + lengths.mean().item() / 2)
                         + sum(prompt_lens) / n * forward_flops_per_token(cfg, mean_prompt / 2, lm_head=False))
        for name, flops, t, devices in (("train", actor_flops, times["time/train"], self.planes.train_devices),
                                        ("rollout", rollout_flops, rollout_s, self.planes.rollout_devices)):
            m[f"perf/tflops_{name}"] = flops / max(t, 1e-9) / 1e12
            peak = self.peak_flops * devices if self.peak_flops else None
            m[f"perf/mfu_{name}"] = flops / max(t, 1e-9) / peak if peak else None
        # Means over the mini-batches; the gap only from the first (pre-update) mini-batch.
        for k in dict.fromkeys(k for u in updates for k in u):
            vals = [u[k] for u in updates if k in u]
            m[k] = sum(vals) / len(vals)
        actor = [u for u in updates if "actor/lr" in u]
        if actor:
            for k in ("actor/logprob_gap", "rollout/routing_agreement", "moe/router_agreement"):
                if k in actor[0]:  # engine-vs-trainer comparisons: before any update
                    m[k] = actor[0][k]
            m["actor/lr"] = actor[-1]["actor/lr"]
        return m | times

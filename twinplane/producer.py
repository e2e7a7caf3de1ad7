"""The producer of fully asynchronous RL: keeps the engines busy with prompts and hands the trainer whole groups
in completion order, never staler than `cluster.max_staleness` policy versions.

- **Admission.** Groups (one prompt, n samples) are added to the engines while fewer than (k + 1) x P are
  outstanding (in flight or finished and waiting; k x P while a step trains on its P), P = prompts per step, k =
  the staleness bound; each goes to the engine with the fewest in flight. Its samples are seeded from the
  prompt's place in the data order (and the attempt), so a group samples the same on any engine at any time.
- **Staleness.** A group is as old as its oldest token (partial rollouts sample later tokens with newer weights,
  each token carrying its version). The engines restart a group in flight as soon as it could no longer train
  (oldest < new version - k, `EngineStream`); a finished group that has become too stale while waiting is
  generated again from the same prompt (a new attempt). Both are counted (`async/groups_regenerated`); no prompt is
  dropped, so every prompt of the data order trains exactly once.
- **Dynamic sampling** (DAPO) filters groups as they finish: a group whose rewards do not differ is dropped
  (counted, its prompt used up as in the synchronous filter) and its slot refilled from the data. Once a step has
  dropped (`algo.max_gen_batches` - 1) x P groups, uninformative groups are kept only to fill its batch.
- **Schedule.** `take` runs the engines until P groups are ready. While the trainer works (`overlap`), the
  engines run `cluster.async_schedule` more engine steps each (in one process: before training, on the weights the
  trainer starts from — the same result), or with 0 on Ray, as long as training lasts (not reproducible).
  With a fixed schedule everything the producer does is a function of the data and the seeds: a run in one process
  and one on Ray give the same samples, and a resumed run continues bitwise.
- **Checkpoints** hold everything not yet trained on: groups waiting (samples, scores), groups in flight (each
  sequence's tokens, behaviour log-probs, versions and random-stream state, from the engines) and the counters.
- **Agents** (`streams`: `agents.runner.AgentStream`): a group is a prompt's n episodes of the user's agent, which
  run on by themselves between calls and come back scored by the agent. Episodes in flight cannot be saved: a
  resumed run plays them again (a new attempt), so every prompt still trains exactly once. A group whose episodes
  all failed uses up its prompt, like a filtered one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from twinplane.algos import Algorithm
from twinplane.cluster import Planes
from twinplane.data import PromptStream
from twinplane.data.prompts import Prompt
from twinplane.rewards import Scorer
from twinplane.rollout import Sample, SamplingParams
from twinplane.rollout.sequence import sample_from_state, sample_seed, sample_state
from twinplane.rollout.stats import EngineStats
from twinplane.rollout.stream import GroupRequest, StreamRequest, StreamResult
from twinplane.tokenizer import Tokenizer

CHUNK_STEPS = 8  # engine steps per call of a remote engine while free-running (how soon a weight update lands)


@dataclass
class Group:
    """One prompt's n samples, as the producer tracks them."""
    uid: int  # unique per attempt (the engines' request index)
    draw: int  # the prompt's place in the data order (epoch x dataset size + position)
    attempt: int  # 0, then 1, 2, ... each time it is generated again
    prompt: Prompt
    engine: int = 0
    samples: list[Sample] = field(default_factory=list)
    rewards: list[float] | None = None  # once scored
    correct: list[bool] | None = None

    @property
    def oldest(self) -> int:
        return min(s.oldest_version for s in self.samples)


@dataclass
class StepCounts:
    """What the producer did for the current step (reset as each step takes its groups)."""
    regenerated: int = 0
    filtered: int = 0
    generated: int = 0
    filtered_draws: list[int] = field(default_factory=list)
    reward_metrics: list[dict] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    busy: list[float] = field(default_factory=list)  # per engine, seconds this step
    overlap_busy: list[float] = field(default_factory=list)  # per engine, seconds while the trainer worked


class Producer:
    def __init__(self, planes: Planes, prompts: PromptStream, scorer: Scorer, tokenizer: Tokenizer,
                 sampling: SamplingParams, algo: Algorithm, per_step: int, max_staleness: int, schedule: int,
                 partial: bool, seed: int, streams: list | None = None):
        """`streams`: the engines' streams when something other than the planes' engines generates (agents)."""
        self.planes, self.prompts, self.scorer, self.tokenizer = planes, prompts, scorer, tokenizer
        self.sampling, self.algo, self.per_step, self.k = sampling, algo, per_step, max_staleness
        self.schedule, self.seed = schedule, seed
        self.local = planes.in_process or planes.colocated  # engines share the trainer's devices: no overlap
        self.capacity = (max_staleness + 1) * per_step
        longest = max(len(p.ids) for p in prompts.items)
        self.background = streams is not None  # the streams run on between calls (agents' episodes)
        self.engines = streams or planes.open_streams(
            StreamRequest(sampling, self.capacity, longest, partial, max_staleness))
        self.next_uid = 0
        self.in_flight: dict[int, Group] = {}  # by uid
        self.load = [0] * len(self.engines)  # groups in flight per engine
        self.outbox: list[list[GroupRequest]] = [[] for _ in self.engines]  # submitted, not yet sent, per engine
        self.finished: list[Group] = []  # completed, not yet scored, in completion order
        self.ready: list[Group] = []  # scored and kept, waiting to train, in completion order
        self.counts = StepCounts(busy=[0.0] * len(self.engines), overlap_busy=[0.0] * len(self.engines))
        self.staleness: list[int] = []  # of the groups the step took, in versions
        self.in_flight_tokens = [0] * len(self.engines)  # per engine, after its last call
        self.tokens_at_sync = 0

    # --- admission ----------------------------------------------------------------------------------------------
    def _outstanding(self) -> int:
        return len(self.in_flight) + len(self.finished) + len(self.ready)

    def _draw(self) -> tuple[int, Prompt]:
        s = self.prompts
        draw = s.epoch * len(s) + s.position  # (position == len: the next epoch's first, the same number)
        return draw, s.next_batch(1)[0]

    def _new_group(self, draw: int, attempt: int, prompt: Prompt) -> Group:
        g = Group(self.next_uid, draw, attempt, prompt)
        self.next_uid += 1
        return g

    def _top_up(self, during_training: bool = False) -> bool:
        """Submit groups to fill the outstanding slots; whether there were any. While a step trains, its own P
        groups are already taken: k x P slots, so that a group added now trains k versions on at the latest (in
        completion order)."""
        capacity = self.capacity - (self.per_step if during_training else 0)
        added = self._outstanding() < capacity
        while self._outstanding() < capacity:
            draw, prompt = self._draw()
            self._submit(self._new_group(draw, 0, prompt))
        return added

    def _submit(self, g: Group) -> None:
        """To the engine with the fewest groups in flight (sent with its next call)."""
        g.engine = min(range(len(self.load)), key=lambda i: (self.load[i], i))
        self.load[g.engine] += 1
        seeds = [sample_seed(self.seed + 7919 * g.attempt, g.draw, j) for j in range(self.sampling.n)]
        task = g.prompt.task if self.background else None
        self.outbox[g.engine].append(GroupRequest(g.uid, list(g.prompt.ids), seeds, task))
        self.in_flight[g.uid] = g
        self.counts.generated += 1

    # --- engines ------------------------------------------------------------------------------------------------
    def _send(self, engine: int, steps: int | None, until: int | None):
        adds, self.outbox[engine] = self.outbox[engine], []
        return self.engines[engine].call(adds, steps, until)

    def _advance(self, steps: int | None, until: int | None, overlap: bool = False,
                 stop: threading.Event | None = None) -> None:
        """Every engine gets the groups submitted to it and runs `steps` engine steps, or until `until` groups in
        all have completed (None: no limit), or until it has nothing left. Remote engines run in rounds of at most
        CHUNK_STEPS steps; with `stop`, until it is set, topped up every round. Completed groups join `finished` in
        (round, engine, completion) order."""
        done = ran = 0
        while True:
            chunk = steps if self.planes.in_process else \
                min(CHUNK_STEPS, CHUNK_STEPS if steps is None else steps - ran)
            handles = [self._send(i, chunk, None if until is None else until - done) for i in range(len(self.engines))]
            results = [h.result() for h in handles]
            for i, r in enumerate(results):
                self._collect(i, r, overlap)
                done += len(r.groups)
            ran += chunk or 0
            more = stop is not None and self._top_up(during_training=True)
            if self.planes.in_process or (all(r.idle for r in results) and not more):
                return
            if (until is not None and done >= until) or (steps is not None and ran >= steps) or \
                    (stop is not None and stop.is_set()):
                return

    def _collect(self, engine: int, r: StreamResult, overlap: bool) -> None:
        c = self.counts
        c.stats += r.stats
        busy = c.overlap_busy if overlap else c.busy
        busy[engine] += r.stats.seconds
        c.regenerated += r.restarted  # too stale in flight: its engine generated it again
        self.in_flight_tokens[engine] = r.tokens_in_flight
        for i, samples in enumerate(r.groups):
            g = self.in_flight.pop(samples[0].request_index)
            self.load[engine] -= 1
            g.samples = samples
            if r.scores is not None:  # scored where it was generated (an agent's rewards)
                g.rewards, g.correct = r.scores[i], [v >= 1.0 for v in r.scores[i]]
            self.finished.append(g)
        for uid in r.failed:  # nothing to train: its prompt is used up
            g = self.in_flight.pop(uid)
            self.load[engine] -= 1
            self.counts.filtered_draws.append(g.draw)

    def _score(self) -> None:
        """Score the finished groups: each is kept or, with dynamic sampling, filtered. Then ready groups too stale
        to train at the current version are generated again."""
        if self.finished:
            self._score_finished()
        version = self.planes.weight_version
        stale = [g for g in self.ready if version - g.oldest > self.k]
        self.ready = [g for g in self.ready if version - g.oldest <= self.k]
        for g in stale:
            self._submit(self._new_group(g.draw, g.attempt + 1, g.prompt))
            self.counts.regenerated += 1

    def _score_finished(self) -> None:
        groups, self.finished = self.finished, []
        unscored = [g for g in groups if g.rewards is None]
        if unscored:
            samples = [s for g in unscored for s in g.samples]
            completions = self.tokenizer.batch_decode([s.token_ids for s in samples])
            rewards, metrics = self.scorer(completions, [g.prompt.answer for g in unscored for _ in g.samples],
                                           [g.prompt.text for g in unscored for _ in g.samples])
            correct = [v >= 1.0 for v in self.scorer.last_verifier]
            self.counts.reward_metrics.append(metrics)
            n = self.sampling.n
            for i, g in enumerate(unscored):
                g.rewards, g.correct = list(rewards[i * n:(i + 1) * n]), correct[i * n:(i + 1) * n]
        cap = (self.algo.cfg.max_gen_batches - 1) * self.per_step
        for g in groups:
            labels = torch.zeros(len(g.rewards), dtype=torch.long)
            # past the step's cap, uninformative groups only fill the step's batch (the synchronous filter's rule)
            forced = self.counts.filtered >= cap and len(self.ready) < self.per_step
            if self.algo.filters_groups and not forced and \
                    not bool(self.algo.keep_groups(torch.tensor(g.rewards), labels).any()):
                self.counts.filtered += 1
                self.counts.filtered_draws.append(g.draw)
            else:
                self.ready.append(g)

    # --- the step's groups --------------------------------------------------------------------------------------
    def take(self) -> list[Group]:
        """The step's P groups: the first P ready in completion order, running the engines until there are."""
        self.counts = StepCounts(busy=[0.0] * len(self.engines), overlap_busy=[0.0] * len(self.engines))
        while True:
            self._score()
            if len(self.ready) >= self.per_step:
                break
            self._top_up()
            self._advance(None, self.per_step - len(self.ready))
        version = self.planes.weight_version
        batch, self.ready = self.ready[:self.per_step], self.ready[self.per_step:]
        self.staleness = [version - g.oldest for g in batch]
        return batch

    def run_ahead(self) -> None:
        """Engines on the trainer's devices: the schedule's engine steps now, before training (on the weights the
        trainer starts from: what they would have generated while it trained)."""
        if self.local and self.schedule > 0:
            self._top_up(during_training=True)
            self._advance(self.schedule, None, overlap=True)

    @contextmanager
    def overlap(self) -> Iterator[None]:
        """Engines on devices of their own run on while the trainer works: the schedule's engine steps, or with
        none as long as the trainer works (topped up as groups complete)."""
        if self.background:  # (they run on by themselves: given the next groups, they need no driving)
            self._top_up(during_training=True)
            self._advance(0, None, overlap=True)
        if self.local or self.background:
            yield
            return
        stop, failure = threading.Event(), []

        def run() -> None:
            try:
                self._top_up(during_training=True)
                self._advance(self.schedule or None, None, True, None if self.schedule else stop)
            except BaseException as e:  # raised in the caller's thread once training is done
                failure.append(e)

        worker = threading.Thread(target=run, name="twinplane-producer", daemon=True)
        worker.start()
        try:
            yield
        finally:
            stop.set()
            worker.join()
        if failure:
            raise failure[0]

    def weights_updated(self) -> None:
        """After a weight sync (the engines requeued or restarted what was in flight): what was in flight then."""
        self.tokens_at_sync = sum(self.in_flight_tokens)

    def metrics(self, step_seconds: float, train_seconds: float) -> dict:
        """The step's staleness histogram, the groups' fates, and each plane's busy and idle seconds."""
        c, st = self.counts, self.staleness
        m = {"async/staleness_mean": sum(st) / len(st), "async/staleness_max": max(st),
             "async/groups_regenerated": c.regenerated, "async/groups_filtered": c.filtered,
             "async/groups_waiting": len(self.ready) + len(self.finished),
             "async/groups_in_flight": len(self.in_flight),
             "async/tokens_in_flight_at_sync": self.tokens_at_sync}
        m |= {f"async/staleness_frac_{s}": st.count(s) / len(st) for s in range(self.k + 1)}
        # An engine's busy seconds (the busiest's); overlap: its seconds while the trainer worked on other devices.
        busy = max(a + b for a, b in zip(c.busy, c.overlap_busy, strict=True))
        overlap = 0.0 if self.local else min(max(c.overlap_busy), train_seconds)
        m |= {"async/rollout_busy_s": busy, "async/rollout_idle_s": max(step_seconds - busy, 0.0),
              "async/train_busy_s": train_seconds, "async/train_idle_s": max(step_seconds - train_seconds, 0.0)}
        if not self.background:  # (episodes overlap training in ways the engine's counters do not separate)
            m["async/overlap_s"] = overlap
        if self.algo.filters_groups:
            m |= {"rollout/gen_batches": c.generated / self.per_step, "rollout/groups_dropped": c.filtered}
        return m

    # --- checkpoints --------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """Everything not yet trained on, as plain data (JSON)."""

        def group(g: Group) -> dict:
            return asdict(g) | {"samples": [sample_state(s) for s in g.samples]}

        return {"next_uid": self.next_uid, "in_flight": [group(g) for g in self.in_flight.values()],
                "finished": [group(g) for g in self.finished], "ready": [group(g) for g in self.ready],
                "engines": [e.state() for e in self.engines],
                "outbox": [[asdict(r) for r in box] for box in self.outbox]}

    def load_state(self, state: dict) -> None:
        def group(d: dict) -> Group:
            return Group(**d | {"prompt": Prompt(**d["prompt"]),
                                "samples": [sample_from_state(s) for s in d["samples"]]})

        self.next_uid = state["next_uid"]
        in_flight = [group(d) for d in state["in_flight"]]
        self.finished = [group(d) for d in state["finished"]]
        self.ready = [group(d) for d in state["ready"]]
        if len(state["engines"]) == len(self.engines) and getattr(self.engines[0], "keeps_in_flight", True):
            self.in_flight = {g.uid: g for g in in_flight}
            for g in in_flight:
                self.load[g.engine] += 1
            for e, s in zip(self.engines, state["engines"], strict=True):
                e.load_state(s)
            self.outbox = [[GroupRequest(**r) for r in box] for box in state["outbox"]]
        else:  # another engine count (cluster.rollout_devices changed), or episodes: generated again
            for g in in_flight:
                self._submit(self._new_group(g.draw, g.attempt + 1, g.prompt))


"""The rollout engine as a stream: groups of samples join at any engine step, weights change between steps.

Fully asynchronous RL keeps the engine busy while the trainer trains: a producer adds groups (one prompt, n samples)
as slots free up, takes them back as they complete, and the trainer's new weights arrive while samples are still
being generated (partial rollouts). `EngineStream` runs `RolloutEngine.engine_step` over one scheduler that lives
as long as the stream, so each `advance` continues where the last one stopped.

When the weights change (`weights_changed`), every sequence in flight either continues under the new weights
(`partial=True`: its k/v are dropped and recomputed from its tokens by the new weights, so every later token is
sampled from exactly the new policy given the text so far; the tokens already sampled keep the version and the
behaviour log-prob they were sampled with, `Sample.versions` / `logprobs`), or starts again from its prompt with
the same random streams (`partial=False`). Either way no k/v is held across a weight change, so a stream between
steps is plain data (`state` / `load_state`) and a resumed stream continues bitwise.

Samples are seeded by the caller (`GroupRequest.seeds`, one per sample), so a group samples the same whichever
engine runs it and whenever it is added.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch

from twinplane.rollout.engine import RolloutEngine
from twinplane.rollout.multi_turn import MultiTurnRollout
from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.scheduler import Scheduler
from twinplane.rollout.sequence import Sample, sample_from_state, sample_state
from twinplane.rollout.sequence import Sequence as Seq
from twinplane.rollout.stats import EngineStats


@dataclass
class GroupRequest:
    uid: int  # the caller's name for the group; its samples come back with request_index = uid
    prompt_ids: list[int]
    seeds: list[int]  # one per sample
    task: dict | None = None  # an agent's episodes: the data row they play (`Prompt.task`)


@dataclass(frozen=True)
class StreamRequest:
    """What an engine's stream is opened with, passed as it is through every layer between the producer and the
    stream (the planes, a Ray worker). `max_groups`: groups in flight at most (sizes the KV pool with
    `max_prompt_len`); `partial`: samples in flight at a weight change continue under the new weights (false: they
    start again); `max_staleness`: a group whose oldest token is more versions old than this after a weight change
    starts again (None: never)."""
    sampling: SamplingParams
    max_groups: int
    max_prompt_len: int
    partial: bool = True
    max_staleness: int | None = None


@dataclass
class StreamResult:
    """What one `EngineStream.call` did."""
    groups: list[list[Sample]]  # completed, in completion order
    stats: EngineStats  # the engine's counters for the call
    restarted: int  # groups in flight restarted since the last call, too stale to train on
    tokens_in_flight: int  # generated so far by the samples still in flight
    idle: bool  # nothing left to generate
    scores: list[list[float]] | None = None  # per group and sample: the rewards its agents returned (else unscored)
    failed: list[int] = field(default_factory=list)  # groups whose episodes all failed: uids, nothing to train


class EngineStream:
    """Groups in, completed groups out, over one `RolloutEngine` (all with one `SamplingParams`)."""

    def __init__(self, engine: RolloutEngine, request: StreamRequest, turns: MultiTurnRollout | None = None):
        """`request`: the sampling, sizes and rules of the stream (`StreamRequest`); `turns`: multi-turn tool
        rollouts, by its tools and rules (a sample that stops at a tool call gets the tool's output and generates on,
        its prefix recomputed). The stream follows the engine's weight changes from now on (`weights_changed`)."""
        sampling = request.sampling  # (as the stream samples: a tool call's end stops a turn)
        if turns is not None:
            sampling = replace(sampling, stop_sequences=[*sampling.stop_sequences, turns.call_end_ids])
        self.engine, self.request, self.sampling, self.turns = engine, request, sampling, turns
        self.restarted = 0  # too-stale restarts since the last `call`
        engine.on_weights = self.weights_changed
        self.stop_ids = frozenset(t for t in [engine.eos_token_id, *sampling.stop_token_ids] if t is not None)
        self.sched: Scheduler | None = None
        self.pool = None  # the engine's pool this stream's blocks live in (validation between steps may replace it)
        self.groups: dict[int, GroupRequest] = {}  # in flight, by uid
        self.finished: dict[int, dict[int, Sample]] = {}  # their finished samples, by uid and sample index

    # --- the pool -----------------------------------------------------------------------------------------------
    def _ensure_pool(self) -> None:
        """The engine's pool sized for the stream; (re)made when another call of the engine replaced it, which
        happens only while no sequence holds blocks (between steps every sequence is requeued, `pause`)."""
        e = self.engine
        if self.sched is not None and self.pool is e.kv and self.sched.blocks is e.blocks:
            return
        if self.sched is not None and self.sched.running:
            raise RuntimeError("the engine's pool was replaced while stream sequences held blocks")
        waiting = [] if self.sched is None else list(self.sched.waiting)
        n, bs = self.sampling.n, e.block_size
        groups, longest = self.request.max_groups, self.request.max_prompt_len + self.sampling.max_new_tokens
        e.allocate(longest, groups * n * (-(-longest // bs) + 1), groups * n)
        self.sched = e.scheduler()
        self.sched.waiting.extend(waiting)
        self.pool = e.kv

    # --- groups in, groups out ----------------------------------------------------------------------------------
    def add(self, groups: list[GroupRequest]) -> None:
        self._ensure_pool()
        for g in groups:
            if len(g.seeds) != self.sampling.n:
                raise ValueError(f"group {g.uid}: {len(g.seeds)} seeds for n={self.sampling.n}")
            if not 0 < len(g.prompt_ids) <= self.request.max_prompt_len:
                raise ValueError(f"group {g.uid}: a prompt of {len(g.prompt_ids)} tokens "
                                 f"(1..{self.request.max_prompt_len})")
            self.sched.add(Seq(list(g.prompt_ids), g.uid, self.sampling, g.seeds, self.stop_ids))
            self.groups[g.uid], self.finished[g.uid] = g, {}

    @torch.no_grad()
    def advance(self, steps: int | None = None, until_groups: int | None = None) -> list[list[Sample]]:
        """Run engine steps until `steps` have run, `until_groups` groups have completed or nothing is left;
        returns the completed groups in completion order (a group's samples by sample index)."""
        if self.sched is None or not self.sched.has_work():
            return []
        self._ensure_pool()
        e, n, done, ran, t0 = self.engine, self.sampling.n, [], 0, time.perf_counter()

        def book(finished: list[Seq]) -> None:
            for seq in self._end_turns(finished):
                uid = seq.request_index
                self.finished[uid][seq.sample_indices[0]] = seq.to_sample(e.weight_version)
                if len(self.finished[uid]) == n:
                    del self.groups[uid]
                    samples = self.finished.pop(uid)
                    done.append([samples[j] for j in range(n)])

        try:
            # (no step runs ahead of a tool call: the sequence that stopped at it goes on)
            while self.sched.has_work() and (steps is None or ran < steps) and \
                    (until_groups is None or len(done) < until_groups):
                book(e.engine_step(self.sched, self.sampling, ahead=self.turns is None))
                ran += 1
            book(e.flush(self.sched))
        finally:
            e.end_steps(self.sched, t0)
        return done

    def _end_turns(self, finished: list[Seq]) -> list[Seq]:
        """Multi-turn: a sample that stopped at a tool call gets the tool's output and is queued to generate on;
        the rest are done. The rules are `MultiTurnRollout`'s (budget over tool tokens too, `max_turns`, errors
        as outputs); the tools of one engine step run together."""
        t = self.turns
        if t is None or not finished:
            return finished
        done, calls, end = [], [], t.call_end_ids
        for seq in finished:
            seq.turns.count += 1
            turn = seq.tokens[max(seq.turns.start, seq.prompt_len):]
            if seq.finish_reason == "stop" and len(turn) >= len(end) and turn[-len(end):] == end:
                if seq.turns.count < t.max_turns:
                    calls.append((seq, turn))
                    continue
                seq.finish_reason = "max_turns"
            done.append(seq)
        results = t.run_calls([turn for _, turn in calls])
        for (seq, _), result in zip(calls, results, strict=True):
            seq.turns.calls += 1
            seq.turns.errors += int(result.error)
            ids = t.encode(t.output_template.replace("{output}", result.output))
            room = seq.max_new_tokens - seq.num_generated
            seq.add_tool_output(ids[:room], self.engine.weight_version)
            if len(ids) >= room:  # no room left for the model to read it and answer
                seq.finish_reason = "length"
                done.append(seq)
            else:
                seq.finish_reason = None
                self.sched.add(seq)
        return done

    def call(self, add: list[GroupRequest], steps: int | None, until: int | None) -> StreamResult:
        """`add` the groups, `advance`, and say what happened (one round trip for a remote engine); the counters
        are this call's own (not those of a validation run between calls)."""
        self.engine.pop_stats()
        self.add(add)
        groups = self.advance(steps, until)
        if not self.engine.keep_pool:  # a device shared with a trainer: no KV held between calls
            self.pause()
        restarted, self.restarted = self.restarted, 0
        return StreamResult(groups, self.engine.pop_stats(), restarted, self.tokens_in_flight,
                            self.sched is None or not self.sched.has_work())

    def weights_changed(self) -> None:
        """The engine's weights were just replaced: every sequence in flight continues under them (`partial`:
        recomputed from its tokens) or starts again from its prompt; a group already too stale to train on starts
        again either way."""
        if self.sched is None:
            return
        self.pause()
        if not self.request.partial:
            self.restart(set(self.groups))
            return
        if self.request.max_staleness is None:
            return
        oldest = self.engine.weight_version - self.request.max_staleness  # the oldest version still trainable
        stale = {s.request_index for s in self.sched.waiting if s.versions and s.versions[0] < oldest}
        stale |= {uid for uid, done in self.finished.items() if any(x.oldest_version < oldest for x in done.values())}
        self.restarted += len(stale)
        self.restart(stale)

    def restart(self, uids: set[int]) -> None:
        """The groups `uids` start again from their prompts with the same random streams (finished samples
        included: a group's samples come from one policy version, as far as the restart goes)."""
        if not uids:
            return
        self.pause()
        for seq in self.sched.waiting:
            if seq.request_index in uids:
                seq.restart()
        for uid in sorted(uids):
            g, done = self.groups[uid], self.finished[uid]
            for j in sorted(done):
                self.sched.add(Seq(list(g.prompt_ids), uid, self.sampling, [g.seeds[j]], self.stop_ids, [j]))
            done.clear()

    def pause(self) -> None:
        """Release every block: the sequences in flight are requeued, in order, to be recomputed when they run."""
        if self.sched is not None:
            self.sched.requeue_running()
            if not self.engine.keep_pool:
                self.engine.release()

    @property
    def tokens_in_flight(self) -> int:
        """Tokens generated so far by the samples still being generated."""
        if self.sched is None:
            return 0
        return sum(s.num_generated for s in [*self.sched.running, *self.sched.waiting])

    def pop_stats(self) -> EngineStats:
        return self.engine.pop_stats()

    # --- checkpoints --------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """The groups in flight as plain data (JSON); the stream is paused first (no blocks held)."""
        self.pause()
        return {"waiting": [s.state() for s in self.sched.waiting] if self.sched else [],
                "groups": [asdict(g) for g in self.groups.values()],
                "finished": [[uid, j, sample_state(s)] for uid, done in self.finished.items() for j, s in done.items()]}

    def load_state(self, state: dict) -> None:
        self._ensure_pool()
        self.sched.waiting.clear()
        self.sched.waiting.extend(Seq.from_state(s, self.sampling, self.stop_ids) for s in state["waiting"])
        self.groups = {g["uid"]: GroupRequest(**g) for g in state["groups"]}
        self.finished = {uid: {} for uid in self.groups}
        for uid, j, s in state["finished"]:
            self.finished[uid][j] = sample_from_state(s)

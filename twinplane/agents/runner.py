"""A step's rollout through the user's agent: each prompt's `n` episodes talk to the policy through their own
session of the OpenAI-compatible server, and come back as training samples with the agent's rewards.

`agent.entrypoint` names `run(base_url, task)`, an `async def` (run as a task on the agents' event loop) or a plain
`def` (run on a thread), or a gym-style environment class (twinplane.agents.environment); `task` is the data row
as a dict (the demo's: `prompt` and `answer`). It returns the
episode's reward, a float, or a dict with `reward` and optional `metrics` (floats, averaged into `agent/<name>`).
Its session records every call's tokens (twinplane.serving.sessions); the trajectories become the samples, each
with the episode's reward, grouped by prompt for the advantages.

An episode that raises, returns something else, or passes `agent.timeout_s` costs itself only: it is counted
(`agent/errors`, `agent/timeouts`; a timed-out one is cancelled and the module's `abort(task)` runs if it has
one) and trains nothing. A step where every episode failed stops the run with the first error (exit 2): the
agent, not the run, needs fixing. Each session's calls are seeded from (run seed, step, prompt, episode, call),
so a deterministic agent makes a seeded run reproducible.

With `cluster.max_staleness=k >= 1` the episodes run on while the trainer trains (`AgentStream`, the producer's
stream): the producer starts a prompt's n episodes as slots free up and takes back groups whose episodes have all
ended, within the staleness bound. A weight sync lets the calls in flight finish, then the engine takes the new
weights and the waiting calls go on with them; a trajectory's tokens each keep their version.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from twinplane.agents.environment import environment_agent, is_environment
from twinplane.data.prompts import Prompt
from twinplane.errors import InputError, first_line
from twinplane.rewards.registry import load_user_fn
from twinplane.rollout.engine import RolloutEngine
from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.sequence import Sample, sample_seed
from twinplane.rollout.stats import Done
from twinplane.rollout.stream import GroupRequest, StreamResult
from twinplane.serving.engine_loop import EngineLoop
from twinplane.serving.openai_api import Served
from twinplane.serving.server import BackgroundServer, build_app
from twinplane.serving.sessions import Session, SessionStore
from twinplane.serving.templates import ChatTemplate
from twinplane.tokenizer import Tokenizer


@dataclass
class Episode:
    prompt: int  # index of its prompt in the step
    samples: list[Sample] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False
    splits: int = 0


def episode_reward(value) -> tuple[float, dict[str, float]]:
    """An agent's return value -> (reward, metrics); a ValueError for anything else."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"the agent returned a dict without 'reward' (keys: {sorted(value)[:5]})")
        metrics = value.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise ValueError("the agent's 'metrics' must be a dict of numbers")
        reward, _ = episode_reward(value["reward"])
        return reward, {str(k): float(v) for k, v in metrics.items()}
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the agent returned {type(value).__name__} {str(value)[:40]!r}, not a finite reward")
    return float(value), {}


class AgentRollout:
    """The server over the run's engine, and the episodes of each step."""

    def __init__(self, entrypoint: str, engine: RolloutEngine | EngineLoop, tokenizer: Tokenizer,
                 sampling: SamplingParams, max_prompt_len: int, template: ChatTemplate | None, concurrency: int,
                 timeout_s: float, max_turns: int, seed: int, log=print):
        """`engine`: the engine, or the planes' serving loop (`Planes.serve`); `log(line)`: where failed episodes
        are told (one line per step, with the first error)."""
        try:
            self.fn = load_user_fn(entrypoint, "agent")
            abort = getattr(inspect.getmodule(self.fn), "abort", None)
            self.abort = abort if callable(abort) else None
        except ValueError as e:
            raise InputError(f"agent.entrypoint: {e}") from None
        if is_environment(self.fn):  # a gym-style class: twinplane plays it with the policy
            self.fn = environment_agent(self.fn, template is not None, max_turns, sampling.max_new_tokens)
        self.tokenizer, self.sampling, self.seed, self.log = tokenizer, sampling, seed, log
        self.concurrency, self.timeout_s, self.max_turns = concurrency, timeout_s, max_turns
        self.loop = EngineLoop(engine, max_prompt_len + sampling.max_new_tokens) \
            if isinstance(engine, RolloutEngine) else engine  # (else the planes' serving loop)
        self.sessions = SessionStore()
        self.served = Served(self.loop, tokenizer, "policy", template, sessions=self.sessions,
                             session_sampling=sampling, seed=seed)
        self.server = BackgroundServer(build_app(self.served))
        self.url = self.server.start()
        self.events = asyncio.new_event_loop()  # the agents' own loop, on its own thread
        self.events.set_default_executor(ThreadPoolExecutor(concurrency, "twinplane-agent"))  # (plain-def agents)
        self.thread = threading.Thread(target=self.events.run_forever, name="twinplane-agents", daemon=True)
        self.thread.start()
        self.gate: asyncio.Semaphore | None = None
        self.streamed: AgentStream | None = None

    def run(self, prompts: Sequence[Prompt], step: int) -> tuple[list[Sample], torch.Tensor, torch.Tensor, dict]:
        """(samples, rewards [N], correct [N] (reward >= 1), metrics) of `sampling.n` episodes per prompt."""
        self.loop.engine.pop_stats()
        self.loop.open()
        try:
            episodes = asyncio.run_coroutine_threadsafe(self._episodes(prompts, step), self.events).result()
        finally:
            self.loop.shut()  # a late call of a cancelled episode is refused: the engine is the trainer's again
        self.stats = self.loop.engine.pop_stats()
        samples, rewards = [], []
        for e in episodes:
            samples += e.samples
            rewards += [e.reward] * len(e.samples)
        failed = [e for e in episodes if e.error is not None]
        if not samples:
            first = failed[0].error if failed else "no episode called the model"
            raise InputError(f"agent.entrypoint: every episode of step {step} failed, the first with: {first}")
        if failed:
            self.log(f"agent: {len(failed)} of {len(episodes)} episodes of step {step} failed, the first with: "
                     f"{failed[0].error}")
        rewards = torch.tensor(rewards, dtype=torch.float32)
        return samples, rewards, rewards >= 1.0, episode_metrics(episodes)

    async def _episodes(self, prompts: Sequence[Prompt], step: int) -> list[Episode]:
        return list(await asyncio.gather(*[
            self._episode(f"s{step}-p{i}-e{j}", prompts[i].task, sample_seed(self.seed, step, i * 65_537 + j), i)
            for i in range(len(prompts)) for j in range(self.sampling.n)]))

    def stream(self, per_step: int) -> AgentStream:
        """The episodes as the asynchronous producer's stream (the engine serves them from now on)."""
        self.loop.open()
        self.streamed = AgentStream(self, per_step)
        return self.streamed

    def held(self) -> AbstractContextManager:
        """The engine lent out (weight sync, validation, checkpoint): calls in flight finish, new ones wait."""
        return self.loop.held()

    async def _episode(self, sid: str, task: dict, seed: int, index: int) -> Episode:
        """One episode in session `sid`, its samples labelled `index` (the prompt's group); at most
        `agent.concurrency` run at once."""
        if self.gate is None:  # (made on the agents' loop, which it belongs to)
            self.gate = asyncio.Semaphore(self.concurrency)
        async with self.gate:
            return await self._play(sid, task, seed, index)

    async def _play(self, sid: str, task: dict, seed: int, index: int) -> Episode:
        session = self.sessions.open(Session(sid, self.tokenizer, self.sampling.max_new_tokens, self.max_turns,
                                             seed=seed))
        episode = Episode(index)
        call = self.fn(f"{self.url}/sessions/{sid}/v1", task) if inspect.iscoroutinefunction(self.fn) else \
            asyncio.to_thread(self.fn, f"{self.url}/sessions/{sid}/v1", task)
        try:
            episode.reward, episode.metrics = episode_reward(await asyncio.wait_for(call, self.timeout_s))
            episode.samples = session.samples(index)
        except asyncio.TimeoutError:
            episode.error, episode.timed_out = f"timed out after {self.timeout_s:g} s (agent.timeout_s)", True
            if self.abort is not None:
                await asyncio.to_thread(_quietly, self.abort, task)
        except Exception as e:  # the user's code: its failure costs this episode only
            episode.error = first_line(e, typed=True)
        finally:
            self.sessions.close(sid)
        episode.splits = session.splits
        return episode

    def close(self) -> None:
        if self.streamed is not None:
            self.streamed.cancel()
        self.loop.shut()  # (calls in flight finish; later ones are refused)
        self.server.stop()
        self.events.call_soon_threadsafe(self.events.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """agent/*: the episodes' counts, turns, rewards and the means of the metrics they returned."""
    failed = [e for e in episodes if e.error is not None]
    done = [e for e in episodes if e.error is None]
    samples = [s for e in episodes for s in e.samples]
    metrics = {"agent/episodes": len(episodes), "agent/errors": sum(not e.timed_out for e in failed),
               "agent/timeouts": sum(e.timed_out for e in failed), "agent/splits": sum(e.splits for e in episodes),
               "agent/turns_mean": sum(s.num_turns for s in samples) / max(len(samples), 1),
               "agent/reward_mean": sum(e.reward for e in done) / max(len(done), 1)}
    keys = dict.fromkeys(k for e in done for k in e.metrics)
    return metrics | {f"agent/{k}": sum(e.metrics[k] for e in done if k in e.metrics)
                      / sum(k in e.metrics for e in done) for k in keys}


class AgentStream:
    """The agents as the asynchronous producer's engine stream: a group request starts its prompt's n episodes at
    once; a call returns the groups whose episodes have all ended, with the rewards their agents returned. The
    episodes run on between calls, while the trainer trains."""

    keeps_in_flight = False  # an episode is the user's code, not data: a resumed run plays it again

    def __init__(self, agents: AgentRollout, per_step: int):
        """`per_step`: groups per step; that many in a row with no episode ending well stop the run (exit 2)."""
        self.agents, self.per_step = agents, per_step
        self.cond = threading.Condition()
        self.ended: list[tuple[int, list[Episode]]] = []  # (uid, its episodes), not yet handed over
        self.in_flight = 0
        self.episodes: list[Episode] = []  # ended since the last `pop_metrics`
        self.failed_in_a_row, self.first_error = 0, None
        self.tasks: set = set()  # the groups' futures on the agents' loop

    def call(self, add: list[GroupRequest], steps: int | None, until: int | None) -> Done:
        """Start `add`'s episodes; with `until`, wait until that many groups have ended (or none is left)."""
        for r in add:
            with self.cond:
                self.in_flight += 1
            task = asyncio.run_coroutine_threadsafe(self._group(r), self.agents.events)
            with self.cond:
                self.tasks.add(task)
            task.add_done_callback(self._forget)
        with self.cond:
            if until:
                self.cond.wait_for(lambda: len(self.ended) >= until or not self.in_flight)
            ended, self.ended = self.ended, []
            in_flight = self.in_flight
        if self.failed_in_a_row >= self.per_step:
            raise InputError(f"agent.entrypoint: {self.failed_in_a_row} prompts in a row had every episode fail, "
                             f"the first with: {self.first_error}")
        groups = [[s for e in eps for s in e.samples] for _, eps in ended]
        scores = [[e.reward for e in eps for _ in e.samples] for _, eps in ended]
        kept = [i for i, g in enumerate(groups) if g]
        failed = [uid for i, (uid, _) in enumerate(ended) if not groups[i]]
        result = StreamResult([groups[i] for i in kept], self.agents.loop.engine.pop_stats(), 0, 0, not in_flight,
                              [scores[i] for i in kept], failed)
        return Done(result, result.stats)

    async def _group(self, r: GroupRequest) -> None:
        episodes = await asyncio.gather(*[self.agents._episode(f"g{r.uid}-e{j}", r.task, seed, r.uid)
                                          for j, seed in enumerate(r.seeds)])
        with self.cond:
            if any(e.samples for e in episodes):
                self.failed_in_a_row = 0
            else:
                self.failed_in_a_row += 1
                errors = [e.error for e in episodes if e.error is not None]
                self.first_error = self.first_error or (errors[0] if errors else "no episode called the model")
            self.ended.append((r.uid, episodes))
            self.episodes += episodes
            self.in_flight -= 1
            self.cond.notify_all()

    def pop_metrics(self) -> dict[str, float]:
        """agent/* over the episodes that ended since the last call."""
        with self.cond:
            episodes, self.episodes = self.episodes, []
        failed = [e for e in episodes if e.error is not None]
        if failed:
            self.agents.log(f"agent: {len(failed)} of {len(episodes)} episodes that ended this step failed, the first "
                            f"with: {failed[0].error}")
        return episode_metrics(episodes) if episodes else {"agent/episodes": 0}

    def cancel(self) -> None:
        """The episodes still in flight are cancelled (the run ends)."""
        with self.cond:
            tasks = list(self.tasks)
        for f in tasks:
            f.cancel()

    def _forget(self, task) -> None:
        with self.cond:
            self.tasks.discard(task)

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # (an abort hook that fails changes nothing: the episode is already counted)
        pass


def build_agent_rollout(cfg, planes, tokenizer: Tokenizer, sampling: SamplingParams, log=print) -> AgentRollout:
    """The run's agent rollout (`agent.*`), with the model folder's chat template when it has one (else the
    completions route alone serves: the demo's character model has no template)."""
    template = None
    if cfg.model.path is not None:
        try:
            template = ChatTemplate.from_model_dir(cfg.model.path)
        except ValueError:  # (DataError: no template in the folder)
            template = None
    a = cfg.agent
    loop = planes.serve(cfg.data.max_prompt_tokens + sampling.max_new_tokens)
    return AgentRollout(a.entrypoint, loop, tokenizer, sampling, cfg.data.max_prompt_tokens, template,
                        a.concurrency, a.timeout_s, a.max_turns, cfg.seed, log)

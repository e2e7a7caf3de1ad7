"""Sessions that own their tokens: an agent episode's calls become training samples of exactly the tokens sampled.

An agent talks to its session's base URL (`.../sessions/<id>/v1`) over many calls. Each call's prompt is text
rendered by the server (the chat template over the request's messages, or the completion's prompt). The session
keeps its trajectory's exact token ids and the exact text they stand for:

- a request whose rendered text starts with the trajectory's text EXTENDS it: its prompt is the trajectory's own
  ids plus the tokenized rest (tool results, user turns, the template's markup). Earlier tokens are never decoded
  and encoded again, so what the model sees at each call is exactly what it sampled before;
- any other request (the template stripped an earlier `<think>`, the client re-serialised tool arguments or
  compacted its context) starts a NEW trajectory from its own prompt, counted in `splits`: a sample is never
  trained on tokens the model did not see.

A trajectory is one training sample: the first call's prompt, then every later token, with loss mask 1 and the
engine's log-prob on the tokens the model sampled and 0 on the rest. Token-id prompts (the completions route) are
matched as ids.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import torch

from twinplane.rollout.sequence import Sample, sample_seed
from twinplane.tokenizer import Tokenizer


@dataclass
class Trajectory:
    prompt_ids: list[int]
    text: str  # the exact text of prompt_ids + token_ids
    visible: str = ""  # `text` as a completion's client knows it: without the stop tokens that ended its calls
    spent: bool = False  # cut where the session's budget ended: later calls generate nothing
    token_ids: list[int] = field(default_factory=list)  # after the prompt: sampled and appended tokens
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled by the model
    versions: list[int] = field(default_factory=list)  # the weights' version of each token
    finish_reason: str = "stop"
    calls: int = 0
    routing: torch.Tensor | None = None  # the last call's MoE record: it ran every earlier token of the trajectory

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def to_sample(self, request_index: int) -> Sample:
        version = max(self.versions, default=0)
        routing = self.routing
        if routing is not None and len(routing) < len(self.ids):  # tokens appended after the last call: never run
            routing = torch.cat([routing, routing.new_full((len(self.ids) - len(routing), *routing.shape[1:]), -1)])
        return Sample(request_index, list(self.prompt_ids), list(self.token_ids), list(self.logprobs),
                      self.finish_reason, version, loss_mask=list(self.loss_mask), num_turns=max(self.calls, 1),
                      routing=routing, versions=list(self.versions))


class SessionError(ValueError):
    """A request the session cannot serve (its budget is spent); the server answers 400."""


class Session:
    """One episode's record. `budget`: tokens after a trajectory's first prompt at most (the run's
    `rollout.max_new_tokens`, so that a trajectory trains like one sample); None: no cap (serving). `max_turns`:
    calls at most. `seed`: the calls' samples are seeded from it and the call's number, whatever the request says
    (a training run's episodes are reproducible); None: the request's seed."""

    def __init__(self, sid: str, tokenizer: Tokenizer, budget: int | None = None, max_turns: int | None = None,
                 seed: int | None = None):
        self.id, self.tok, self.budget, self.max_turns, self.seed = sid, tokenizer, budget, max_turns, seed
        self.calls = 0
        self.trajectories: list[Trajectory] = []
        self.splits = 0  # requests that did not extend the trajectory before them
        self.lock = asyncio.Lock()  # (an agent may send calls of one session concurrently: they are serialised)

    @property
    def current(self) -> Trajectory | None:
        return self.trajectories[-1] if self.trajectories else None

    def prompt(self, text: str | None = None, ids: list[int] | None = None,
               rendered: bool = False) -> tuple[list[int], int | None]:
        """The prompt ids of a request rendered as `text` (or given as `ids`), and its cap on new tokens from the
        budget (None: uncapped; 0: the budget is spent, this call and every later one generate nothing and the
        trajectory ends with "length", cut where the budget ends). Extends the current trajectory when the
        request starts with it, else starts a new one (counted in `splits` when there was one). A completion's
        text leaves out the stop tokens that ended earlier calls (the client never saw them: they stay in the
        tokens); a chat's text is `rendered` by the template, which writes the end of each turn itself, so it must
        hold the record as is."""
        if self.max_turns is not None and self.calls >= self.max_turns:
            raise SessionError(f"session {self.id}: its {self.max_turns} calls (agent.max_turns) are used up")
        t = self.current
        if t is not None and t.spent:
            return t.ids, 0
        known = None if t is None or text is None else t.text if rendered else t.visible
        if t is not None and (known is not None and text.startswith(known)
                              or ids is not None and ids[:len(t.ids)] == t.ids):
            if text is not None:  # (a stop token the client did not see stays: the model did see it)
                suffix = text[len(known):]
                rest = self.tok.encode(suffix)
            else:
                rest = ids[len(t.ids):]
                suffix = self.tok.decode(rest, skip_special_tokens=False)
            if self.budget is not None and len(t.token_ids) + len(rest) >= self.budget:  # cut where it ends
                rest, t.finish_reason, t.spent = rest[:self.budget - len(t.token_ids)], "length", True
            t.text, t.visible = t.text + suffix, t.visible + suffix
            t.token_ids += rest
            t.logprobs += [0.0] * len(rest)
            t.loss_mask += [0] * len(rest)
            t.versions += [max(t.versions, default=0)] * len(rest)
        else:
            if t is not None:
                self.splits += 1
            prompt = self.tok.encode(text) if text is not None else list(ids)
            said = text if text is not None else self.tok.decode(prompt, skip_special_tokens=False)
            t = Trajectory(prompt, said, said)
            self.trajectories.append(t)
        return t.ids, None if self.budget is None else self.budget - len(t.token_ids)

    def record(self, sample: Sample, text: str, hidden: str = "") -> None:
        """The call's sampled tokens (`text`: their exact text, ending with `hidden`, the text of a stop token
        that the client is not shown) extend the current trajectory."""
        t = self.current
        t.visible += text[:len(text) - len(hidden)]
        t.token_ids += sample.token_ids
        t.logprobs += sample.logprobs
        t.loss_mask += [1] * len(sample.token_ids)
        t.versions += sample.versions or [sample.weight_version] * len(sample.token_ids)
        t.text += text
        t.finish_reason, t.calls = sample.finish_reason, t.calls + 1
        t.spent = t.spent or self.budget is not None and len(t.token_ids) >= self.budget
        self.calls += 1
        if sample.routing is not None:  # (a call with nothing to generate ran nothing)
            t.routing = sample.routing

    def prompt_length(self, text: str) -> int:
        """How many tokens `prompt(text=text, rendered=True)` would give the request's prompt; nothing recorded."""
        t = self.current
        if t is not None and t.spent:
            return len(t.ids)
        if t is not None and text.startswith(t.text):
            rest = len(self.tok.encode(text[len(t.text):]))
            return len(t.ids) + (rest if self.budget is None else min(rest, self.budget - len(t.token_ids)))
        return len(self.tok.encode(text))

    def call_seed(self) -> int | None:
        """The seed of the next call's samples (None: the request's)."""
        return None if self.seed is None else sample_seed(self.seed, self.calls, 0)

    def samples(self, request_index: int) -> list[Sample]:
        """The trajectories that the model generated in, as training samples."""
        return [t.to_sample(request_index) for t in self.trajectories if t.calls]


class SessionStore:
    """The sessions a server knows, by id (thread-safe: the server's event loop and the trainer share it)."""

    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, session: Session) -> Session:
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"session {session.id} is already open")
            self._sessions[session.id] = session
        return session

    def get(self, sid: str) -> Session | None:
        with self._lock:
            return self._sessions.get(sid)

    def close(self, sid: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(sid, None)

"""A sequence being generated, and the sample it becomes.

A request with `n` samples enters the engine as ONE sequence that carries n random streams: its prompt is
prefilled once, then it forks into n sequences that share the prompt's blocks (twinplane.rollout.block_manager).
Each sample draws from its own stream, seeded from (call seed, request index, sample index), so what it samples
does not depend on batching, admission order or preemption.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace

import torch

from twinplane.rollout.sampling import SamplingParams


@dataclass
class Sample:
    request_index: int
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, including the stop token when there is one
    logprobs: list[float]  # log pi(token) under the engine's weights, per generated token
    finish_reason: str  # "stop" (EOS / stop token / stop sequence) or "length" (max_new_tokens)
    weight_version: int  # the weights' version when it finished
    # Multi-turn fields (filled by multi_turn.py), here so every consumer reads one type: a plain generation is
    # one turn of model tokens only.
    loss_mask: list[int] | None = None  # per token: 1 = model-generated (trained on), 0 = tool output; None = all 1
    num_turns: int = 1
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    # MoE routing record [len(prompt_ids) + len(token_ids), M sparse layers, k] int16 expert ids; -1 where the
    # engine never ran the token (the last sampled one). None unless the engine records routing.
    routing: torch.Tensor | None = None
    # Per generated token, the weights' version it was sampled with (a stream's partial rollouts change weights
    # mid-sample); None: all `weight_version`.
    versions: list[int] | None = None
    # Per generated token, the `sampling.top_logprobs` most likely (token, log-prob) pairs; None when not asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.token_ids)

    @property
    def oldest_version(self) -> int:
        """The version of its first token: how stale the sample is, as the staleness bound counts it."""
        return self.versions[0] if self.versions else self.weight_version


def sample_state(s: Sample) -> dict:
    """A sample as plain data (JSON), for checkpoints."""
    return asdict(s) | {"routing": None if s.routing is None else s.routing.tolist()}


def sample_from_state(state: dict) -> Sample:
    routing = state.get("routing")
    return Sample(**state | {"routing": None if routing is None else torch.tensor(routing, dtype=torch.int16)})


def sample_seed(seed: int, request_index: int, sample_index: int) -> int:
    """The seed of one sample's random stream (a string seed is hashed with SHA-512 by `random.Random`, so
    neighbouring indices give unrelated streams, independent of PYTHONHASHSEED)."""
    return random.Random(f"{seed}/{request_index}/{sample_index}").getrandbits(64)


@dataclass
class Turns:
    """A sequence's multi-turn record: where its current model turn starts, the loss mask of its tool tokens, and
    the counts a `Sample` reports."""
    start: int = 0  # token index where the current model turn starts (0: the first turn, after the prompt)
    loss_mask: list[int] = field(default_factory=list)  # per generated token up to the last tool output
    count: int = 0  # model turns finished
    calls: int = 0
    errors: int = 0

    @property
    def tool_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    def mask(self, num_generated: int) -> list[int] | None:
        """The sample's loss mask (None: every token the model's)."""
        if not self.loss_mask:
            return None
        return self.loss_mask + [1] * (num_generated - len(self.loss_mask))


class Sequence:
    """Tokens (prompt + generated), how many of them have k/v in the pool, and the blocks holding them."""

    def __init__(self, prompt: list[int], request_index: int, sampling: SamplingParams, seeds: list[int],
                 stop_ids: frozenset[int] = frozenset(), sample_indices: list[int] | None = None,
                 max_new_tokens: int | None = None):
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.request_index = request_index
        self.sampling = sampling
        # this request's cap: sampling.max_new_tokens, or less (a multi-turn continuation's remaining budget)
        self.max_new_tokens = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.stop_ids = stop_ids  # EOS and the request's stop tokens
        self.sample_indices = list(range(len(seeds))) if sample_indices is None else sample_indices
        self.seeds = list(seeds)
        self.rngs = [random.Random(s) for s in seeds]  # > 1 only before the fork: one per sample
        self.num_computed = 0  # leading tokens whose k/v are in the pool
        self.block_table: list[int] = []
        self.state_slot: int | None = None  # linear-attention models: its slot of the engine's recurrent states
        self.long_rope = False  # longrope models: its k/v rotate by the long factors (set by the scheduler)
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # per generated token, the weights' version that sampled it
        self.finish_reason: str | None = None
        self.routes: list[tuple[int, torch.Tensor]] = []  # MoE record: (first position, experts [T, M, k] int16)
        self.turns = Turns()  # multi-turn tool rollouts driven by a stream (rollout.stream); else unused
        self.top: list[list[tuple[int, float]]] = []  # per generated token, with `sampling.top_logprobs`

    @property
    def width(self) -> int:
        """Running-set slots this sequence takes (its samples, once forked)."""
        return len(self.rngs)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled (1 when decoding)."""
        return len(self.tokens) - self.num_computed

    def fork(self) -> list[Sequence]:
        """One sequence per random stream, sharing this one's tokens and blocks (the caller counts the shares)."""
        children = []
        for rng, index, seed in zip(self.rngs, self.sample_indices, self.seeds, strict=True):
            c = Sequence.__new__(Sequence)
            c.__dict__.update(self.__dict__)
            c.tokens, c.block_table, c.logprobs = list(self.tokens), list(self.block_table), list(self.logprobs)
            c.versions, c.top = list(self.versions), list(self.top)
            c.routes, c.turns = list(self.routes), replace(self.turns, loss_mask=list(self.turns.loss_mask))
            c.rngs, c.sample_indices, c.seeds = [rng], [index], [seed]
            children.append(c)
        return children

    def append(self, token: int, logprob: float, version: int = 0) -> None:
        """Add a token sampled with weights `version`; set `finish_reason` when it ends the sample. (Called for
        every sequence in every decode step: attributes, not properties.)"""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        n, sp = len(self.tokens) - self.prompt_len, self.sampling
        if n > sp.min_new_tokens and (token in self.stop_ids or sp.stop_sequences and self._stop_sequence(n)):
            self.finish_reason = "stop"  # (a stop counts at index >= min_new_tokens)
        elif n >= self.max_new_tokens:
            self.finish_reason = "length"

    def _stop_sequence(self, n: int) -> bool:
        """The `n` generated tokens end with a stop sequence (the tails only: a copy of all generated tokens per
        token is O(length^2))."""
        return any(len(s) <= n and self.tokens[-len(s):] == s for s in self.sampling.stop_sequences)

    def record_routing(self, start: int, experts: torch.Tensor) -> None:
        """Keep the experts [T, M, k] that tokens start.. ran through; a recompute after preemption (which
        restarts at an earlier position) replaces what was recorded from there on."""
        self.routes = [r for r in self.routes if r[0] < start] + [(start, experts)]

    def to_sample(self, weight_version: int) -> Sample:
        routing = None
        if self.routes:  # tokens the engine never ran (the last sampled one) get -1
            ran = torch.cat([r for _, r in self.routes])
            routing = torch.full((len(self.tokens), *ran.shape[1:]), -1, dtype=torch.int16)
            routing[:len(ran)] = ran
        return Sample(self.request_index, self.tokens[:self.prompt_len], self.tokens[self.prompt_len:],
                      list(self.logprobs), self.finish_reason or "length", weight_version, routing=routing,
                      versions=list(self.versions), loss_mask=self.turns.mask(self.num_generated),
                      num_turns=max(self.turns.count, 1), num_tool_calls=self.turns.calls,
                      num_tool_errors=self.turns.errors, top_logprobs=list(self.top) if self.top else None)

    def add_tool_output(self, ids: list[int], version: int) -> None:
        """Append a tool's output: tokens the model did not sample (log-prob 0, loss mask 0); the next model turn
        starts after them."""
        self.turns.loss_mask += [1] * (self.num_generated - len(self.turns.loss_mask)) + [0] * len(ids)
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.turns.start = len(self.tokens)

    def restart(self) -> None:
        """Back to its prompt (blocks already released), the same random streams from their start: the sample is
        generated again (a stream's aborted partial rollout)."""
        del self.tokens[self.prompt_len:]
        self.logprobs, self.versions, self.finish_reason, self.routes, self.top = [], [], None, [], []
        self.turns = Turns()
        self.rngs = [random.Random(s) for s in self.seeds]

    def state(self) -> dict:
        """As plain data (JSON) for a checkpoint of a stream; only a sequence holding no blocks is saved. Its random
        streams are not: each sampled token drew one number from its stream, so the state is (seed, tokens)."""
        assert not self.block_table, "a sequence is saved only when it holds no blocks"
        return {"tokens": self.tokens, "prompt_len": self.prompt_len, "request_index": self.request_index,
                "max_new_tokens": self.max_new_tokens, "sample_indices": self.sample_indices, "seeds": self.seeds,
                "logprobs": self.logprobs, "versions": self.versions, "turns": asdict(self.turns)}

    @classmethod
    def from_state(cls, state: dict, sampling: SamplingParams, stop_ids: frozenset[int]) -> Sequence:
        seq = cls(state["tokens"][:state["prompt_len"]], state["request_index"], sampling, state["seeds"], stop_ids,
                  state["sample_indices"], state["max_new_tokens"])
        seq.tokens = list(state["tokens"])
        seq.logprobs, seq.versions = list(state["logprobs"]), list(state["versions"])
        seq.turns = Turns(**state["turns"])
        for rng in seq.rngs:
            for _ in range(seq.num_generated - seq.turns.tool_tokens):
                rng.random()
        return seq

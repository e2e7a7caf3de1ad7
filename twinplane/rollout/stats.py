"""What every rollout engine (the own one, the transformers fallback's, vLLM's) reports and hands back: its counters
since they were last read (`EngineStats`, with how rollouts in sequence and data-parallel engines combine) and the
handle of work that has already run (`Done`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the last `pop_metrics`."""

    steps: int = 0
    running_sum: int = 0  # running sequences summed over steps (occupancy)
    usage_peak: float = 0.0  # fraction of the pool's blocks in use, at the fullest step
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    graph_steps: int = 0  # decode steps run from the static buffers (replayed graphs on GPUs)
    ahead_steps: int = 0  # of those, launched before the step before them was read back (`run_ahead`)
    seconds: float = 0.0  # busy time (of the slowest engine, for data-parallel engines)
    # time blocked on the device reading graphed decode steps back (summed over data-parallel engines): with
    # steps run ahead, most of the busy time when the device is the bottleneck, little when the host is
    wait_seconds: float = 0.0
    seconds_min: float | None = None  # data-parallel engines: the least busy one's (their spread is load imbalance)

    # what adds up over rollouts one after the other and over data-parallel engines
    COUNTERS = ("steps", "running_sum", "preemptions", "prefill_tokens", "decode_tokens", "graph_steps",
                "ahead_steps", "wait_seconds")

    def __add__(self, later: EngineStats) -> EngineStats:
        """Two rollouts one after the other (DAPO's extra batches): everything adds up; the peak is the fuller."""
        lo = None if self.seconds_min is None and later.seconds_min is None else (
            (self.seconds_min or 0.0) + (later.seconds_min or 0.0))
        return EngineStats(**{f: getattr(self, f) + getattr(later, f) for f in (*self.COUNTERS, "seconds")},
                           usage_peak=max(self.usage_peak, later.usage_peak), seconds_min=lo)

    @classmethod
    def parallel(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """Data-parallel engines as one: counters add up, the peak is the fullest pool's, and the time is the
        slowest engine's (they run at once), so tokens/s is the rollout plane's throughput."""
        return cls(**{f: sum(getattr(p, f) for p in parts) for f in cls.COUNTERS},
                   usage_peak=max(p.usage_peak for p in parts), seconds=max(p.seconds for p in parts),
                   seconds_min=min(p.seconds for p in parts))

    def metrics(self) -> dict[str, float]:
        """Prefill and decode tokens/s are both over the busy time, as vLLM reports them: a step mixes the two."""
        if not self.steps:
            return {}
        busy = {} if self.seconds_min is None else {"rollout/engine_busy_s_max": self.seconds,
                                                    "rollout/engine_busy_s_min": self.seconds_min}
        return busy | {"rollout/kv_cache_usage_peak": self.usage_peak, "rollout/preemptions": self.preemptions,
                "rollout/running_seqs_mean": self.running_sum / self.steps, "rollout/engine_steps": self.steps,
                "rollout/engine_steps_graphed": self.graph_steps, "rollout/engine_steps_ahead": self.ahead_steps,
                "rollout/device_wait_s": self.wait_seconds,
                "perf/prefill_tokens_per_s": self.prefill_tokens / max(self.seconds, 1e-9),
                "perf/decode_tokens_per_s": self.decode_tokens / max(self.seconds, 1e-9)}


class Done:
    """Work that has already run, behind the async handle interface: `result()` is its value at once (a rollout's
    samples, a stream call's result), then `stats` the engine's counters for it."""

    def __init__(self, value, stats: EngineStats | None = None):
        self.value, self.stats = value, stats or EngineStats()

    def result(self):
        return self.value

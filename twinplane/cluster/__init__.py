"""Where the planes run: this process (`cluster.backend=local`) or Ray actors across devices and nodes."""

from __future__ import annotations

from twinplane.algos import Algorithm
from twinplane.cluster.planes import (
    LocalPlanes,
    Planes,
    WorkerError,
    build_algorithm,
    build_engine,
    build_rollout,
    critic_weights,
)
from twinplane.config import Config
from twinplane.model import Transformer
from twinplane.model.export import export_weights
from twinplane.tokenizer import Tokenizer


def build_planes(cfg: Config, model: Transformer, reference: Transformer | None, tokenizer: Tokenizer,
                 log=print, algo: Algorithm | None = None) -> Planes:
    """`model` and `reference` hold the starting weights (after any warm start or restore); `algo`: the run's
    algorithm (None: `build_algorithm(cfg)`)."""
    algo = algo or build_algorithm(cfg)
    total_steps = cfg.train.steps * cfg.train.mini_batches
    # the off-policy correction (algo.is_*) for an off-policy rollout: stale (asynchronous RL), or another engine's
    # numerics (vLLM, or algo.is_sync) once the trainer recomputes the old log-probs
    off_policy = cfg.cluster.max_staleness or cfg.algo.is_sync or cfg.rollout.backend == "vllm"
    tis_cap = cfg.algo.tis_cap if off_policy else None
    if cfg.cluster.backend == "local":
        return LocalPlanes.build(cfg, model, reference, tokenizer, total_steps, tis_cap, algo)
    from twinplane.cluster.ray_planes import RayPlanes  # Ray's presence is checked by `prepare.prepare`

    def cpu_state(m: Transformer) -> dict:
        return {n: t.cpu() for n, t in export_weights(m)}

    critic = {n: t.cpu() for n, t in critic_weights(cfg, model)} if algo.needs_critic else None
    return RayPlanes(cfg, model.config, tokenizer, cpu_state(model), reference and cpu_state(reference),
                     total_steps, tis_cap, log, critic)


__all__ = ["LocalPlanes", "Planes", "WorkerError", "build_algorithm", "build_engine", "build_planes", "build_rollout"]

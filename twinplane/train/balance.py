"""Dealing work to data-parallel workers by load: sequences to training ranks, requests to rollout engines."""

from __future__ import annotations


def assign_rows(loads: list[int], world: int, balance_counts: bool = True) -> list[list[int]]:
    """Indices of `loads` per worker, each list ascending: items dealt largest first to the worker with the
    least load so far (greedy LPT). `balance_counts` also caps each worker at len // world or one more items,
    so training ranks run (nearly) the same number of micro-batches."""
    cap = [len(loads) // world + (r < len(loads) % world) for r in range(world)] if balance_counts \
        else [len(loads)] * world
    total, rows = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        r = min((r for r in range(world) if len(rows[r]) < cap[r]), key=lambda r: (total[r], r))
        total[r] += loads[i]
        rows[r].append(i)
    return [sorted(r) for r in rows]

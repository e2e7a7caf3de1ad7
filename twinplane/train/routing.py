"""MoE routing in the training plane: the replay state for a forward, and a step's routing metrics.

Rollout routing replay (R3): the trainer and the reference run the experts the engine chose for each token
(recorded in `Batch.routing`) instead of their own top-k, so a near-tie that the two planes' kernels break
differently cannot send a token through different experts. The gate weights still come from the trainer's own
router (softmax at the replayed experts), so the router keeps its gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinplane.model import ModelConfig
from twinplane.model.moe import RoutingState, expert_loads, load_balancing_loss, routing_agreement
from twinplane.platform import runtime
from twinplane.train.batch import Batch


def token_order(batch: Batch, packed: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The engine's record [T, M, k] (None without one) and which tokens are real [T] (bool), in the order of a
    forward over `batch`: packed = the real tokens back to back (`AttentionMetadata.packed`), else `input_ids`
    flattened row-major with its padding."""
    valid = batch.attention_mask.bool()  # [N, P + R]
    rec = batch.routing
    if packed:
        return (None if rec is None else rec[valid]), valid[valid]
    return (None if rec is None else rec.reshape(-1, *rec.shape[2:])), valid.reshape(-1)


def routing_state(batch: Batch, replay: bool, packed: bool, keep_logits: bool = False) -> RoutingState | None:
    """The routing state for a forward over `batch` in the layout `packed` picks (see `token_order`). None for a
    dense model's batch (no record, nothing to keep)."""
    if batch.routing is None and not keep_logits:
        return None
    rec, _ = token_order(batch, packed)
    return RoutingState(replay=rec if replay else None, keep_logits=keep_logits)


class RoutingStats:
    """A training step's routing metrics, summed over its micro-batches (and data-parallel ranks):
    - moe/aux_loss: the load-balancing loss (token-weighted mean of the micro-batches' losses);
    - moe/load_imbalance: max over mean tokens per expert, in the worst sparse layer, over the step's tokens;
    - rollout/routing_agreement: fraction of (token, sparse layer) pairs whose experts in this forward have the
      engine's top-k set (1.0 under replay); moe/router_agreement: the same for the router's own top-k (what
      the agreement would be without replay)."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.cfg = cfg
        self.loads = torch.zeros(len(cfg.moe_layers), cfg.num_experts, device=device)
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)  # aux, agree, agree_own, counted, recorded

    def aux_loss(self, state: RoutingState, batch: Batch, share: float, packed: bool) -> torch.Tensor:
        """This micro-batch's aux loss (with grad), and accumulates the step's statistics; `share`: the
        micro-batch's fraction of the step's loss tokens (0 for FSDP's padding micro-batches); `packed`: the
        forward's layout (`token_order`)."""
        rec, valid = token_order(batch, packed)
        aux = load_balancing_loss([state.logits[m] for m in sorted(state.logits)], self.cfg.num_experts_per_tok,
                                  valid)
        if share == 0:
            return aux
        self.loads += expert_loads(state.used, self.cfg.num_experts, valid)
        self.sums[0] += share * float(aux.detach())
        if rec is not None:
            used = torch.stack([state.used[m] for m in sorted(state.used)], 1)
            agree, counted = routing_agreement(used, rec)
            own, _ = routing_agreement(state.indices(), rec)
            self.sums[1:] += torch.tensor([agree, own, counted, 1], dtype=torch.float64, device=self.sums.device)
        return aux

    def metrics(self, group=None) -> dict[str, float]:
        loads, sums = self.loads, self.sums
        if group is not None:
            loads, sums = (runtime.collective_tensor(t, group) for t in (loads, sums))
            for t in (loads, sums):
                dist.all_reduce(t, group=group)
        imbalance = (loads.max(1).values / loads.mean(1).clamp(min=1e-9)).max()
        out = {"moe/aux_loss": float(sums[0]), "moe/load_imbalance": float(imbalance)}
        if sums[4] > 0:
            out |= {"rollout/routing_agreement": float(sums[1] / sums[3].clamp(min=1)),
                    "moe/router_agreement": float(sums[2] / sums[3].clamp(min=1))}
        return out

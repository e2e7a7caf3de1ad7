"""Per-token log-probs (and entropy) of a batch's response tokens: the trainer's and the reference's scoring."""

from __future__ import annotations

import torch

from twinplane.model import Transformer
from twinplane.model.moe import RoutingState
from twinplane.rollout.sampling import policy_logprobs
from twinplane.train import fsdp
from twinplane.train.batch import Batch
from twinplane.train.routing import routing_state


def response_logprobs(model: Transformer, batch: Batch, temperature: float, with_entropy: bool = False,
                      routing: RoutingState | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) [N, R] for the response tokens, and the policy's entropy at each position [N, R].
    Logits are computed only over the response region (column P-1 onwards). `routing`: MoE record/replay state
    (see `routing_state`)."""
    P = batch.prompt_len
    logits = model(batch.input_ids, batch.attention_mask, logits_start=P - 1, routing=routing)[:, :-1]  # [N, R, V]
    lp = policy_logprobs(logits, temperature)  # same function the engine samples from
    token_lp = lp.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(-1) if with_entropy else None
    return token_lp, entropy


@torch.no_grad()
def score(model: Transformer, batch: Batch, temperature: float, micro_batch_size: int, group=None,
          max_tokens: int = 0, replay: bool = False) -> torch.Tensor:
    """Log-probs [N, R] without grad, micro-batched (reference log-probs, recomputed old log-probs).

    With an FSDP `group`, every rank runs as many forwards (padding micro-batches, weight 0, are scored and
    dropped): each forward all-gathers the parameters, so a rank that stopped early would hang the others."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
    i = 0
    for mb, weight in fsdp.micro_batches(batch, micro_batch_size, group, max_tokens):
        lp, _ = response_logprobs(model, mb, temperature, routing=routing_state(mb, replay))
        if weight:  # real micro-batches come first, in row order
            out[i:i + len(mb), :lp.shape[1]] = lp * mb.response_mask
            i += len(mb)
    return out


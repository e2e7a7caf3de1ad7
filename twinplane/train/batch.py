"""The training batch: prompts left-padded to P columns, responses right-padded to R columns.

That layout puts every response token at column P + j in every row, so per-token tensors ([N, R]:
log-probs, advantages, masks) line up with the logits of one slice, `logits[:, P-1 : P+R-1]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from twinplane.platform import runtime


def pad_rows(rows: Sequence[Sequence], value, dtype, left: bool = False, width: int | None = None) -> torch.Tensor:
    """[len(rows), width] of `value`, each row's items at its start (or end: `left`). One tensor from all items and
    one masked write, not one write per row (a row of a few tokens costs about as much as its whole copy)."""
    lens = [len(r) for r in rows]
    width = max(lens, default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=dtype)
    items = [x for r in rows for x in r]
    if items:
        cols, n = torch.arange(width), torch.tensor(lens)[:, None]
        out[cols >= width - n if left else cols < n] = torch.tensor(items, dtype=dtype)  # (row-major: row by row)
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, P + R]
    attention_mask: torch.Tensor  # [N, P + R], 1 = token
    response_mask: torch.Tensor  # [N, R], 1 = token that counts in the loss
    prompt_len: int  # P
    # per-token fields [N, R], filled in as the step goes
    rollout_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # value targets (PPO critic)
    old_values: torch.Tensor | None = None  # the critic's values at rollout time (value-loss clipping)
    is_weights: torch.Tensor | None = None  # the off-policy correction's importance weights (the trainer's)
    # MoE: the engine's expert ids per token [N, P + R, M, k] (int16, -1 = none, e.g. padding), for replay
    routing: torch.Tensor | None = None
    # pi_old is the trainer's current policy (one update per rollout batch): the trainer takes the old log-probs
    # from its own training forward instead of a separate scoring pass (`Trainer.train_step`)
    old_is_current: bool = False

    @classmethod
    def collate(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                rollout_logprobs: Sequence[Sequence[float]] | None = None,
                loss_masks: Sequence[Sequence[int]] | None = None,
                routing: Sequence[torch.Tensor] | None = None) -> Batch:
        """`loss_masks` (per response token, 1 = trained on) excludes e.g. tool outputs from the loss while
        keeping them in the context the model attends to. `routing`: per sample [len(prompt + response), M, k]
        expert ids (`Sample.routing`), laid out like `input_ids`."""
        p = pad_rows(prompts, pad_id, torch.long, left=True)
        r = pad_rows(responses, pad_id, torch.long)
        pm = pad_rows([[1] * len(x) for x in prompts], 0, torch.long, left=True)
        rm = pad_rows([[1] * len(x) for x in responses], 0, torch.long)
        lm = rm.float() if loss_masks is None else pad_rows(loss_masks, 0, torch.float32)
        lp = None if rollout_logprobs is None else pad_rows(rollout_logprobs, 0.0, torch.float32)
        batch = cls(torch.cat([p, r], 1), torch.cat([pm, rm], 1), lm, p.shape[1], rollout_logprobs=lp)
        if routing is not None:
            P, R = p.shape[1], r.shape[1]
            batch.routing = torch.full((len(prompts), P + R, *routing[0].shape[1:]), -1, dtype=torch.int16)
            for i, (x, y) in enumerate(zip(prompts, responses, strict=True)):
                batch.routing[i, P - len(x):P + len(y)] = routing[i]
        return batch

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_ids(self) -> torch.Tensor:  # [N, R]
        return self.input_ids[:, self.prompt_len:]

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def _map(self, fn_tokens, fn_resp) -> Batch:
        """Apply fn_tokens to [N, P+R] tensors and fn_resp to [N, R] tensors."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = fn_tokens(v) if f.name in ("input_ids", "attention_mask", "routing") else fn_resp(v)
            out[f.name] = v
        return Batch(**out)

    def to(self, device: torch.device) -> Batch:
        """The batch on `device`; host tensors reach a GPU without waiting for its queue (`runtime.to_device`)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return runtime.to_device(t, device)

        return self._map(move, move)

    def select(self, rows: slice | torch.Tensor, attention_mask: torch.Tensor | None = None) -> Batch:
        """Rows of the batch, with columns that are padding in every selected row cut off, found in
        `attention_mask` when given (a host copy of a device batch's: no wait for the device)."""
        P = self.prompt_len
        mask = (self.attention_mask if attention_mask is None else attention_mask)[rows]
        prompt_cols = mask[:, :P].any(0)
        cut = int(prompt_cols.long().argmax()) if prompt_cols.any() else P - 1
        cut = min(cut, P - 1)  # keep the last prompt column: its logits predict token 0
        resp_cols = mask[:, P:].any(0)
        keep_r = int(resp_cols.nonzero().max()) + 1 if resp_cols.any() else 1
        sub = self._map(lambda t: t[rows][:, cut:P + keep_r], lambda t: t[rows][:, :keep_r])
        return replace(sub, prompt_len=P - cut)

    def split(self, size: int) -> list[Batch]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

"""Per-token log-probs (and entropy) of a batch's response tokens: the trainer's, the reference's and the SFT
warm start's scoring.

Two layouts, one result:
- packed (default, `train.packing`): the rows' real tokens back to back in one row [1, T] with varlen attention
  (`AttentionMetadata.packed`), so cost follows real tokens, not rows x the longest row; with `share_prompts`
  (`train.share_prompts`), rows with the same prompt (a GRPO group's n samples) share one copy of it: the row holds
  the prompt once, then each response, attending to it (`AttentionMetadata.prefix`), so a prompt is computed once
  per micro-batch instead of n times, in forward and backward;
- padded: the batch's [N, P + R] rows as they are.
Either way only the hidden states that predict a response token go through the LM head, in chunks of
`chunk_tokens` (`token_logprobs`), and the result is scattered back to [N, R], aligned with `response_mask`.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from twinplane.model import AttentionMetadata, Transformer
from twinplane.model.attention import torch_varlen_agrees
from twinplane.model.moe import RoutingState
from twinplane.platform import backends, runtime
from twinplane.train import fsdp
from twinplane.train.batch import Batch
from twinplane.train.chunked_logprobs import token_logprobs
from twinplane.train.routing import routing_state

DEFAULT_CHUNK_TOKENS = 512


def response_logprobs(model: Transformer, batch: Batch, temperature: float, with_entropy: bool = False,
                      packed: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      routing: RoutingState | None = None, share_prompts: bool = False,
                      layout: PackedLayout | None = None,
                      rope_long: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) [N, R] for the response tokens, and the policy's entropy at each position [N, R]
    (None unless `with_entropy`); 0 at padding. Differentiable; no [N, R, V] tensor is ever built. `routing`: MoE
    record/replay state in this call's token order (`routing_state(batch, replay, packed)`). Packed, the row is
    `layout` when the caller already built it, else `packed_layout(batch, share_prompts, routing)`. `rope_long`:
    a longrope model's factor set per row (None: as the rollout engine picks them, see `longrope_logprobs`)."""
    limit = getattr(model, "longrope_limit", None)
    if limit is not None and rope_long is None:
        totals = row_lengths_past(batch, layout if packed else None, limit)
        if totals is not None:
            return longrope_logprobs(model, batch, temperature, with_entropy, packed, chunk_tokens, routing, totals)
    P = batch.prompt_len
    valid = batch.attention_mask.bool()  # [N, P + R]
    resp = valid[:, P:]  # [N, R] real response tokens (tool outputs included: the loss mask is the caller's)
    if packed:  # from the host layout: nothing here reads the device (each read would wait for its queue)
        dev = batch.input_ids.device
        lengths, prefix, index, rows, where = layout or packed_layout(batch, share_prompts, routing)
        meta = AttentionMetadata.packed(lengths, dev, window=model.config.sliding_window, prefix=prefix,
                                        backend=backends.varlen_backend(dev, _compute_dtype(model), prefix is not None,
                                                                        model.config.head_dim,
                                                                        model.config.sliding_window is not None,
                                                                        torch_varlen_agrees))
        if rope_long is not None:  # (one sequence per row: `longrope_logprobs` never shares prompts)
            flags = torch.tensor(rope_long).repeat_interleave(torch.tensor(lengths))
            meta.rope_long = runtime.to_device(flags, dev)[None]
        index, rows, where = (runtime.to_device(t, dev) for t in (index, rows, where))
        ids, mask = batch.input_ids.flatten()[index][None], None  # [1, T]
        targets = batch.response_ids.flatten()[where]  # [M]
    else:
        N, W = valid.shape
        rows = (torch.arange(N, device=valid.device)[:, None] * W + P - 1
                + torch.arange(W - P, device=valid.device))[resp]  # [M] in the flattened [N * W] hidden states
        ids, mask, meta, targets, where = batch.input_ids, batch.attention_mask, None, batch.response_ids[resp], None
        if rope_long is not None:
            meta = model.dense_metadata(ids, mask)
            meta.rope_long = runtime.to_device(torch.tensor(rope_long), valid.device)[:, None].expand(N, W)

    def head(h: torch.Tensor, weight: torch.Tensor):
        return token_logprobs(h.flatten(0, 1)[rows], weight, targets, temperature, chunk_tokens, with_entropy,
                              softcap=model.config.final_logit_softcapping)

    lp, ent = model(ids, mask, meta=meta, head=head, routing=routing)

    def placed(x: torch.Tensor) -> torch.Tensor:  # [M] -> [N, R], 0 at padding (fp32; fp64 for fp64 models)
        zeros = torch.zeros(resp.shape, dtype=x.dtype, device=resp.device)
        return zeros.masked_scatter(resp, x) if where is None else zeros.flatten().index_copy(0, where, x).view_as(resp)

    return placed(lp), None if ent is None else placed(ent)


def row_lengths_past(batch: Batch, layout: PackedLayout | None, limit: int) -> list[int] | None:
    """Each row's prompt + response length when some row is longer than `limit`, else None. Read from a packed
    `layout` where there is one (host data: no wait for the device); from the mask otherwise, or when prompts
    are shared and some row does pass (rare: then the rows are laid out again anyway)."""
    if layout is None:
        totals = batch.attention_mask.sum(1).tolist()
    elif layout.prefix is None:
        totals = layout.lengths
    else:  # a response's total is its prompt's length and its own
        totals = [layout.lengths[p] + n if p >= 0 else n for n, p in zip(layout.lengths, layout.prefix, strict=True)]
        if max(totals, default=0) > limit:
            totals = batch.attention_mask.sum(1).tolist()
    return list(totals) if max(totals, default=0) > limit else None


def longrope_logprobs(model: Transformer, batch: Batch, temperature: float, with_entropy: bool, packed: bool,
                      chunk_tokens: int, routing: RoutingState | None,
                      totals: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of a longrope model whose sequences cross its pretraining length, as the rollout
    engine (and transformers' `generate`) computed them: a token predicted from at most `limit` tokens with every
    position rotated by the short factors, one predicted from more with every position by the long ones. So the
    rows past the limit run twice: with the long set (the whole batch, each row with its own set), and with the
    short set (those rows alone), which gives their tokens up to the limit. Prompts are not shared here: a
    prompt's k/v differ between its rows' sets."""
    limit = model.longrope_limit
    if routing is not None:
        raise ValueError("MoE routing replay of a longrope model's sequences past its pretraining length: each is "
                         "computed with two factor sets, and the record holds one")
    long = [n > limit for n in totals]
    lp, ent = response_logprobs(model, batch, temperature, with_entropy, packed, chunk_tokens, rope_long=long)
    idx = [i for i, x in enumerate(long) if x]
    sub = batch.select(torch.tensor(idx))
    short = response_logprobs(model, sub, temperature, with_entropy, packed, chunk_tokens, rope_long=[False] * len(idx))
    dev, R = lp.device, lp.shape[1]
    rows = runtime.to_device(torch.tensor(idx), dev)
    context = sub.attention_mask[:, :sub.prompt_len].sum(1)[:, None] + torch.arange(R, device=dev)  # [C, R]
    within = context <= limit  # tokens before each response token: at most the limit -> the short set's value

    def merged(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a [N, R] (long), b [C, <= R] (short)
        b = torch.nn.functional.pad(b, (0, R - b.shape[1]))
        return a.index_copy(0, rows, torch.where(within, b, a[rows]))

    return merged(lp, short[0]), None if ent is None else merged(ent, short[1])


class PackedLayout(NamedTuple):
    """The packed row of a batch: what `AttentionMetadata.packed` takes, and where its tokens come from."""

    lengths: list[int]  # sequences in the row
    prefix: list[int] | None  # per sequence, the one it continues (-1 = none); None = no shared prompts
    index: torch.Tensor  # [T] position of each row token in input_ids.flatten()
    rows: torch.Tensor  # [M] the row position whose hidden state predicts each response token ([N, R] order)
    where: torch.Tensor  # [M] each response token's position in response_ids.flatten() ([N, R] order)


def packed_layout(batch: Batch, share_prompts: bool = False, routing: RoutingState | None = None) -> PackedLayout:
    """`shared_layout` with `share_prompts`, else `row_layout`. MoE routing record/replay (`routing`) keeps one
    prompt copy per row: its record is laid out that way."""
    if bool((batch.attention_mask[:, :batch.prompt_len].sum(1) == 0).any()):
        raise ValueError("every row needs at least one prompt token (its last one predicts the response)")
    lengths, prefix, index, rows = shared_layout(batch) if share_prompts and routing is None else row_layout(batch)
    where = batch.attention_mask[:, batch.prompt_len:].bool().flatten().nonzero().squeeze(1)
    return PackedLayout(lengths, prefix, index, rows, where)


class MicroBatch(NamedTuple):
    rows: torch.Tensor  # its rows of the batch (host)
    batch: Batch  # on the device
    weight: float  # its loss weight (0: a padding micro-batch, see `fsdp.micro_batch_rows`)
    layout: PackedLayout | None  # its packed row (None = padded)
    tokens: int  # its real tokens


def device_micro_batches(batch: Batch, device: torch.device, size: int, group=None, max_tokens: int = 0,
                         packed: bool = True, share_prompts: bool = False) -> list[MicroBatch]:
    """`batch`'s micro-batches (`fsdp.micro_batch_rows`) on `device`, planned on the host: choosing rows, trimming
    columns and laying out packed rows read token ids and masks, which on a GPU would wait for the device at each
    step; the micro-batches are then cut and copied without reading anything back. `share_prompts` as
    `packed_layout` (callers pass False where MoE routing is recorded or replayed)."""
    cpu = torch.device("cpu")
    plan = Batch(batch.input_ids.to(cpu), batch.attention_mask.to(cpu), batch.response_mask.to(cpu),
                 batch.prompt_len)  # what planning reads (a no-op for a batch built on the host)
    out = []
    for rows, weight in fsdp.micro_batch_rows(plan, size, group, max_tokens, packed):
        mb = plan.select(rows)
        layout = packed_layout(mb, share_prompts) if packed else None
        out.append(MicroBatch(rows, batch.select(rows, plan.attention_mask).to(device), weight, layout,
                              int(mb.attention_mask.sum())))
    return out


def row_layout(batch: Batch) -> tuple[list[int], None, torch.Tensor, torch.Tensor]:
    """Packed, one copy of everything: `PackedLayout`'s first four fields."""
    P, valid = batch.prompt_len, batch.attention_mask.bool()
    packed_index = valid.flatten().long().cumsum(0).view(valid.shape) - 1  # [N, P + R] position in the row
    rows = packed_index[:, P:][valid[:, P:]] - 1  # [M]
    return valid.sum(1).tolist(), None, valid.flatten().nonzero().squeeze(1), rows


def shared_layout(batch: Batch) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Packed with shared prompts: each distinct prompt once (in order of first appearance), followed by the
    responses of its rows; returns what `row_layout` does, with each response's prefix (its prompt's sequence). A
    row's first response token is predicted by its prompt's last token, the others by its own previous one."""
    P, W = batch.prompt_len, batch.input_ids.shape[1]
    prompt_lens, groups = prompt_groups(batch)
    resp_lens = batch.attention_mask[:, P:].sum(1).tolist()
    lengths, prefix, index, rows = [], [], [], []
    start = 0  # row position of the next sequence
    for members in groups:
        i0, n = members[0], prompt_lens[members[0]]
        parent, last_prompt = len(lengths), start + n - 1
        lengths.append(n)
        prefix.append(-1)
        index.append(torch.arange(i0 * W + P - n, i0 * W + P))
        start += n
        for i in members:
            r = resp_lens[i]
            if r:
                lengths.append(r)
                prefix.append(parent)
                index.append(torch.arange(i * W + P, i * W + P + r))
                rows.append((i, torch.cat([torch.tensor([last_prompt]), torch.arange(start, start + r - 1)])))
                start += r
    rows.sort(key=lambda x: x[0])  # [N, R] row-major order, as the targets
    predictors = torch.cat([r for _, r in rows]) if rows else torch.zeros(0, dtype=torch.long)
    return lengths, prefix, torch.cat(index), predictors


def prompt_groups(batch: Batch) -> tuple[list[int], list[list[int]]]:
    """Each row's prompt length, and the rows of each distinct prompt (equal tokens), in order of first appearance."""
    P = batch.prompt_len
    prompt_lens = batch.attention_mask[:, :P].sum(1).tolist()
    ids = batch.input_ids.cpu()
    groups: dict[bytes, list[int]] = {}
    for i, n in enumerate(prompt_lens):
        groups.setdefault(ids[i, P - n:P].numpy().tobytes(), []).append(i)
    return prompt_lens, list(groups.values())


def _compute_dtype(model: Transformer) -> torch.dtype:
    dev = model.output_weight().device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else model.output_weight().dtype


@torch.no_grad()
def score(model: Transformer, batch: Batch, temperature: float, micro_batch_size: int, group=None,
          max_tokens: int = 0, packed: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
          precision: runtime.Precision | None = None, replay: bool = False,
          share_prompts: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """Log-probs [N, R] without grad, micro-batched (reference log-probs, recomputed old log-probs), computed on
    `device` (default: the batch's), where the result is.

    With an FSDP `group`, every rank runs as many forwards (padding micro-batches, weight 0, are scored and
    dropped): each forward all-gathers the parameters, so a rank that stopped early would hang the others."""
    dev = device or batch.input_ids.device
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=dev)
    share = share_prompts and batch.routing is None  # (see packed_layout)
    for rows, mb, weight, layout, _ in device_micro_batches(batch, dev, micro_batch_size, group, max_tokens, packed,
                                                            share):
        with runtime.autocast(precision, dev) if precision is not None else contextlib.nullcontext():
            lp, _ = response_logprobs(model, mb, temperature, packed=packed, chunk_tokens=chunk_tokens,
                                      routing=routing_state(mb, replay, packed), layout=layout)
        if weight:
            out[runtime.to_device(rows, dev), :lp.shape[1]] = lp * mb.response_mask
    return out

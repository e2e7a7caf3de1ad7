"""Data parallelism for the training plane: FSDP2 sharding, the per-rank share of a batch, full-weight gathering.

Each rank trains on its rows of the global batch; `Trainer(..., group=...)` normalises every rank's loss by the
*global* response-token count and FSDP reduces gradients by SUM (not its default mean over ranks), so the sharded
step takes the same gradient as one process on the whole batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from twinplane.model import Transformer
from twinplane.model.export import export_weights
from twinplane.model.hf import HFCausalLM
from twinplane.model.precision import Fp32Params
from twinplane.platform import runtime
from twinplane.train.balance import assign_rows
from twinplane.train.batch import Batch


def shard_model(model: Transformer, mesh=None, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, compute_dtype: str = "auto") -> Transformer:
    """FSDP2 in place: one unit per decoder block (a transformers model's: `twinplane.model.hf_config.decoder_layers`),
    then the root (embedding, final norm, LM head, so tied embeddings stay one parameter); before them each module
    holding fp32 parameters (`precision.Fp32Params`: DeepSeek-V3's routers), not cast. The default policy is
    `runtime.train_precision` (`train.compute_dtype`), the one a single rank uses too: on GPU bf16 compute over
    `model.dtype` master weights with fp32 gradient reductions; on CPU the weights' dtype throughout. `mesh` None
    is the default process group."""
    if mp_policy is None:
        w = model.output_weight()
        mp_policy = mixed_precision(runtime.train_precision(w.device, w.dtype, compute_dtype))
    fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for m in model.modules():  # units of their own, gathered in fp32 (a unit's parameters share one dtype)
        if isinstance(m, Fp32Params):
            fully_shard(m, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    for layer in model.layers if isinstance(model, HFCausalLM) else model.model.layers:  # (hf: `decoder_layers`)
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # the loss is already a global token mean: sum the ranks' gradients
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no AVG/PREMUL_SUM
    return model


def shard_over(model: Transformer, group, compute_dtype: str = "auto") -> Transformer:
    """`shard_model` over a process group's ranks; `group` None (one rank) keeps the plain model, as one process."""
    if group is None:
        return model
    from torch.distributed.device_mesh import DeviceMesh

    device = model.output_weight().device
    return shard_model(model, mesh=DeviceMesh.from_group(group, device.type), compute_dtype=compute_dtype)


def mixed_precision(p: runtime.Precision) -> MixedPrecisionPolicy:
    """FSDP2's form of a precision policy: gathered params cast to the compute dtype, grads reduced in fp32."""
    if not p.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=p.compute, reduce_dtype=p.reduce)


def split_for_rank(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's rows: sequences dealt longest first to the rank with the fewest tokens so far, each rank
    holding len(batch) // world or one more rows (so micro-batch counts match as closely as possible)."""
    if len(batch) < world:
        raise ValueError(f"batch of {len(batch)} rows cannot feed {world} ranks")
    rows = assign_rows(batch.attention_mask.sum(1).tolist(), world)
    return batch.select(torch.tensor(rows[rank]))


def all_reduce(x: float | int, group=None, op=dist.ReduceOp.SUM) -> float:
    """`x` reduced over `group`'s ranks in fp64 (token counts stay exact), on the device its backend takes."""
    t = runtime.collective_tensor(torch.tensor(float(x), dtype=torch.float64), group)
    dist.all_reduce(t, op=op, group=group)
    return float(t)


def row_groups(batch: Batch, size: int, max_tokens: int = 0) -> list[slice]:
    """Consecutive row ranges, one per micro-batch: at most `size` rows each and, with `max_tokens` > 0, at most
    `max_tokens` padded tokens (rows x the width `Batch.select` trims the group to); a lone row may exceed it."""
    if max_tokens <= 0:
        return [slice(i, min(i + size, len(batch))) for i in range(0, len(batch), size)]
    P = batch.prompt_len
    prompt_valid = batch.attention_mask[:, :P].bool()
    resp_valid = batch.attention_mask[:, P:].bool()
    # the columns `select` keeps for each row alone: prompt from its first token (at least the last column),
    # response up to its last token (at least one column); a group's width is the sum of the two maxima
    cols = torch.arange(batch.attention_mask.shape[1] - P, device=resp_valid.device)
    prompt_w = (P - prompt_valid.long().argmax(1)).where(prompt_valid.any(1), 1).clamp(min=1).tolist()
    resp_w = ((cols + 1) * resp_valid).amax(1).clamp(min=1).tolist() if resp_valid.shape[1] else [1] * len(batch)
    groups, start, pw, rw = [], 0, 0, 0
    for i in range(len(batch)):
        npw, nrw = max(pw, prompt_w[i]), max(rw, resp_w[i])
        if i > start and (i - start == size or (i + 1 - start) * (npw + nrw) > max_tokens):
            groups.append(slice(start, i))
            start, npw, nrw = i, prompt_w[i], resp_w[i]
        pw, rw = npw, nrw
    if len(batch):
        groups.append(slice(start, len(batch)))
    return groups


def packed_groups(batch: Batch, size: int, max_tokens: int = 0) -> list[list[int]]:
    """Row indices (ascending) per packed micro-batch, balanced by real tokens: the fewest micro-batches that hold
    at most `size` rows and, with `max_tokens` > 0, at most `max_tokens` real tokens each (a lone row may exceed
    it), rows dealt longest first to the micro-batch with the fewest tokens so far (`assign_rows`)."""
    lens = batch.attention_mask.sum(1).tolist()
    n = len(lens)
    if n == 0:
        return []
    k = max(math.ceil(n / size), math.ceil(sum(lens) / max_tokens) if max_tokens > 0 else 1)
    while True:
        groups = [g for g in assign_rows(lens, k) if g]
        fits = max_tokens <= 0 or all(len(g) == 1 or sum(lens[i] for i in g) <= max_tokens for g in groups)
        if fits or k >= n:
            return groups
        k += 1


def micro_batch_rows(batch: Batch, size: int, group=None, max_tokens: int = 0,
                     packed: bool = False) -> list[tuple[torch.Tensor, float]]:
    """(row indices, loss weight) per micro-batch: `packed_groups` when `packed`, else consecutive `row_groups`;
    as many on every rank: FSDP runs collectives in each forward and backward, so a rank with fewer micro-batches
    repeats its first row with weight 0 rather than leave the others waiting."""
    if packed:
        rows = [torch.tensor(g) for g in packed_groups(batch, size, max_tokens)]
    else:
        rows = [torch.arange(s.start, s.stop) for s in row_groups(batch, size, max_tokens)]
    out = [(r, 1.0) for r in rows]
    if group is not None:
        n = int(all_reduce(len(out), group, dist.ReduceOp.MAX))
        out += [(torch.tensor([0]), 0.0)] * (n - len(out))
    return out


def micro_batches(batch: Batch, size: int, group=None, max_tokens: int = 0,
                  packed: bool = False) -> list[tuple[Batch, float]]:
    """(micro-batch, loss weight) pairs, see `micro_batch_rows`."""
    return [(batch.select(r), w) for r, w in micro_batch_rows(batch, size, group, max_tokens, packed)]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors by parameter name, the Hugging Face names FSDP2 keeps: for weight sync and
    checkpoints. A collective: every rank must call it."""
    return dict(export_weights(model))


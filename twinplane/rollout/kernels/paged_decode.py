"""Paged decode attention in Triton: one query token per sequence against its blocks of the KV pool, read in place.

Layout (twinplane.rollout.kv_cache): one layer's pool is [N, block_size, H_kv, D] for keys and for values; a
sequence's blocks are the first entries of its row of `block_tables` [B, M], and its keys are its first
`context_lens[b]` tokens (the last written by this forward), or with a sliding window the last `window` of them.

Stage 1 runs one program per (sequence, KV head, split): the G = H / H_kv query heads that share the KV head are
the rows of one tile (padded to 16, the smallest `tl.dot`), so each key and value is read once per KV head and
scored against all G queries with one matrix product per BLOCK_N tokens; online softmax in fp32. A split is a
contiguous range of the sequence's tokens (whole tiles). With one split the program writes the output; with
several, each writes its normalised partial output and log-sum-exp, and stage 2 (one program per sequence and
KV head, its G rows again) merges them. Split-KV keeps the GPU busy when batch x KV heads is small and contexts
are long.

Graph capture: the split count is a host integer from the batch size and the longest possible context (the
static decode's table width), so a captured bucket always runs the split count it was captured with; tokens past
a sequence's context are masked on the device, and splits that hold none write an empty partial (lse = -inf).
The layout follows SGLang's grouped decode kernels (stage 1 / stage 2) and vLLM's unified Triton attention
(per-token block-table lookups, so any block size works).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from twinplane.model.attention import capped_attention

LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))  # scores run in log2 units (exp2)
MIN_SPLIT_TOKENS = 64  # a split reads at least this many tokens (fewer: the merge costs more than it saves)
MAX_SPLITS = 16
PROGRAMS_PER_SM = 2  # stage 1 aims at this many programs per streaming multiprocessor (compute unit on AMD)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on CPU: a few splits, as on a small GPU


def num_splits(batch: int, kv_heads: int, tokens: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) for a decode group of `batch` sequences of up to `tokens` keys: enough
    programs for PROGRAMS_PER_SM per SM, each split at least MIN_SPLIT_TOKENS long, at most MAX_SPLITS."""
    want = -(-PROGRAMS_PER_SM * _sm_count(torch.device(device)) // max(batch * kv_heads, 1))
    return max(1, min(want, MAX_SPLITS, -(-tokens // MIN_SPLIT_TOKENS)))


@triton.jit
def _decode_split(Q, K, V, Tables, Lens, Out, PartOut, PartLse, Sinks, scale, softcap, num_splits,
                  stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh, stride_tb,
                  stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, WINDOW: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
                  SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(Lens + b)
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    else:
        lo = ctx * 0
    per_split = ((ctx - lo + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole tiles
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    rows = tl.arange(0, BLOCK_H)  # the KV head's query heads
    heads = kv_head * G + rows
    row_ok = rows < G
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if F32_DOT:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 units)
    total = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = Tables + b.to(tl.int64) * stride_tb
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        ok = pos < end
        block = tl.load(table + pos // BS, mask=ok, other=0).to(tl.int64)
        offset = pos % BS
        k = tl.load(K + block[None, :] * stride_kn + offset[None, :] * stride_kt + kv_head * stride_kh
                    + dims[:, None], mask=ok[None, :] & dim_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if F32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if SOFTCAP:  # (scale: natural units here; tanh from exp, which every backend and the interpreter have)
            s = softcap * LOG2E * (1.0 - 2.0 / (tl.exp(2.0 * s * scale / softcap) + 1.0))
        else:  # (scale: log2 units)
            s = s * scale
        s = tl.where(ok[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None] * stride_vn + offset[:, None] * stride_vt + kv_head * stride_vh
                    + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if ONE_SPLIT:  # (split 0 always holds the query's own token: total > 0)
        if SINKS:  # a logit per head in the denominator only
            total += tl.exp2(tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E - m)
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 (acc / total[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        some = total > 0  # an empty split (a short sequence in a batch sized for long ones)
        safe = tl.where(some, total, 1.0)
        part = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(PartOut + part[:, None] + dims[None, :], acc / safe[:, None], mask=out_mask)
        tl.store(PartLse + b * stride_lb + heads * stride_lh + split,
                 tl.where(some, m + tl.log2(safe), float("-inf")), mask=row_ok)


@triton.jit
def _decode_merge(PartOut, PartLse, Out, Sinks, num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * G + rows
    row_ok = rows < G
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims[None, :] < D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(0, num_splits):  # split 0 is never empty: m is finite from the first one on
        lse = tl.load(PartLse + b * stride_lb + heads * stride_lh + split, mask=row_ok, other=0.0)
        part = tl.load(PartOut + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + dims[None, :],
                       mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha, w = tl.exp2(m - m_new), tl.exp2(lse - m_new)
        total = total * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * part
        m = m_new
    if SINKS:
        total += tl.exp2(tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E - m)
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             (acc / total[:, None]).to(Out.dtype.element_ty), mask=mask)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, window: int | None = None, max_context: int | None = None,
                 splits: int | None = None, block_n: int = 32, num_warps: int = 4, scale: float | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at position context_lens - 1), one layer's k/v_cache
    [N, block_size, H_kv, D], block_tables [B, M] int32, context_lens [B] int32 -> [B, H, D] in q's dtype.

    `max_context`: the most keys a sequence may have (default: the table width), which with the batch size sets
    the split count (`num_splits`) unless `splits` is given; `block_n` (tokens per tile, >= 16) and `num_warps`
    tune stage 1's launch. Softmax `scale` (None: 1 / sqrt(D), as SDPA's default); `softcap`: scores tanh
    soft-capped (Gemma 2); `sinks` [H]: a logit per head that joins the softmax and takes no value (GPT-OSS).
    The products run in the inputs' dtype with fp32 accumulation (bf16/fp16 on tensor cores), and in exact fp32
    for fp32 inputs and in Triton's CPU interpreter (whose `tl.dot` multiplies 16-bit floats as raw bits)."""
    B, H, D = q.shape
    _, bs, H_kv, _ = k_cache.shape
    G = H // H_kv
    q, block_tables, context_lens = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, block_tables,
                                                                                          context_lens))
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    tokens = min(max_context or block_tables.shape[1] * bs, window or 1 << 62)
    S = splits or num_splits(B, H_kv, tokens, q.device)
    block_d, block_h = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(G))
    part_out = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device) if S > 1 else out
    part_lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if S > 1 else out
    hip = torch.version.hip is not None and q.device.type == "cuda"
    # (scores in log2 units: the scale folds log2(e) in, except under a soft-cap, which takes natural units)
    if softcap:
        sm_scale = 1 / math.sqrt(D) if scale is None else scale
    else:
        sm_scale = math.log2(math.e) / math.sqrt(D) if scale is None else math.log2(math.e) * scale
    _decode_split[(B, H_kv, S)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, out if sinks is None else sinks,
        sm_scale, softcap or 1.0, S, q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), *(part_out.stride()[:3] if S > 1 else (0, 0, 0)),
        *(part_lse.stride()[:2] if S > 1 else (0, 0)),
        G=G, D=D, BS=bs, WINDOW=window or 0, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, ONE_SPLIT=S == 1,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, SOFTCAP=bool(softcap), SINKS=sinks is not None,
        num_warps=num_warps, num_stages=1 if hip else 2)
    if S > 1:
        _decode_merge[(B, H_kv)](part_out, part_lse, out, out if sinks is None else sinks, S,
                                 *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), G=G,
                                 D=D, BLOCK_H=block_h, BLOCK_D=block_d, SINKS=sinks is not None, num_warps=4)
    return out


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, window: int | None = None, scale: float | None = None,
                       softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: every table slot gathered, masked to each sequence's keys, SDPA. Same arguments and
    result as `paged_decode`."""
    B, H, D = q.shape
    _, bs, H_kv, _ = k_cache.shape
    width = block_tables.shape[1] * bs
    slots = (block_tables.long()[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)  # [B, width]
    keys, vals = (c.flatten(0, 1)[slots].transpose(1, 2) for c in (k_cache, v_cache))  # [B, H_kv, width, D]
    pos, ctx = torch.arange(width, device=q.device)[None], context_lens.long()[:, None]
    mask = pos < ctx
    if window is not None:
        mask &= (ctx - 1 - pos) < window
    if softcap is not None or sinks is not None:
        return capped_attention(q[:, :, None], keys, vals, mask[:, None, None], False, scale, softcap, sinks)[:, :, 0]
    y = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=mask[:, None, None],
                                       enable_gqa=H != H_kv, scale=scale)
    return y[:, :, 0]

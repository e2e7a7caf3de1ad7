"""The engine's token choice in Triton: each row's next token and its policy log-prob straight from the logits,
without writing the [B, V] fp32 log-probs (torch's path writes them, then reads them ~4 times).

Two kernels, the logits read about once (in their own dtype, computed in fp32):
1. one program per (row, chunk of CDF_CHUNK tokens), all in parallel (a row alone is hundreds of serial loads:
   at a decode's small batches, most of the GPU would idle): the chunk's max, its mass of all tokens and of the
   kept ones (stop tokens banned in the banned rows) relative to that max, and for greedy rows its first argmax;
2. one program per row: the row's max and log-softmax denominator from the chunks' (the chosen token's log-prob
   is the policy's, untruncated, as `sampling.policy_logprobs` scores it); greedy rows take the first argmax;
   sampled rows take the first chunk whose cumulative kept mass passes u x total, then, within that chunk (read
   again), the first token whose cumulative mass exceeds the target, or, where rounding left the target past
   the chunk's mass, the last token with mass in it.
That is `sampling.inverse_cdf` (same uniforms, same two levels, zero-mass tokens never chosen), with its sums in
another order: a seeded sample is the same token unless its uniform lies within rounding of a CDF step. Top-k and
top-p are not here (the engine keeps the torch path for them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twinplane.rollout.sampling import CDF_CHUNK, SamplingParams, policy_logprobs, sample


@triton.jit
def _chunk_stats(Logits, Banned, BannedRows, Max, All, Kept, Best, BestIdx, V, C, stride_l, temperature,
                 GREEDY: tl.constexpr, BANNED: tl.constexpr, EVERY_ROW: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    base = Logits + row.to(tl.int64) * stride_l
    cols = tl.arange(0, BLOCK)
    ban = row >= 0  # (a true scalar)
    if BANNED and not EVERY_ROW:
        ban = tl.load(BannedRows + row) != 0
    # per lane: the running max, the mass of all tokens and of the kept (not banned) ones, the best kept token
    m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    all_lane = tl.zeros([BLOCK], tl.float32)
    kept_lane = tl.zeros([BLOCK], tl.float32)
    best_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        idx = start + cols
        ok = idx < V
        x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        kept = x
        if BANNED:
            kept = tl.where(ban & (tl.load(Banned + idx, mask=ok, other=0) != 0), float("-inf"), x)
        m_new = tl.maximum(m_lane, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a lane with no finite logit yet: no NaN)
        alpha = tl.exp(m_lane - m_safe)
        all_lane = all_lane * alpha + tl.exp(x - m_safe)
        kept_lane = kept_lane * alpha + tl.exp(kept - m_safe)
        m_lane = m_new
        if GREEDY:
            better = kept > best_lane  # (strictly: a lane keeps its first maximum)
            best_idx = tl.where(better, idx, best_idx)
            best_lane = tl.where(better, kept, best_lane)
    m = tl.max(m_lane, 0)
    scale = tl.where(m_lane == float("-inf"), 0.0, tl.exp(m_lane - tl.where(m == float("-inf"), 0.0, m)))
    out = row * C + chunk
    tl.store(Max + out, m)
    tl.store(All + out, tl.sum(all_lane * scale, 0))
    tl.store(Kept + out, tl.sum(kept_lane * scale, 0))
    if GREEDY:
        top = tl.max(best_lane, 0)
        tl.store(Best + out, top)
        tl.store(BestIdx + out, tl.min(tl.where(best_lane == top, best_idx, V), 0))


@triton.jit
def _choose(Logits, U, Banned, BannedRows, Max, All, Kept, Best, BestIdx, Tok, LogP, V, C, stride_l, temperature,
            GREEDY: tl.constexpr, BANNED: tl.constexpr, EVERY_ROW: tl.constexpr, CHUNK: tl.constexpr,
            BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    base = Logits + row.to(tl.int64) * stride_l
    cs = tl.arange(0, BLOCK_C)
    at = row * C + cs
    has = cs < C
    mc = tl.load(Max + at, mask=has, other=float("-inf"))
    m = tl.max(mc, 0)
    w = tl.where(mc == float("-inf"), 0.0, tl.exp(mc - m))  # each chunk's masses, relative to the row's max
    log_total = tl.log(tl.sum(tl.load(All + at, mask=has, other=0.0) * w, 0))  # lp = (x - m) - log_total
    if GREEDY:
        best = tl.load(Best + at, mask=has, other=float("-inf"))
        top = tl.max(best, 0)
        tok = tl.min(tl.where(best == top, tl.load(BestIdx + at, mask=has, other=V), V), 0)
    else:
        ban = row >= 0
        if BANNED and not EVERY_ROW:
            ban = tl.load(BannedRows + row) != 0
        kept = tl.load(Kept + at, mask=has, other=0.0) * w
        target = tl.load(U + row) * tl.sum(kept, 0)
        cum = tl.cumsum(kept, 0)
        first = tl.min(tl.where((cum > target) & (kept > 0), cs, BLOCK_C), 0)
        chunk = tl.where(first < BLOCK_C, first, tl.max(tl.where(kept > 0, cs, 0), 0))  # (else the last with mass)
        before = tl.sum(tl.where(cs == chunk, cum - kept, 0.0), 0)
        # within the chunk: the first token whose cumulative mass exceeds the target
        lo = chunk * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        cols = tl.arange(0, BLOCK)
        tok = hi  # none yet
        last_tok = lo
        for start in range(lo, hi, BLOCK):
            idx = start + cols
            ok = idx < hi
            x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) / temperature
            if BANNED:
                x = tl.where(ban & (tl.load(Banned + idx, mask=ok, other=0) != 0), float("-inf"), x)
            p = tl.exp(x - m)
            run = before + tl.cumsum(p, 0)
            tok = tl.minimum(tok, tl.min(tl.where((run > target) & (p > 0), idx, hi), 0))
            last_tok = tl.maximum(last_tok, tl.max(tl.where(p > 0, idx, lo), 0))
            before += tl.sum(p, 0)
        tok = tl.where(tok < hi, tok, last_tok)
    x_tok = tl.load(base + tok).to(tl.float32) / temperature
    tl.store(Tok + row, tok.to(tl.int64))
    tl.store(LogP + row, (x_tok - m) - log_total)


def sample_tokens(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor,
                  banned: torch.Tensor | None = None, banned_rows: torch.Tensor | None = None,
                  block: int = 2048, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] (int64) and their policy log-probs [B] (fp32) from logits [B, V] (any float dtype):
    greedy at temperature 0, else inverse-CDF with `uniforms` [B]; token ids `banned` [K] are never chosen in
    the rows where `banned_rows` [B] is true (all rows when it is None). No top-k/top-p. `block` (tokens per
    load, a power of two up to CDF_CHUNK; smaller vocabularies take less) and `num_warps` (the chunk kernel's;
    default: 8 for loads of 2048 tokens or more, else 4) tune the launch."""
    if block & (block - 1) or not 16 <= block <= CDF_CHUNK:
        raise ValueError(f"block must be a power of two in [16, {CDF_CHUNK}], got {block}")
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev, greedy = logits.device, temperature == 0
    tok = torch.empty(B, dtype=torch.long, device=dev)
    logp = torch.empty(B, dtype=torch.float32, device=dev)
    mask = None
    if banned is not None:
        mask = torch.zeros(V, dtype=torch.int8, device=dev).index_fill_(0, banned, 1)
    chunk = min(CDF_CHUNK, triton.next_power_of_2(V))  # (one chunk: the whole row, as `inverse_cdf` takes it)
    block, C = min(block, chunk), -(-V // chunk)
    stats = torch.empty(3, B, C, dtype=torch.float32, device=dev)  # per chunk: max, mass of all, mass kept
    best = (torch.empty(B, C, dtype=torch.float32, device=dev), torch.empty(B, C, dtype=torch.int32, device=dev)) \
        if greedy else (stats[0], stats[0])  # (greedy: per chunk the best kept logit and its index; else unused)
    if B:
        common = dict(GREEDY=greedy, BANNED=banned is not None, EVERY_ROW=banned_rows is None, CHUNK=chunk,
                      BLOCK=block)
        args = (mask if mask is not None else tok, banned_rows if banned_rows is not None else tok, *stats, *best)
        t = float(temperature) if temperature > 0 else 1.0
        _chunk_stats[(B, C)](logits, *args, V, C, logits.stride(0), t, **common,
                             num_warps=num_warps or (8 if block >= 2048 else 4))
        _choose[(B,)](logits, uniforms, *args, tok, logp, V, C, logits.stride(0), t, **common,
                      BLOCK_C=max(16, triton.next_power_of_2(C)), num_warps=4)  # (no 1-wide blocks)
    return tok, logp


def sample_tokens_torch(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor,
                        banned: torch.Tensor | None = None, banned_rows: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: what the engine's `_sample` computes (policy log-probs, `sample`, the chosen log-prob)."""
    lp = policy_logprobs(logits, temperature)
    tok = sample(lp, SamplingParams(temperature=temperature), uniforms, banned, banned_rows)
    return tok, lp.gather(-1, tok[:, None])[:, 0]

"""The engine's token choice in Triton: each row's next token and its policy log-prob straight from the logits,
without writing the [B, V] fp32 log-probs (torch's path writes them, then reads them ~4 times).

One program per row, three passes over its logits (in their own dtype, computed in fp32):
1. the log-softmax denominator over every token (the chosen token's log-prob is the policy's, untruncated, as
   `sampling.policy_logprobs` scores it) and the mass left after banning stop tokens in the banned rows; greedy
   rows take their argmax here (the first on ties);
2. above CDF_CHUNK tokens, each chunk's mass until the cumulative mass passes u x total (the chosen chunk; the
   chunks after it are not read);
3. the cumulative sum within that chunk: the first token whose cumulative mass exceeds the target, or, where
   rounding left the target at the total, the last token with mass.
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
def _sample_rows(Logits, U, Banned, BannedRows, Tok, LogP, V, stride_l, temperature, GREEDY: tl.constexpr,
                 BANNED: tl.constexpr, EVERY_ROW: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = Logits + row.to(tl.int64) * stride_l
    cols = tl.arange(0, BLOCK)
    ban = row >= 0  # (a true scalar)
    if BANNED and not EVERY_ROW:
        ban = tl.load(BannedRows + row) != 0

    # pass 1: per lane, the running max and the mass of all tokens and of the kept (not banned) ones
    m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    all_lane = tl.zeros([BLOCK], tl.float32)
    kept_lane = tl.zeros([BLOCK], tl.float32)
    best_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
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
        better = kept > best_lane  # (strictly: a lane keeps its first maximum)
        best_idx = tl.where(better, idx, best_idx)
        best_lane = tl.where(better, kept, best_lane)
    m = tl.max(m_lane, 0)
    scale = tl.where(m_lane == float("-inf"), 0.0, tl.exp(m_lane - m))
    log_total = tl.log(tl.sum(all_lane * scale, 0))  # log-softmax: lp = (x - m) - log_total
    kept_total = tl.sum(kept_lane * scale, 0)

    if GREEDY:
        top = tl.max(best_lane, 0)
        tok = tl.min(tl.where(best_lane == top, best_idx, V), 0)
    else:
        target = tl.load(U + row) * kept_total
        chunk = 0
        before = 0.0
        if V > CHUNK:  # pass 2: the first chunk whose cumulative mass passes the target
            found = row < 0  # (a false scalar)
            last = 0
            last_before = 0.0
            cum = 0.0
            for c0 in range(0, V, CHUNK):
                mass = 0.0
                for start in range(c0, c0 + CHUNK, BLOCK):
                    idx = start + cols
                    ok = idx < tl.where(found, 0, V)  # (past the chosen chunk nothing is needed: no loads)
                    x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) / temperature
                    if BANNED:
                        x = tl.where(ban & (tl.load(Banned + idx, mask=ok, other=0) != 0), float("-inf"), x)
                    mass += tl.sum(tl.exp(x - m), 0)
                here = (cum + mass > target) & ~found
                chunk = tl.where(here, c0 // CHUNK, chunk)
                before = tl.where(here, cum, before)
                found = found | here
                last = tl.where(mass > 0, c0 // CHUNK, last)
                last_before = tl.where(mass > 0, cum, last_before)
                cum += mass
            chunk = tl.where(found, chunk, last)  # (rounding put the target at the total: the last chunk with mass)
            before = tl.where(found, before, last_before)
        # pass 3: within the chunk, the first token whose cumulative mass exceeds the target
        lo = chunk * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        tok = hi  # none yet
        last_tok = lo
        cum = before
        for start in range(lo, hi, BLOCK):
            idx = start + cols
            ok = idx < hi
            x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) / temperature
            if BANNED:
                x = tl.where(ban & (tl.load(Banned + idx, mask=ok, other=0) != 0), float("-inf"), x)
            p = tl.exp(x - m)
            run = cum + tl.cumsum(p, 0)
            tok = tl.minimum(tok, tl.min(tl.where((run > target) & (p > 0), idx, hi), 0))
            last_tok = tl.maximum(last_tok, tl.max(tl.where(p > 0, idx, lo), 0))
            cum += tl.sum(p, 0)
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
    load, a power of two up to CDF_CHUNK; smaller vocabularies take less) and `num_warps` (default: 8 for loads of
    2048 tokens or more, else 4) tune the launch."""
    if block & (block - 1) or not 16 <= block <= CDF_CHUNK:
        raise ValueError(f"block must be a power of two in [16, {CDF_CHUNK}], got {block}")
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    mask = None
    if banned is not None:
        mask = torch.zeros(V, dtype=torch.int8, device=logits.device).index_fill_(0, banned, 1)
    block = min(block, triton.next_power_of_2(V))
    if B:
        _sample_rows[(B,)](logits, uniforms, mask if mask is not None else tok,
                           banned_rows if banned_rows is not None else tok, tok, logp, V, logits.stride(0),
                           float(temperature) if temperature > 0 else 1.0, GREEDY=temperature == 0,
                           BANNED=banned is not None, EVERY_ROW=banned_rows is None, CHUNK=CDF_CHUNK, BLOCK=block,
                           num_warps=num_warps or (8 if block >= 2048 else 4))
    return tok, logp


def sample_tokens_torch(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor,
                        banned: torch.Tensor | None = None, banned_rows: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: what the engine's `_sample` computes (policy log-probs, `sample`, the chosen log-prob)."""
    lp = policy_logprobs(logits, temperature)
    tok = sample(lp, SamplingParams(temperature=temperature), uniforms, banned, banned_rows)
    return tok, lp.gather(-1, tok[:, None])[:, 0]

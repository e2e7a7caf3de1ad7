"""The LM head's log-softmax, target gather and entropy in Triton, one row per program: what
`twinplane.train.chunked_logprobs` does to each chunk of logits after the LM head's GEMM, which stays cuBLAS's (or
hipBLASLt's). The torch path casts a [chunk, V] block of logits to fp32 and makes ~6 passes over it (cast,
temperature, logsumexp, subtract, gather, exp and sum for the entropy) in forward and as many in backward; here
forward reads the logits once in their own dtype and writes three floats per row, and backward reads them once
and writes d loss / d logits in their place.

Forward, with z = logits / T over the row: an online logsumexp (running max m, s = sum exp(z - m), a = sum
exp(z - m) z) gives lse = m + log s, log p(y) = z_y - lse and the entropy H = lse - a / s. Backward: with
p = exp(z - lse), d lp / d z = onehot(y) - p and d H / d z = -p (z - lse + H), times the incoming grads, / T.
Numerics: fp32 throughout, the sums in another order than torch's (agreement ~1e-6 relative in fp32).
Each function's torch reference is beside it; tests/train/test_logprob_kernels.py checks them against each other
in Triton's CPU interpreter, and `self_check` does so on a GPU before the platform picks them
(`platform.backends.logprob_kernels`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_stats(Logits, Targets, LP, Ent, LSE, stride, V, T, BLOCK: tl.constexpr, WITH_ENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride
    cols = tl.arange(0, BLOCK)
    z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / T
    m = tl.max(z, 0)
    e = tl.exp(z - m)
    s = tl.sum(e, 0)
    a = tl.sum(e * tl.where(cols < V, z, 0.0), 0)  # (masked lanes: e = 0, and 0 * -inf would be NaN)
    for start in range(BLOCK, V, BLOCK):
        c = start + cols
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32) / T
        m_new = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + tl.sum(e, 0)
        a = a * scale + tl.sum(e * tl.where(c < V, z, 0.0), 0)
        m = m_new
    lse = m + tl.log(s)
    y = tl.load(Targets + row).to(tl.int64)
    tl.store(LP + row, tl.load(base + y).to(tl.float32) / T - lse)
    tl.store(LSE + row, lse)
    if WITH_ENT:
        tl.store(Ent + row, lse - a / s)


@triton.jit
def _logit_grad(Logits, Targets, LSE, Ent, GLP, GEnt, stride, V, T, BLOCK: tl.constexpr, HAS_LP: tl.constexpr,
                HAS_ENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride
    lse = tl.load(LSE + row)
    y = tl.load(Targets + row).to(tl.int64)
    g_lp = 0.0
    if HAS_LP:
        g_lp = tl.load(GLP + row)
    if HAS_ENT:
        h = tl.load(Ent + row)
        g_ent = tl.load(GEnt + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        c = start + cols
        ok = c < V
        logp = tl.load(base + c, mask=ok, other=0.0).to(tl.float32) / T - lse
        p = tl.exp(logp)
        g = -g_lp * p + tl.where(c == y, g_lp, 0.0)
        if HAS_ENT:
            g -= g_ent * p * (logp + h)
        tl.store(base + c, (g / T).to(Logits.dtype.element_ty), mask=ok)


def _block(V: int, device: torch.device) -> int:
    return min(triton.next_power_of_2(V), 4096 if device.type == "cuda" else 1024)


def row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
              with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """logits [c, V] (the GEMM's dtype, unit column stride), targets [c] -> log p(target) [c], the entropy [c]
    (None unless `with_entropy`) and the logsumexp [c] of logits / temperature, all fp32."""
    c, V = logits.shape
    lp, lse = (torch.empty(c, dtype=torch.float32, device=logits.device) for _ in range(2))
    ent = torch.empty(c, dtype=torch.float32, device=logits.device) if with_entropy else None
    if c:
        _row_stats[(c,)](logits, targets, lp, lp if ent is None else ent, lse, logits.stride(0), V,
                         float(temperature), BLOCK=_block(V, logits.device), WITH_ENT=with_entropy, num_warps=8)
    return lp, ent, lse


def row_stats_torch(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The reference: chunked_logprobs' fp32 passes."""
    z = logits.float() / temperature
    lse = z.logsumexp(-1)
    logp = z - lse[:, None]
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logp.gather(-1, targets[:, None]).squeeze(-1), ent, lse


def logit_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, temperature: float,
                g_lp: torch.Tensor | None, ent: torch.Tensor | None = None,
                g_ent: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d logits [c, V], written over `logits` (recomputed for this, in the GEMM's dtype) and returned:
    from the grads of log p(target) (`g_lp` [c]) and of the entropy (`g_ent` [c], with `ent` [c] from forward)."""
    c, V = logits.shape
    has_ent = g_ent is not None
    if c:
        dummy = lse
        _logit_grad[(c,)](logits, targets, lse, ent if has_ent else dummy, dummy if g_lp is None else g_lp,
                          g_ent if has_ent else dummy, logits.stride(0), V, float(temperature),
                          BLOCK=_block(V, logits.device), HAS_LP=g_lp is not None, HAS_ENT=has_ent, num_warps=8)
    return logits


def logit_grad_torch(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, temperature: float,
                     g_lp: torch.Tensor | None, ent: torch.Tensor | None = None,
                     g_ent: torch.Tensor | None = None) -> torch.Tensor:
    """The reference, in fp32 (the caller casts to the GEMM's dtype)."""
    logp = logits.float() / temperature - lse[:, None]
    p = logp.exp()
    g = torch.zeros_like(p) if g_lp is None else -p * g_lp[:, None]
    if g_lp is not None:
        g.scatter_add_(-1, targets[:, None], g_lp[:, None].float())
    if g_ent is not None:
        g -= g_ent[:, None] * p * (logp + ent[:, None])
    return g / temperature


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Both kernels once on a few rows over a vocabulary of three blocks and a bit, against their references on
    `device` in `dtype`: None when they agree within the dtype's tolerance, else which one did not."""
    g = torch.Generator().manual_seed(0)
    V = 2 * _block(10**9, device) + 37
    logits = (torch.randn(3, V, generator=g) * 4).to(device, dtype)
    targets = torch.tensor([0, V - 1, 5], device=device)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    got, want = row_stats(logits, targets, 0.7, True), row_stats_torch(logits, targets, 0.7, True)
    if not all(torch.allclose(a, b, atol=tol, rtol=tol) for a, b in zip(got, want, strict=True)):
        return "log-softmax, gather and entropy"
    grads = [torch.randn(3, generator=g).to(device) for _ in range(2)]
    ent, lse = want[1], want[2]
    got = logit_grad_(logits.clone(), targets, lse, 0.7, grads[0], ent, grads[1]).float()
    if not torch.allclose(got, logit_grad_torch(logits, targets, lse, 0.7, grads[0], ent, grads[1]), atol=tol,
                          rtol=tol):
        return "the logits' gradient"
    return None

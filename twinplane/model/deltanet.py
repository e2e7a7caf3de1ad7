"""The gated delta rule (Gated DeltaNet, Yang et al. 2024), the token mixer of Qwen3-Next's linear-attention layers:
a state S [d_k, d_v] per head, updated at every token t by

    S_t = exp(g_t) S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

with q and k L2-normalised, q scaled by d_k^-1/2, g_t <= 0 the log decay and beta_t in (0, 1) the write strength.
Two forms of the same recurrence, both in fp32 as transformers' reference:
- `chunked`: the sequence in chunks of C tokens; within a chunk the deltas solve one unit lower-triangular system
  (the WY/UT form), so a chunk is a few matmuls and only the chunks run one after the other (training, prefill);
- `recurrent`: token by token (one-token decodes).
Tokens with beta = 0, g = 0 and k = 0 leave the state as it was: right padding that batches sequences of different
lengths is neutral, and the final state is each sequence's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[B, T, H, D] inputs -> fp32 [B, H, T, D] with k/q heads repeated to the value heads (each key head serves
    consecutive value heads), q and k L2-normed, q scaled."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, H_k, d_k], v [B, T, H, d_v], g and beta [B, T, H], state [B, H, d_k, d_v] (None: zeros) ->
    outputs [B, T, H, d_v] in v's dtype and the state after the last token (fp32).

    Within a chunk, with G_i the cumulative log decay up to token i and S_0 the state before it, unrolling the
    recurrence gives S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i - G_j} k_j d_j^T, so the deltas satisfy
    (I + A) d = beta (v - e^G K S_0) with A_ij = beta_i e^{G_i - G_j} k_i.k_j below the diagonal: one triangular
    solve for the part that does not depend on S_0 (u) and one for the part that does (w), d = u - w S_0."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    pad = -T % chunk
    if pad:  # neutral tokens (see the module's docstring)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    G = g.cumsum(-1)  # [B, H, n, C]
    below = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~below, float("-inf")).exp()  # e^{G_i - G_j}, j <= i
    kb = k * beta[..., None]
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * G[..., None].exp(), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C], the diagonal included
    q_in = q * G[..., None].exp()  # queries reading the chunk's initial state
    k_out = k * (G[..., -1:] - G).exp()[..., None]  # keys as the chunk's last token sees them
    S = q.new_zeros(B, H, dk, dv) if state is None else state.float()
    out = []
    for c in range(n):
        d = u[:, :, c] - w[:, :, c] @ S
        out.append(q_in[:, :, c] @ S + scores[:, :, c] @ d)
        S = S * G[:, :, c, -1:, None].exp() + k_out[:, :, c].transpose(-1, -2) @ d
    o = torch.stack(out, 2).reshape(B, H, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), S


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `chunked`, token by token (what a one-token decode runs)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, dk = k.shape
    S = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state.float()
    out = []
    for t in range(T):
        S = S * g[:, :, t, None, None].exp()
        d = (v[:, :, t] - (k[:, :, t, :, None] * S).sum(-2)) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * d[:, :, None]
        out.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(out, 2).transpose(1, 2).to(dtype), S

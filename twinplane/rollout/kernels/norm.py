"""RMSNorm in Triton, with the residual add fused in: one read of each input and one write of each output per row,
where torch runs the add and the norm as ~9 kernels.

Numerics follow `twinplane.model.transformer.RMSNorm` step by step (HF's): the sum is rounded to the input dtype
as torch's add rounds it, the row is normalised in fp32, rounded to the input dtype, and multiplied by the weight
in the promoted dtype; so in bf16 the result is torch's up to the order of the fp32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(X, R, W, Y, Sum, n_rows, eps, stride_x, stride_r, stride_y, stride_s, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    r = rows.to(tl.int64)[:, None]
    x = tl.load(X + r * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + r * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32))
        x = x.to(Sum.dtype.element_ty)
        tl.store(Sum + r * stride_s + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 1) / D + eps)[:, None]
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = w[None, :] * h.to(x.dtype).to(tl.float32)
    tl.store(Y + r * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as rows [R, D] with unit column stride (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., D] with `weight` [D]; with `residual` (x's shape and dtype): (RMSNorm(x + residual),
    x + residual), the residual stream's add and the next norm in one pass."""
    D = x.shape[-1]
    rows = _rows(x)
    n = rows.shape[0]
    y = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total, res = (torch.empty_like(rows), _rows(residual)) if residual is not None else (y, y)
    block_d = triton.next_power_of_2(D)
    # GPUs: tiles of ~2K elements (a row of 896 per two programs' worth of warps); the interpreter: fewer programs
    block_m = min(16, max(1, 2048 // block_d)) if x.is_cuda else 16
    if n:
        _rms_norm[(triton.cdiv(n, block_m),)](rows, res, weight, y, total, n, eps, rows.stride(0), res.stride(0),
                                              y.stride(0), total.stride(0), D=D, BLOCK_M=block_m, BLOCK_D=block_d,
                                              HAS_RESIDUAL=residual is not None, num_warps=4 if D <= 2048 else 8)
    if residual is None:
        return y.view(x.shape)
    return y.view(x.shape), total.view(x.shape)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference: `RMSNorm.forward`, after the residual add when given."""
    s = x if residual is None else x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(s.dtype)
    return y if residual is None else (y, s)

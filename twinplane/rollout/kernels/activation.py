"""SiLU(gate) * up in Triton: the gated MLP's activation as one kernel (torch runs two, and writes SiLU(gate) in
between). Numerics as `F.silu(gate) * up`: SiLU in fp32 rounded to the input dtype, then the product rounded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _silu_mul(Gate, Up, Y, n_rows, stride_g, stride_u, stride_y, N: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    r = rows.to(tl.int64)[:, None]
    g = tl.load(Gate + r * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(Up + r * stride_u + cols[None, :], mask=mask, other=0.0)
    g32 = g.to(tl.float32)
    s = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)
    tl.store(Y + r * stride_y + cols[None, :], (s * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate and up [..., N] of one dtype (views with a row stride, e.g. the halves of one
    stacked gate/up GEMM, are read in place)."""
    N = gate.shape[-1]
    g, u = (x.reshape(-1, N) for x in (gate, up))
    g, u = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, u))
    y = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    n = g.shape[0]
    block_m, block_n = (1, min(1024, triton.next_power_of_2(N))) if gate.is_cuda else (16, triton.next_power_of_2(N))
    if n:
        _silu_mul[(triton.cdiv(n, block_m), triton.cdiv(N, block_n))](g, u, y, n, g.stride(0), u.stride(0),
                                                                       y.stride(0), N=N, BLOCK_M=block_m,
                                                                       BLOCK_N=block_n, num_warps=4)
    return y.view(gate.shape)


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference: what `MLP.forward` computes between its GEMMs."""
    return F.silu(gate) * up

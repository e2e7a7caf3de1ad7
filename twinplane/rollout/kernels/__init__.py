"""The rollout engine's decode-path kernels behind one seam: "torch" (the model's own modules, everywhere) or
"triton" (fused kernels with one source for NVIDIA and AMD GPUs: Triton ships in torch's CUDA and ROCm wheels).

`platform.backends.rollout_kernels` chooses (from `rollout.kernels=auto|triton|torch`) and the engine applies
the choice to its own copy of the model with `use_kernels`: with "torch" nothing changes (the CPU path is the model's
code as it is); with "triton" its modules become the variants in twinplane.rollout.kernels.layers, and the engine's
sampling step takes the fused sampler. The kernels:
- paged_decode.py: paged decode attention reading the KV pool in place (GQA-grouped tiles, split-KV, LSE merge);
- norm.py: RMSNorm, with the residual add fused in;
- activation.py: SiLU(gate) * up;
- rope.py: the rotary embedding of q and k fused with the KV-cache write;
- sampler.py: each row's token and its log-prob from the logits (the engine's inverse-CDF sampling, no top-k/p).
Each file holds its torch reference beside its kernel. tests/rollout/test_kernels.py checks every kernel against its
reference under TRITON_INTERPRET=1 on CPU, and `self_check` does so on a GPU before "auto" picks Triton there.
Triton is imported only when these kernels run, never on the torch path.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def use_kernels(model: nn.Module, kernels: str) -> None:
    """Run `model` (an engine's own copy) on the `kernels` side of the seam."""
    if kernels == "triton":
        from twinplane.rollout.kernels.layers import swap_in_triton_layers  # (imports Triton: only where it runs)

        swap_in_triton_layers(model)


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run every kernel once on tiny inputs on `device` in `dtype` (GQA groups of 7, a block table with a partly
    filled last block, a sliding window, one and three splits; a sampler row over two CDF chunks) against its
    torch reference: None when all agree
    within the dtype's tolerance, else which one did not. Raises what Triton raises (no compiler, a failed
    compile)."""
    # (the kernels import Triton: this package's seam imports without it)
    from twinplane.rollout.kernels.activation import silu_mul, silu_mul_torch
    from twinplane.rollout.kernels.norm import rms_norm, rms_norm_torch
    from twinplane.rollout.kernels.paged_decode import paged_decode, paged_decode_torch
    from twinplane.rollout.kernels.rope import rope_write, rope_write_torch
    from twinplane.rollout.kernels.sampler import sample_tokens, sample_tokens_torch

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    tol = 1e-4 if dtype == torch.float32 else 5e-2
    N, bs, H_kv, G, D = 8, 16, 2, 7, 64
    pool = [rand(N, bs, H_kv, D) for _ in range(4)]
    tables = torch.tensor([[6, 2, 4], [1, 0, 7], [3, 5, 7]], dtype=torch.int32, device=device)
    lens = torch.tensor([bs + 3, 3 * bs, 1], dtype=torch.int32, device=device)
    q = rand(3, G * H_kv, D)
    with torch.no_grad():
        for window, splits in ((None, 1), (None, 3), (bs + 5, 2)):
            want = paged_decode_torch(q, pool[0], pool[1], tables, lens, window)
            if not _close(paged_decode(q, pool[0], pool[1], tables, lens, window, splits=splits), want, tol):
                return f"paged decode attention, window {window}, {splits} split(s)"
        x, r, w = rand(5, 96), rand(5, 96), rand(96)
        if not all(_close(a, b, tol) for a, b in zip(rms_norm(x, w, 1e-6, r), rms_norm_torch(x, w, 1e-6, r),
                                                      strict=True)):
            return "residual add + RMSNorm"
        if not _close(silu_mul(x, r), silu_mul_torch(x, r), tol):
            return "SiLU * up"
        T = 5
        cos, sin = rand(T, D), rand(T, D)
        slots = torch.tensor([3, 17, 40, 41, 127], device=device)
        args = rand(T, G * H_kv, D), rand(T, H_kv, D), rand(T, H_kv, D), cos, sin
        pool[2].copy_(pool[0])
        pool[3].copy_(pool[1])
        got = [*rope_write(*args, pool[0], pool[1], slots), pool[0], pool[1]]
        want = [*rope_write_torch(*args, pool[2], pool[3], slots), pool[2], pool[3]]
        if not all(_close(a, b, tol) for a, b in zip(got, want, strict=True)):
            return "rope + KV-cache write"
        logits = torch.full((4, 5000), float("-inf"), device=device)  # two CDF chunks, mass 1/4, 1/2, 1/4
        logits[:, [3, 4100, 4999]] = torch.tensor([0.0, math.log(2), 0.0], device=device)
        u = torch.tensor([0.1, 0.5, 0.9, 0.7], device=device)
        for temperature, want in ((1.0, [3, 4100, 4999, 4100]), (0.0, [4100] * 4)):
            tok, logp = sample_tokens(logits.to(dtype), temperature, u)
            if tok.tolist() != want or not _close(logp, sample_tokens_torch(logits.to(dtype), temperature, u)[1], tol):
                return f"sampler, temperature {temperature}"
    return None


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))

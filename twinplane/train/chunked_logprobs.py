"""Log-probs and entropy of target tokens through the LM head, never holding the full [tokens, vocab] logits.

`token_logprobs(hidden, weight, targets, ...)` equals `policy_logprobs(hidden @ weight.T, T).gather(targets)` (and
the entropy of that distribution) but runs over `chunk` tokens at a time, in forward and again in backward:
the backward recomputes each chunk's logits instead of saving them, the trade Liger-Kernel's fused linear
cross-entropy makes. Extra memory is a few [chunk, V] fp32 buffers instead of ~4 copies of [tokens, V].

After each chunk's GEMM, the log-softmax, gather and entropy (and in backward the logits' gradient) run as torch's
fp32 passes or, on GPUs where the platform picks them (`backends.logprob_kernels`), as one Triton kernel each over
the logits in the GEMM's dtype (twinplane.train.logprob_kernels): one [chunk, V] buffer in that dtype, one read.
"""

from __future__ import annotations

import torch

from twinplane.platform import backends


def _chunk_logprobs(h: torch.Tensor, w: torch.Tensor, temperature: float, softcap: float | None = None,
                    slope: bool = False):
    """log softmax(h @ w.T / T) [c, V] in fp32, or fp64 for fp64 inputs (the matmul in the inputs' dtype, as the
    direct path), normalised in place: one [c, V] buffer. With `softcap` the logits are soft-capped first
    (cap * tanh(logits / cap), Gemma's final logits); with `slope` also returned: the cap's derivative
    1 - tanh^2 [c, V] (backward's chain rule), a second buffer."""
    logits = (h @ w.T).to(_acc(h.dtype))  # [c, V]
    grad = None
    if softcap is not None:
        logits = logits.div_(softcap).tanh_()
        if slope:
            grad = 1 - logits.square()
        logits.mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    logp = logits.sub_(logits.logsumexp(-1, keepdim=True))
    return (logp, grad) if slope else logp


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, triton, softcap=None):
        # hidden [M, D] and weight [V, D] already in the compute dtype; targets [M]
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.triton = temperature, chunk, with_entropy, triton
        ctx.softcap = softcap
        if triton:
            return _triton_forward(ctx, hidden, weight, targets)
        M = hidden.shape[0]
        lp = torch.empty(M, dtype=_acc(hidden.dtype), device=hidden.device)
        ent = torch.empty(M, dtype=_acc(hidden.dtype), device=hidden.device) if with_entropy else None
        for s in range(0, M, chunk):
            logp = _chunk_logprobs(hidden[s:s + chunk], weight, temperature, softcap)  # [c, V]
            lp[s:s + chunk] = logp.gather(-1, targets[s:s + chunk, None]).squeeze(-1)
            if with_entropy:
                ent[s:s + chunk] = -logp.exp().mul_(logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, ent if with_entropy else lp)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        """Per chunk, the logits' gradient (`_torch_logit_grad` or `_triton_logit_grad`), then the two matmuls in
        the compute dtype, the weight grad accumulated in fp32."""
        hidden, weight = ctx.saved_tensors[:2]
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=_acc(weight.dtype), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        logit_grad = _triton_logit_grad if ctx.triton else _torch_logit_grad
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, rows = hidden[s:s + ctx.chunk], slice(s, s + ctx.chunk)
            gz = logit_grad(ctx, h, rows, g_lp, g_ent)  # [c, V] d loss / d logits, in the compute dtype
            if grad_h is not None:
                grad_h[rows] = gz @ weight
            if grad_w is not None:
                if gz.dtype == grad_w.dtype:
                    grad_w.addmm_(gz.T, h)
                else:  # a [V, D] product in the compute dtype, summed in fp32
                    grad_w.add_(gz.T @ h)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def _torch_logit_grad(ctx, h, rows, g_lp, g_ent):
    """d lp / d z = onehot(y) - p and d H / d z = -p (log p + H), with z = logits / T (times the soft-cap's slope
    where the logits are capped); fp32 throughout."""
    _, weight, targets, ent = ctx.saved_tensors
    T = ctx.temperature
    logp, slope = _chunk_logprobs(h, weight, T, ctx.softcap, slope=True)  # [c, V]
    p = logp.exp()
    if ctx.with_entropy and g_ent is not None:  # g_z = -g_ent * p * (logp + H), built in logp's buffer
        gz = logp.add_(ent[rows, None]).mul_(p).mul_(-g_ent[rows, None])
        if g_lp is not None:
            gz.sub_(p.mul_(g_lp[rows, None]))
    else:
        gz = p.mul_(-(g_lp[rows, None] if g_lp is not None else 0.0))
    if g_lp is not None:
        gz.scatter_add_(-1, targets[rows, None], g_lp[rows, None].to(gz.dtype))
    if T != 1.0:
        gz.div_(T)
    if slope is not None:
        gz.mul_(slope)
    return gz.to(h.dtype)


def _triton_forward(ctx, hidden, weight, targets):
    from twinplane.train.logprob_kernels import row_stats  # (imports Triton)

    lp, ent, lse = [], [], []
    for s in range(0, hidden.shape[0], ctx.chunk):
        a, b, c = row_stats(hidden[s:s + ctx.chunk] @ weight.T, targets[s:s + ctx.chunk], ctx.temperature,
                            ctx.with_entropy)
        lp.append(a)
        ent.append(b)
        lse.append(c)
    lp, lse = torch.cat(lp), torch.cat(lse)
    ent = torch.cat(ent) if ctx.with_entropy else None
    ctx.save_for_backward(hidden, weight, targets, lse, ent)
    return lp, ent


def _triton_logit_grad(ctx, h, rows, g_lp, g_ent):
    """As `_torch_logit_grad`, from the Triton kernel, written over the recomputed logits in the GEMM's dtype."""
    from twinplane.train.logprob_kernels import logit_grad_  # (imports Triton)

    _, weight, targets, lse, ent = ctx.saved_tensors
    use_ent = ctx.with_entropy and g_ent is not None
    return logit_grad_(h @ weight.T, targets[rows], lse[rows], ctx.temperature,
                       None if g_lp is None else g_lp[rows].contiguous(), ent[rows] if use_ent else None,
                       g_ent[rows].contiguous() if use_ent else None)


def kernel_self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """The Triton kernels' self-check (`backends.logprob_kernels`)."""
    from twinplane.train.logprob_kernels import self_check  # (imports Triton: only where it may be used)

    return self_check(device, dtype)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                   chunk: int, with_entropy: bool = False, kernels: str | None = None,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(targets) [M] and, with `with_entropy`, the entropy of pi [M], both fp32, where
    pi = softmax(hidden [M, D] @ weight [V, D].T / temperature) (temperature 0 scores at 1, as the engine's greedy).

    The matmuls run in the autocast dtype when autocast is on (else `weight`'s dtype); log-softmax and
    reductions in fp32. `chunk` > 0 bounds the transient memory to a few [chunk, V] buffers. `kernels`: "torch" or
    "triton" for what follows each GEMM (None: the platform's choice for this device and dtype). `softcap`: the
    model's final-logit soft-cap (`config.final_logit_softcapping`), applied to the logits before the temperature;
    the Triton kernels do not cap, so capped logits take the torch passes."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    t = temperature if temperature > 0 else 1.0
    if softcap is not None:
        kernels = "torch"
    elif kernels is None:
        kernels = backends.logprob_kernels(hidden.device, dtype, check=kernel_self_check)
    with torch.autocast(dev, enabled=False):
        return _ChunkedLogprobs.apply(hidden.to(dtype), weight.to(dtype), targets, t, chunk, with_entropy,
                                      kernels == "triton" and dtype != torch.float64, softcap)

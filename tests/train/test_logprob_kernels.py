"""The training plane's Triton log-softmax kernels (twinplane.train.logprob_kernels) against their torch references
and the whole chunked log-prob path against the torch path, values and gradients. Without a GPU the kernels run in
Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest)."""

import pytest
import torch

pytest.importorskip("triton")

from twinplane.platform import backends  # noqa: E402
from twinplane.train.chunked_logprobs import token_logprobs  # noqa: E402
from twinplane.train.logprob_kernels import (  # noqa: E402
    logit_grad_,
    logit_grad_torch,
    row_stats,
    row_stats_torch,
    self_check,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("V", [7, 1024, 2500])  # one partial block; one whole block; blocks and a partial one
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_row_stats_and_logit_grad_equal_their_references(V, temperature):
    g = torch.Generator().manual_seed(V)
    logits = (3 * torch.randn(5, V, generator=g)).to(DEV)
    targets = torch.tensor([0, V - 1, V // 2, 3 % V, 1], device=DEV)
    lp, ent, lse = row_stats(logits, targets, temperature, True)
    want = row_stats_torch(logits, targets, temperature, True)
    for got, ref in zip((lp, ent, lse), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    lp_only, none, _ = row_stats(logits, targets, temperature, False)
    assert none is None and torch.equal(lp_only, lp)
    g_lp, g_ent = torch.randn(5, generator=g).to(DEV), torch.randn(5, generator=g).to(DEV)
    for args in ((g_lp, ent, g_ent), (g_lp,), (None, ent, g_ent)):  # both grads; log-probs only; entropy only
        got = logit_grad_(logits.clone(), targets, lse, temperature, *args)
        torch.testing.assert_close(got, logit_grad_torch(logits, targets, lse, temperature, *args), atol=1e-6,
                                   rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_with_triton_equal_the_torch_path(dtype):
    """Values and gradients of hidden and weight through `token_logprobs`, chunks that do not divide the rows."""
    g = torch.Generator().manual_seed(0)
    M, D, V = 23, 16, 1100

    def run(kernels):
        h = (0.5 * torch.randn(M, D, generator=torch.Generator().manual_seed(1))).to(DEV, dtype).requires_grad_()
        w = (0.5 * torch.randn(V, D, generator=torch.Generator().manual_seed(2))).to(DEV, dtype).requires_grad_()
        lp, ent = token_logprobs(h, w, y, 0.8, 10, with_entropy=True, kernels=kernels)
        return lp, ent, *torch.autograd.grad((lp * c_lp).sum() + (ent * c_ent).sum(), (h, w))

    y = torch.randint(0, V, (M,), generator=g).to(DEV)
    c_lp, c_ent = torch.randn(M, generator=g).to(DEV), torch.randn(M, generator=g).to(DEV)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # (bf16 gradients: rounded to bf16 either way)
    for got, want in zip(run("triton"), run("torch"), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_self_check_and_the_platform_choice(monkeypatch):
    assert self_check(DEV, torch.float32) is None
    if DEV.type == "cpu":
        assert backends.logprob_kernels(DEV, torch.float32, check=self_check) == "torch"  # CPU: the torch path
    monkeypatch.setattr(backends, "_TRITON_OK", {})
    gpu = torch.device("cuda", 0)
    assert backends.logprob_kernels(gpu, torch.float64, check=self_check) == "torch"  # fp64: never Triton
    with pytest.warns(UserWarning, match="logprob kernels: the Triton kernels failed their self-check"):
        assert backends.logprob_kernels(gpu, torch.bfloat16, check=lambda d, t: "it disagreed") == "torch"
    monkeypatch.setattr(backends, "_TRITON_OK", {})
    assert backends.logprob_kernels(gpu, torch.bfloat16, check=lambda d, t: None) == "triton"

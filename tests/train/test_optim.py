"""The optimizer: the fused AdamW that GPUs run equals torch's per-tensor loop (the CPU path) step for step; the
schedules' rates by hand."""

import copy
import math

import torch

from twinplane.train.optim import build_optimizer, lr_lambda


def test_fused_adamw_equals_the_per_tensor_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    loop, _ = build_optimizer(model.parameters(), 1e-2, (0.9, 0.99), 0.1, 2, 10, "cosine")
    fused, _ = build_optimizer(twin.parameters(), 1e-2, (0.9, 0.99), 0.1, 2, 10, "cosine", fused=True)
    assert not loop.defaults["fused"] and fused.defaults["fused"]  # CPU: the loop unless asked
    for _ in range(5):
        x = torch.randn(8, 16)
        for m, opt in ((model, loop), (twin, fused)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not any(torch.equal(a, s) for a, s in zip(model.parameters(), start.parameters(), strict=True))  # moved


def test_schedules_by_hand():
    cosine, wsd, const = (lr_lambda(2, 12, s, 0.1, 0.5) for s in ("cosine", "wsd", "constant"))
    assert [cosine(0), cosine(1), wsd(0), wsd(1), const(0)] == [0.5, 1.0, 0.5, 1.0, 0.5]  # warmup
    # cosine from the end of warmup (step 2) to step 12; wsd stable to step 6 (12 - 0.5 * 12), cosine to step 12
    assert math.isclose(cosine(7), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert [wsd(s) for s in (2, 5)] == [1.0, 1.0] and math.isclose(wsd(9), 0.1 + 0.9 * 0.5)
    assert math.isclose(wsd(12), 0.1) and math.isclose(cosine(12), 0.1) and const(11) == 1.0

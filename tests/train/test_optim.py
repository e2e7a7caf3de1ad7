"""The optimizer: the fused AdamW that GPUs run equals torch's per-tensor loop (the CPU path) step for step."""

import copy

import torch

from twinplane.train.optim import build_optimizer


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

"""Packed attention through torch's own varlen flash attention (`torch_varlen`), which has no CPU kernel: on CPU,
`varlen_attn` is replaced by a brute-force implementation of its documented semantics (per segment, causal aligned
bottom-right, window (left, right), GQA), in both of its signatures, so the adapter (key gathering for shared
prefixes, offsets, window and GQA arguments), its self-check and the platform's choice are tested against the
portable path. On a GPU the real kernel runs the same comparison."""

import pytest
import torch
import torch.nn.functional as F
from conftest import grouped_batch, simulate_gpu, tiny_model

from twinplane.model import AttentionMetadata
from twinplane.model.attention import sdpa_varlen, torch_varlen, torch_varlen_agrees
from twinplane.platform import backends, hardware

# (torch < 2.10 has no varlen_attn, and its platform never picks `torch_varlen`)
varlen_module = pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn (torch < 2.10)")


def brute_force(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, top_left=False):
    """What flash-attn's varlen kernel computes, one segment at a time: query j of a segment with Lq queries and Lk
    keys sits at key position j + Lk - Lq (bottom-right; `top_left`: at j, a deliberately wrong variant)."""
    assert max_q == max(torch.diff(cu_q).tolist()) and max_k == max(torch.diff(cu_k).tolist())
    if k.shape[1] != q.shape[1]:
        assert enable_gqa, "GQA without enable_gqa"
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    left, right = window_size
    out = []
    for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist(), strict=False):
        j = torch.arange(b - a)[:, None] + (0 if top_left else (d - c) - (b - a))
        t = torch.arange(d - c)[None]
        keep = torch.ones(b - a, d - c, dtype=torch.bool)
        if left >= 0:
            keep &= t >= j - left
        if right >= 0:
            keep &= t <= j + right
        out.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                  v[c:d].transpose(0, 1), attn_mask=keep).transpose(0, 1))
    return torch.cat(out)


def new_signature(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return brute_force(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                       enable_gqa=enable_gqa)


def old_signature(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's: causal or full, equal head counts."""
    return brute_force(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0 if is_causal else -1))


def qkv(T, heads=(4, 2, 2), seed=0, D=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, T, D, generator=g, dtype=torch.float64).requires_grad_() for h in heads]


CASES = [([9, 1, 16, 5], None, None), ([9, 1, 16, 5], [-1, 0, 0, -1], None), ([7, 3, 4, 12, 2], [-1, 0, 0, -1, 3], 4),
         ([5, 6], None, 3)]


@pytest.mark.parametrize("signature", [new_signature, old_signature])
@pytest.mark.parametrize(("lengths", "prefix", "window"), CASES)
@pytest.mark.parametrize("heads", [(4, 2, 2), (2, 2, 2)])
def test_torch_varlen_equals_the_portable_path(monkeypatch, signature, lengths, prefix, window, heads):
    """Values and q/k/v gradients (float64): shared prefixes see their parent's keys, windows count over both."""
    monkeypatch.setattr(varlen_module, "varlen_attn", signature)
    q, k, v = qkv(sum(lengths), heads)
    meta = AttentionMetadata.packed(lengths, window=window, prefix=prefix)
    want = sdpa_varlen(q, k, v, AttentionMetadata.packed(lengths, window=window, prefix=prefix))
    if signature is old_signature and window is not None:
        with pytest.raises(ValueError, match="no sliding window"):
            torch_varlen(q, k, v, meta)
        return
    got = torch_varlen(q, k, v, meta)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_self_check_passes_and_catches_a_misaligned_kernel(monkeypatch):
    monkeypatch.setattr(varlen_module, "varlen_attn", new_signature)
    assert torch_varlen_agrees(torch.device("cpu"), torch.float32)
    with torch.no_grad():  # the first packed pass of a run is often a scoring pass
        assert torch_varlen_agrees(torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        assert torch_varlen_agrees(torch.device("cpu"), torch.float32)

    def top_left(*a, window_size=(-1, -1), enable_gqa=False, **k):  # right for plain segments, wrong for prefixes
        return brute_force(*a, window_size=window_size, enable_gqa=enable_gqa, top_left=True)

    monkeypatch.setattr(varlen_module, "varlen_attn", top_left)
    assert not torch_varlen_agrees(torch.device("cpu"), torch.float32)


class Check:
    def __init__(self, answer=True):
        self.answer, self.calls = answer, []

    def __call__(self, device, dtype):
        self.calls.append((device.type, dtype))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.fixture
def fresh(monkeypatch):
    hardware.reset()
    monkeypatch.setattr(varlen_module, "varlen_attn", new_signature)
    yield
    hardware.reset()


def test_platform_picks_torch_varlen_on_gpus_after_its_check(monkeypatch, fresh):
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    check = Check()
    assert backends.varlen_backend(gpu, bf16, True, 128, check=check) == "torch_varlen"
    assert backends.varlen_backend(gpu, bf16, False, 128, True, check=check) == "torch_varlen"
    assert check.calls == [("cuda", bf16)]  # once per device and dtype
    assert backends.varlen_backend(gpu, torch.float32, True, 128, check=check) == "flex"  # a 16-bit kernel
    assert backends.varlen_backend(gpu, bf16, True, 20, check=check) == "flex"  # head dims: multiples of 8
    assert backends.varlen_backend(torch.device("cpu"), bf16, True, 128, check=check) == "sdpa"
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", installed=("flash_attn",))
    hardware.reset()
    assert backends.varlen_backend(gpu, bf16, False, 128, check=check) == "flash_attn"
    assert backends.varlen_backend(gpu, bf16, True, 128, check=check) == "torch_varlen"  # flash_attn: no prefixes
    hardware.reset()
    monkeypatch.setattr(varlen_module, "varlen_attn", old_signature)
    assert backends.varlen_backend(gpu, bf16, True, 128, window=True, check=check) == "flex"  # 2.10: no window
    assert check.calls == [("cuda", bf16)] * 2  # (again after the reset)


def test_the_first_choice_under_no_grad_still_picks_torch_varlen(monkeypatch, fresh):
    """A run's first packed pass scores log-probs under no_grad, and the choice it makes is kept for the run: the
    self-check (here on CPU, its kernel the brute force) must pass there too."""
    simulate_gpu(monkeypatch, "NVIDIA H200")
    check = Check()
    with torch.no_grad():
        assert backends.varlen_backend(torch.device("cuda"), torch.bfloat16, True, 64, check=lambda device, dtype: (
            check(device, dtype) and torch_varlen_agrees(torch.device("cpu"), torch.float32))) == "torch_varlen"
    assert backends.varlen_backend(torch.device("cuda"), torch.bfloat16, True, 64, check=Check(False)) == \
        "torch_varlen"  # (kept: checked once per device and dtype)


@pytest.mark.parametrize("answer", [False, RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")])
def test_a_failed_check_warns_once_and_keeps_flex(monkeypatch, fresh, answer):
    simulate_gpu(monkeypatch, "AMD Instinct MI300X", hip="6.4", arch="gfx942")
    why = "it disagreed" if answer is False else "FlashAttention only supports Ampere GPUs or newer"
    with pytest.warns(UserWarning, match=f"varlen_attn failed its self-check on cuda \\({why}"):
        assert backends.varlen_backend(torch.device("cuda"), torch.float16, True, 64, check=Check(answer)) == "flex"
    assert backends.varlen_backend(torch.device("cuda"), torch.float16, True, 64, check=Check()) == "flex"


def test_the_trainers_packed_logprobs_through_torch_varlen(monkeypatch):
    """The trainer's packed, prompt-sharing forward with the backend forced to torch_varlen: log-probs and
    gradients equal the portable path's (fp32: the brute force runs SDPA per segment, the portable path batches)."""
    from twinplane.train.logprobs import response_logprobs

    monkeypatch.setattr(varlen_module, "varlen_attn", new_signature)
    model, batch, out = tiny_model(sliding_window=6).train(), grouped_batch(tiny_model()), []
    for backend in ("torch_varlen", "sdpa"):
        monkeypatch.setattr(backends, "varlen_backend", lambda *a, b=backend, **k: b)
        lp, _ = response_logprobs(model, batch, 1.0, share_prompts=True)
        out.append((lp, torch.autograd.grad((lp * batch.advantages).sum(), list(model.parameters()))))
    (lp, grads), (want, want_grads) = out
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)
    for a, b in zip(grads, want_grads, strict=True):
        assert (a - b).abs().max() <= 4e-6 * (1 + b.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 33])
def test_torch_varlen_on_gpu_equals_the_portable_path(window):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs sm80+")
    lengths, prefix = [50, 7, 130, 1, 64], [-1, 0, 0, -1, 3]
    q, k, v = (x.detach().cuda().to(torch.bfloat16).requires_grad_() for x in qkv(sum(lengths), D=64))
    meta = AttentionMetadata.packed(lengths, "cuda", window=window, prefix=prefix)
    want = sdpa_varlen(q, k, v, AttentionMetadata.packed(lengths, "cuda", window=window, prefix=prefix))
    got = torch_varlen(q, k, v, meta)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=0)

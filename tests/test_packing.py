"""Training plane at scale: chunked log-probs equal the direct computation, packed (varlen) micro-batches equal
padded ones, the varlen attention paths agree, micro-batches balance real tokens."""

import importlib

import pytest
import torch
from conftest import tiny_model
from test_trainer import make_batch

from twinplane.config import AlgoSection, TrainSection
from twinplane.model import AttentionMetadata
from twinplane.model.attention import flex_varlen, sdpa_varlen, varlen_mask
from twinplane.rollout.sampling import policy_logprobs
from twinplane.train import Trainer
from twinplane.train.chunked_logprobs import token_logprobs
from twinplane.train.fsdp import packed_groups
from twinplane.train.logprobs import response_logprobs, score

attention_module = importlib.import_module("twinplane.model.attention")  # (the package exports a function so named)
ALGO = AlgoSection(kl_coef=0.1, entropy_coef=0.01)


def _head(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    M, D, V = 35, 16, 97
    h = (0.5 * torch.randn(M, D, generator=g)).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(V, D, generator=g)).to(dtype).requires_grad_()
    y = torch.randint(0, V, (M,), generator=g)
    c_lp, c_ent = 0.5 * torch.randn(M, generator=g).to(dtype), 0.5 * torch.randn(M, generator=g).to(dtype)
    return h, w, y, c_lp, c_ent  # c_*: arbitrary upstream grads of the log-probs and the entropy


def _direct(h, w, y, temperature, c_lp, c_ent):
    """The full-vocabulary computation: [M, V] logits, log-softmax, gather, entropy."""
    lp_full = (h @ w.T / temperature).log_softmax(-1)  # [M, V]
    lp, ent = lp_full.gather(-1, y[:, None]).squeeze(-1), -(lp_full.exp() * lp_full).sum(-1)
    return (lp, ent, *torch.autograd.grad((lp * c_lp).sum() + (ent * c_ent).sum(), (h, w)))


def _chunked(h, w, y, temperature, c_lp, c_ent, chunk):
    lp, ent = token_logprobs(h, w, y, temperature, chunk, with_entropy=True)
    return (lp, ent, *torch.autograd.grad((lp * c_lp).sum() + (ent * c_ent).sum(), (h, w)))


@pytest.mark.parametrize("chunk", [1, 5, 7, 35, 64])  # 35 tokens: chunks that do and don't divide it
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_direct_values_and_grads(chunk, temperature):
    """Exact in fp64 (the algorithm: recomputed chunks, the analytic backward); within 1e-6 of the direct
    computation in fp32 (what training runs; the remainder is the matmuls' summation order)."""
    h, w, y, c_lp, c_ent = _head(torch.float64)
    for got, want in zip(_chunked(h, w, y, temperature, c_lp, c_ent, chunk),
                         _direct(h, w, y, temperature, c_lp, c_ent), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    h, w, y, c_lp, c_ent = _head(torch.float32)
    for got, want in zip(_chunked(h, w, y, temperature, c_lp, c_ent, chunk),
                         _direct(h, w, y, temperature, c_lp, c_ent), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # (entropies ~4: a few ulps)
    lp_only, none = token_logprobs(h, w, y, temperature, chunk)  # log-probs alone (scoring, SFT)
    assert none is None
    want_lp = policy_logprobs(h @ w.T, temperature).gather(-1, y[:, None]).squeeze(-1)  # the engine's function
    torch.testing.assert_close(torch.autograd.grad(lp_only.sum(), w)[0], torch.autograd.grad(want_lp.sum(), w)[0],
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_packed_logprobs_equal_padded(window):
    model = tiny_model(sliding_window=window).train()
    batch = make_batch(tiny_model(), n=7, tool_masks=True)
    lp_pad, ent_pad = response_logprobs(model, batch, 0.8, with_entropy=True, packed=False, chunk_tokens=1000)
    lp, ent = response_logprobs(model, batch, 0.8, with_entropy=True, packed=True, chunk_tokens=4)
    real = batch.attention_mask[:, batch.prompt_len:].bool()
    assert lp.shape == batch.response_mask.shape and bool((lp[~real] == 0).all())
    torch.testing.assert_close(lp, lp_pad, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_pad, atol=1e-5, rtol=0)
    grads = [torch.autograd.grad((x * batch.advantages).sum() + e.sum(), list(model.parameters()))
             for x, e in ((lp, ent), (lp_pad, ent_pad))]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # scoring (reference / old log-probs): packed, token-budgeted micro-batches, rows back in their places
    torch.testing.assert_close(score(model, batch, 0.8, 3, max_tokens=20), lp_pad.detach() * batch.response_mask,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("tool_masks", [False, True])
def test_packed_train_step_equals_padded(tool_masks):
    """One optimizer step, packed (token-budgeted, balanced micro-batches) vs padded fixed micro-batches; with
    multi-turn loss masks the global token mean must still count only the trained tokens. Grads are compared
    too: Adam's first step is about lr * sign(grad), blind to a wrong scale and sensitive to ~0 grads' rounding
    (hence the small lr)."""
    batch = make_batch(tiny_model(), n=9, tool_masks=tool_masks)
    if tool_masks:
        assert 0 < batch.num_response_tokens < int(batch.attention_mask[:, batch.prompt_len:].sum())
    out = []
    for packing, budget in ((False, 0), (True, 40)):
        model = tiny_model()
        train = TrainSection(micro_batch_size=4, lr=1e-4, packing=packing, max_tokens_per_micro_batch=budget,
                             logprob_chunk_tokens=8)
        trainer = Trainer(model, train, ALGO, 1.0, 10)
        trainer.opt.zero_grad = lambda set_to_none=True: None  # keep the grads to compare
        out.append((model, trainer.train_step(batch)))
    (padded, m_pad), (packed, m_pack) = out
    for (name, p), q in zip(packed.named_parameters(), padded.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    for k, v in m_pad.items():
        assert abs(m_pack[k] - v) < 1e-5, k


def test_packed_groups_balance_real_tokens():
    batch = make_batch(tiny_model(), n=11, tool_masks=True)
    lens = batch.attention_mask.sum(1).tolist()
    groups = packed_groups(batch, size=4, max_tokens=30)
    assert sorted(i for g in groups for i in g) == list(range(11))
    assert all(len(g) <= 4 and (sum(lens[i] for i in g) <= 30 or len(g) == 1) for g in groups)
    loads = [sum(lens[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lens)  # greedy longest-first: within one sequence of each other
    assert len(groups) >= max(-(-11 // 4), -(-sum(lens) // 30))  # no fewer than the row cap and budget need
    assert packed_groups(batch, size=11) == [list(range(11))]


def _qkv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8,
                                                                                                   generator=g)


@pytest.mark.parametrize("window", [None, 4])
def test_segmented_varlen_equals_one_block_diagonal_mask(monkeypatch, window):
    """The portable path splits the row into segments (memory O(T x block)); a longer sequence is alone."""
    monkeypatch.setattr(attention_module, "VARLEN_BLOCK", 8)
    lengths = [5, 2, 12, 1, 3, 6]
    q, k, v = _qkv(sum(lengths))
    meta = AttentionMetadata.packed(lengths, window=window)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=varlen_mask(meta), enable_gqa=True)
    got = sdpa_varlen(q, k, v, meta)
    assert len(meta.cache["segments"]) == 4  # [5, 2], [12], [1, 3], [6]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_flex_varlen_agrees_with_portable(window):
    """FlexAttention's document mask (the GPU fast path). torch 2.13 runs it on CPU forward-only, eagerly."""
    lengths = [5, 2, 12, 1, 3, 6]
    q, k, v = _qkv(sum(lengths))
    meta = AttentionMetadata.packed(lengths, window=window)
    with torch.no_grad():
        torch.testing.assert_close(flex_varlen(q, k, v, meta), sdpa_varlen(q, k, v, meta), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["flex", "flash_attn"])
def test_fused_varlen_forward_backward_agree_on_gpu(backend):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    lengths = [50, 7, 130, 1, 64]
    q, k, v = (x.cuda().to(torch.bfloat16).requires_grad_() for x in _qkv(sum(lengths)))
    meta = AttentionMetadata.packed(lengths, "cuda", backend=backend)
    out = attention_module.VARLEN_BACKENDS[backend](q, k, v, meta)
    want = sdpa_varlen(q, k, v, AttentionMetadata.packed(lengths, "cuda"))
    torch.testing.assert_close(out, want, atol=2e-2, rtol=0)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, q, g)[0], torch.autograd.grad(want, q, g)[0], atol=5e-2,
                               rtol=0)

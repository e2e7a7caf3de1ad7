"""Training plane at scale: chunked log-probs equal the direct computation, packed (varlen) micro-batches equal
padded ones, the varlen attention paths agree, micro-batches balance real tokens."""

import dataclasses
import importlib
from contextlib import nullcontext

import pytest
import torch
from conftest import grouped_batch, make_batch, simulate_gpu, tiny_model

from twinplane.config import AlgoSection, TrainSection
from twinplane.model import AttentionMetadata
from twinplane.model.attention import flex_varlen, sdpa_varlen, varlen_mask
from twinplane.platform import backends, hardware, runtime
from twinplane.rollout.sampling import policy_logprobs
from twinplane.train import Batch, Trainer
from twinplane.train.chunked_logprobs import token_logprobs
from twinplane.train.fsdp import micro_batch_rows, packed_groups
from twinplane.train.logprobs import device_micro_batches, packed_layout, response_logprobs, score, shared_layout

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


@pytest.mark.parametrize("window", [None, 3])
def test_shared_prompts_equal_one_copy_per_row(window):
    """Rows with the same prompt share one copy of it: log-probs, entropies and grads equal the unshared layout."""
    model = tiny_model(sliding_window=window).train()
    batch = grouped_batch(tiny_model())
    lengths, prefix, _, _ = shared_layout(batch)
    assert sum(lengths) == int(batch.attention_mask.sum()) - (4 - 1) * (5 + 2 + 3)  # n - 1 copies of each prompt
    assert prefix.count(-1) == 3
    out = [response_logprobs(model, batch, 0.8, with_entropy=True, chunk_tokens=5, share_prompts=share)
           for share in (True, False)]
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    grads = [torch.autograd.grad((lp * batch.advantages).sum() + ent.sum(), list(model.parameters()))
             for lp, ent in out]
    for a, b in zip(*grads, strict=True):  # fp32 rounding of a different summation order, relative to the largest
        assert (a - b).abs().max() <= 4e-6 * (1 + b.abs().max()), (a - b).abs().max()
    torch.testing.assert_close(score(model, batch, 0.8, 5, share_prompts=True),
                               out[1][0].detach() * batch.response_mask, atol=1e-5, rtol=0)


@pytest.mark.parametrize("share", [True, False])
def test_micro_batches_are_planned_on_the_host(share):
    """Micro-batch rows, trimmed columns and packed layouts come from host copies of the token ids and masks:
    equal to cutting and laying out each micro-batch itself, and built for a device nothing is read back from
    (meta tensors cannot be read; the per-token fields live there, as log-probs scored on a GPU do)."""
    batch = grouped_batch(tiny_model())
    planned = device_micro_batches(batch, torch.device("cpu"), 5, max_tokens=24, share_prompts=share)
    rows = micro_batch_rows(batch, 5, max_tokens=24, packed=True)
    assert len(planned) == len(rows) > 1

    def same_layout(a, b):
        assert (a.lengths, a.prefix) == (b.lengths, b.prefix)
        assert torch.equal(a.index, b.index) and torch.equal(a.rows, b.rows)

    for (r, w), (r2, mb, w2, layout, tokens) in zip(rows, planned, strict=True):
        want = batch.select(r)
        assert torch.equal(r, r2) and w == w2 and tokens == int(want.attention_mask.sum())
        assert mb.prompt_len == want.prompt_len
        for f in dataclasses.fields(Batch):
            a, b = getattr(mb, f.name), getattr(want, f.name)
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, f.name
        same_layout(layout, packed_layout(want, share))
    on_device = dataclasses.replace(batch, advantages=batch.advantages.to("meta"),
                                    rollout_logprobs=batch.rollout_logprobs.to("meta"))
    meta = device_micro_batches(on_device, torch.device("meta"), 5, max_tokens=24, share_prompts=share)
    for (_, mb, _, layout, _), (_, want, _, want_layout, _) in zip(meta, planned, strict=True):
        assert mb.input_ids.is_meta and mb.advantages.is_meta and mb.input_ids.shape == want.input_ids.shape
        assert mb.advantages.shape == want.advantages.shape
        same_layout(layout, want_layout)


def test_shared_prompts_train_step_equals_unshared():
    out = []
    for share in (True, False):
        model = tiny_model()
        trainer = Trainer(model, TrainSection(micro_batch_size=12, lr=1e-6, share_prompts=share), ALGO, 1.0, 10)
        trainer.opt.zero_grad = lambda set_to_none=True: None  # keep the grads to compare
        out.append((model, trainer.train_step(grouped_batch(tiny_model()))))
    (shared, m_shared), (plain, m_plain) = out
    for (name, p), q in zip(shared.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 4e-6 * (1 + q.grad.abs().max()), name
        torch.testing.assert_close(p, q, atol=3e-6, rtol=0, msg=name)  # Adam's first step: ~lr * sign(grad)
    assert m_shared.pop("actor/prompt_tokens_shared") == (4 - 1) * (5 + 2 + 3)  # one micro-batch of 12 rows
    assert m_plain.pop("actor/prompt_tokens_shared") == 0
    for k, v in m_plain.items():
        assert abs(m_shared[k] - v) < 1e-5, k


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


def _qkv(T, seed=0, D=8):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, T, D, generator=g) for H in (4, 2, 2))


@pytest.mark.parametrize("window", [None, 4])
def test_grouped_varlen_equals_one_block_diagonal_mask(monkeypatch, window):
    """The portable path batches sequences of similar length (causal SDPA, padding after the real tokens):
    values and gradients equal one SDPA call with the whole row's block-diagonal mask."""
    monkeypatch.setattr(attention_module, "VARLEN_GROUP_TOKENS", 24)
    lengths = [5, 2, 12, 1, 3, 6, 4]
    q, k, v = (x.requires_grad_() for x in _qkv(sum(lengths)))
    meta = AttentionMetadata.packed(lengths, window=window)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=varlen_mask(meta), enable_gqa=True)
    got = sdpa_varlen(q, k, v, meta)
    groups, unpermute = meta.cache["varlen_plan"]
    assert [(G, L) for _, _, G, L, _, _ in groups] == [(2, 12), (3, 5), (2, 2)]  # [12, 6], [5, 4, 3], [2, 1]
    assert unpermute is not None
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_uniform_varlen_is_a_view_and_equals_the_mask(monkeypatch, window):
    """Consecutive sequences of one length (two groups here) need no gather or scatter; same values and grads."""
    monkeypatch.setattr(attention_module, "VARLEN_GROUP_TOKENS", 12)
    lengths = [4] * 5
    q, k, v = (x.requires_grad_() for x in _qkv(sum(lengths)))
    meta = AttentionMetadata.packed(lengths, window=window)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=varlen_mask(meta), enable_gqa=True)
    got = sdpa_varlen(q, k, v, meta)
    groups, unpermute = meta.cache["varlen_plan"]
    assert [(index, G) for index, _, G, _, _, _ in groups] == [(slice(0, 12), 3), (slice(12, 20), 2)]
    assert unpermute is None
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_flex_varlen_agrees_with_portable(window):
    """FlexAttention's document mask (the GPU fast path). torch 2.13 runs it on CPU forward-only, eagerly."""
    lengths = [5, 2, 12, 1, 3, 6]
    q, k, v = _qkv(sum(lengths))
    meta = AttentionMetadata.packed(lengths, window=window)
    with torch.no_grad():
        torch.testing.assert_close(flex_varlen(q, k, v, meta), sdpa_varlen(q, k, v, meta), atol=1e-5, rtol=0)


# Shared prefixes: a prompt (sequence 0, 2) once, then responses that continue it (1, 3, 4 after 0; 5 after 2).
SHARED = ([6, 3, 9, 1, 4, 2, 5], [-1, 0, -1, 0, 0, 2, -1])


@pytest.mark.parametrize("window", [None, 4])
def test_shared_prefix_varlen_equals_the_mask_and_separate_sequences(monkeypatch, window):
    """Each response attends to its whole prompt, then causally to itself: equal to the dense reference mask
    (values and grads), and each response's outputs equal those of prompt + response as one separate sequence."""
    monkeypatch.setattr(attention_module, "VARLEN_GROUP_TOKENS", 24)  # several groups
    lengths, prefix = SHARED
    q, k, v = (x.requires_grad_() for x in _qkv(sum(lengths)))
    meta = AttentionMetadata.packed(lengths, window=window, prefix=prefix)
    cu = meta.cu_seqlens.tolist()
    assert meta.positions[0].tolist()[cu[1]:cu[2]] == [6, 7, 8] and meta.max_seqlen == 11
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=varlen_mask(meta), enable_gqa=True)
    got = sdpa_varlen(q, k, v, meta)
    assert len(meta.cache["varlen_plan"][0]) > 1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for s, p in enumerate(prefix):  # independent reference: the unshared sequence parent + own
        if p < 0:
            continue
        cols = list(range(cu[p], cu[p + 1])) + list(range(cu[s], cu[s + 1]))
        alone = AttentionMetadata.packed([len(cols)], window=window)
        ref = sdpa_varlen(*(x[:, :, cols] for x in (q, k, v)), alone)
        torch.testing.assert_close(got[:, :, cu[s]:cu[s + 1]], ref[:, :, cu[p + 1] - cu[p]:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_flex_varlen_with_shared_prefix_agrees_with_portable(window):
    lengths, prefix = SHARED
    q, k, v = _qkv(sum(lengths))
    meta = AttentionMetadata.packed(lengths, window=window, prefix=prefix)
    with torch.no_grad():
        torch.testing.assert_close(flex_varlen(q, k, v, meta), sdpa_varlen(q, k, v, meta), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefix", [[-1, 1], [0, -1], [-1, 0, 1], [-1]])
def test_bad_prefix_is_refused(prefix):
    with pytest.raises(ValueError, match="prefix"):
        AttentionMetadata.packed([2, 3, 4][:max(len(prefix), 2)], prefix=prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "flash_attn"])
def test_fused_varlen_forward_backward_agree_on_gpu(backend):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    lengths = [50, 7, 130, 1, 64]
    q, k, v = (x.cuda().to(torch.bfloat16).requires_grad_() for x in _qkv(sum(lengths), D=16))  # compiled flex: D >= 16
    meta = AttentionMetadata.packed(lengths, "cuda", backend=backend)
    out = attention_module.VARLEN_BACKENDS[backend](q, k, v, meta)
    want = sdpa_varlen(q, k, v, AttentionMetadata.packed(lengths, "cuda"))
    torch.testing.assert_close(out, want, atol=2e-2, rtol=0)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, q, g)[0], torch.autograd.grad(want, q, g)[0], atol=5e-2,
                               rtol=0)


def test_logprob_chunk_tokens_are_chosen_per_device(monkeypatch):
    """`train.logprob_chunk_tokens` 0 (the default) is chosen by the platform: 512 rows on CPU, more on a
    (simulated) GPU, for the trainer, the reference and preflight's memory model; an explicit value is kept."""
    from twinplane.config import ConfigError, load_config
    from twinplane.model import Transformer
    from twinplane.run.preflight import memory_inputs
    from twinplane.train.trainer import Reference

    model, auto, fixed = tiny_model(), TrainSection(), TrainSection(logprob_chunk_tokens=64)
    assert auto.logprob_chunk_tokens == 0
    with pytest.raises(ConfigError, match=r"^train\.logprob_chunk_tokens: must be >= 0"):
        load_config(overrides=["train.logprob_chunk_tokens=-1"])

    def chosen(train: TrainSection) -> tuple[int, int]:
        return Trainer(model, train, ALGO, 1.0, 10).chunk_tokens, Reference(model, 1.0, 4, train=train).chunk_tokens

    assert chosen(auto) == (512, 512) and chosen(fixed) == (64, 64)
    assert memory_inputs(load_config(), "cpu")[1].logprob_chunk_tokens == 512
    hardware.reset()
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    try:
        on_gpu = type("W", (), {"device": torch.device("cuda"), "dtype": torch.float32})()
        monkeypatch.setattr(Transformer, "output_weight", lambda self: on_gpu)  # the model as if on the GPU
        assert chosen(auto) == (backends.GPU_LOGPROB_CHUNK_TOKENS,) * 2 and backends.GPU_LOGPROB_CHUNK_TOKENS > 512
        assert chosen(fixed) == (64, 64)
        assert memory_inputs(load_config(), "cuda")[1].logprob_chunk_tokens == backends.GPU_LOGPROB_CHUNK_TOKENS
        assert memory_inputs(load_config(overrides=["train.logprob_chunk_tokens=64"]),
                             "cuda")[1].logprob_chunk_tokens == 64
    finally:
        hardware.reset()


@pytest.mark.parametrize("gpu,hip", [("NVIDIA H100 80GB HBM3", None), ("AMD Instinct MI300X", "6.2")])
def test_one_precision_policy_for_1_and_n_ranks(monkeypatch, gpu, hip):
    """On a simulated GPU, the single-rank Trainer and the FSDP2 shards of 2 ranks pick one policy: fp32 master
    weights, bf16 compute, fp32 reductions; `train.compute_dtype` overrides both; CPU stays fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import twinplane.train.fsdp as fsdp_module
    from twinplane.model import Transformer

    model = tiny_model()
    assert runtime.train_precision(torch.device("cpu"), torch.float32) == runtime.Precision(torch.float32,
                                                                                               torch.float32)
    assert isinstance(runtime.autocast(runtime.train_precision("cpu", torch.float32), "cpu"), nullcontext)
    hardware.reset()
    simulate_gpu(monkeypatch, gpu, hip=hip, count=2)
    try:
        on_gpu = type("W", (), {"device": torch.device("cuda"), "dtype": torch.float32})()
        monkeypatch.setattr(Transformer, "output_weight", lambda self: on_gpu)  # the model as if on the GPU
        policies = []
        monkeypatch.setattr(fsdp_module, "fully_shard", lambda m, **k: policies.append(k["mp_policy"]))
        monkeypatch.setattr(fsdp_module, "FSDPModule", type("NotFSDP", (), {}))
        for compute, want in (("auto", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16)):
            one_rank = Trainer(model, TrainSection(compute_dtype=compute), ALGO, 1.0, 10).precision  # 1 rank
            policies.clear()
            fsdp_module.shard_model(model, compute_dtype=compute)  # what each of N ranks applies
            assert one_rank == runtime.Precision(torch.float32, want, torch.float32)
            mixed = MixedPrecisionPolicy(param_dtype=want, reduce_dtype=torch.float32) if want != torch.float32 \
                else MixedPrecisionPolicy()
            assert policies == [mixed] * (model.config.num_layers + 1), compute
        assert backends.varlen_backend(torch.device("cuda"), torch.bfloat16) == "flex"  # flash_attn not installed
        monkeypatch.setattr(hardware, "has_module", lambda m: m == "flash_attn")
        hardware.reset()
        assert backends.varlen_backend(torch.device("cuda"), torch.bfloat16) == "flash_attn"
        assert backends.varlen_backend(torch.device("cuda"), torch.float32) == "flex"  # flash-attn is 16-bit only
        assert backends.varlen_backend(torch.device("cpu"), torch.bfloat16) == "sdpa"
        # compiled flex refuses head dims below 16 (seen on an H200): the portable path serves them
        assert backends.varlen_backend(torch.device("cuda"), torch.float32, head_dim=8) == "sdpa"
    finally:
        hardware.reset()


def test_bf16_compute_on_cpu_trains_under_autocast():
    """`train.compute_dtype=bfloat16` over fp32 weights runs the forward in bf16 (also on CPU): close to fp32,
    not equal, and the master weights and grads stay fp32."""
    batch = make_batch(tiny_model(), n=4)
    lps = {}
    for compute in ("float32", "bfloat16"):
        model = tiny_model()
        trainer = Trainer(model, TrainSection(lr=1e-3, compute_dtype=compute), ALGO, 1.0, 10)
        lps[compute] = trainer.logprobs(batch)
        trainer.train_step(batch)
        assert all(p.dtype == torch.float32 for p in model.parameters())
    diff = (lps["float32"] - lps["bfloat16"]).abs().max()
    assert 0 < diff < 0.1, diff

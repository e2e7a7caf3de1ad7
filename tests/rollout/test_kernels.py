"""The Triton kernels of the rollout engine's decode path (twinplane.rollout.kernels) against their torch references
and a brute-force attention, on odd shapes; then the whole engine with kernels=triton against the torch path. Without a
GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by conftest), with a GPU on the
GPU. The interpreter is slow, so shapes are tiny."""

import copy
import math

import pytest
import torch

pytest.importorskip("triton")

from conftest import EOS, PROMPTS, assert_same, on_device, paged_case, run_paged, static_case, tiny_model  # noqa: E402

from twinplane.model import ModelConfig, Transformer  # noqa: E402
from twinplane.rollout import (  # noqa: E402
    RolloutEngine,
    SamplingParams,
    kernels,  # noqa: E402
)
from twinplane.rollout.kernels import paged_decode as paged_decode_module  # noqa: E402
from twinplane.rollout.kernels.activation import silu_mul, silu_mul_torch  # noqa: E402
from twinplane.rollout.kernels.norm import rms_norm, rms_norm_torch  # noqa: E402
from twinplane.rollout.kernels.paged_decode import MAX_SPLITS, num_splits, paged_decode, paged_decode_torch  # noqa: E402
from twinplane.rollout.kernels.rope import rope_write, rope_write_torch  # noqa: E402
from twinplane.rollout.kernels.sampler import sample_tokens, sample_tokens_torch  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def brute_decode(q, k_cache, v_cache, tables, lens, window, scale=None, softcap=None, sinks=None):
    """Attention of each sequence's one query over its listed tokens, in float64, one head at a time (scores
    scaled, tanh soft-capped, and a sink logit per head in the denominator, where given)."""
    B, H, D = q.shape
    _, bs, H_kv, _ = k_cache.shape
    keys, vals = k_cache.flatten(0, 1).double(), v_cache.flatten(0, 1).double()
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        ctx = int(lens[b])
        lo = max(0, ctx - window) if window else 0
        slots = [int(tables[b, p // bs]) * bs + p % bs for p in range(lo, ctx)]
        for h in range(H):
            kv = h // (H // H_kv)
            scores = keys[slots, kv] @ q[b, h].double() * (scale or 1 / math.sqrt(D))
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].double().view(1)])
            w = torch.softmax(scores, 0)[:len(slots)]
            out[b, h] = w @ vals[slots, kv]
    return out


def decode_case(group, kv_heads, bs, D, lens, seed=0, dtype=torch.float32):
    """A pool of `bs`-token blocks whose last block is the static decode's reserved one; each sequence of
    context lens[b] gets its own shuffled blocks, and a context of 1 marks a padding row (its table: the reserved
    block only, as in the static decode)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // bs) for c in lens)
    N = len(lens) * width + 1
    k, v = (torch.randn(N, bs, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    perm, pad = torch.randperm(N - 1, generator=g).tolist(), N - 1
    tables = [perm[b * width:(b + 1) * width] if c > 1 else [pad] * width for b, c in enumerate(lens)]
    q = torch.randn(len(lens), group * kv_heads, D, generator=g).to(dtype)
    return (q.to(DEV), k.to(DEV), v.to(DEV), torch.tensor(tables, dtype=torch.int32, device=DEV),
            torch.tensor(lens, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize(("group", "kv_heads", "bs", "D", "lens", "window", "splits"), [
    (7, 2, 16, 24, [1, 37, 16, 50], None, 1),  # Qwen2.5's 7 query heads per KV head, a head dim below the tile
    (7, 2, 16, 24, [1, 37, 16, 50], None, 3),  # many splits: short sequences leave some of theirs empty
    (8, 1, 16, 16, [45, 1, 19], 20, 4),  # a power-of-two group (one full tile), a sliding window
    (1, 3, 128, 16, [200, 1, 129], None, 2),  # no GQA; the flex pools' 128-token blocks
    (1, 3, 128, 16, [200, 1, 129], 70, 1),  # a window whose first block is partial
])
def test_paged_decode_equals_brute_force(group, kv_heads, bs, D, lens, window, splits):
    q, k, v, tables, ctx = decode_case(group, kv_heads, bs, D, lens)
    want = brute_decode(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), ctx.cpu(), window)
    got = paged_decode(q, k, v, tables, ctx, window, splits=splits)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(paged_decode_torch(q, k, v, tables, ctx, window).cpu().double(), want, atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(("scale", "softcap", "sinks"), [
    (0.3, None, False),  # Gemma's query_pre_attn_scalar
    (None, 2.0, False),  # Gemma 2's attention soft-cap (2: most scores are capped)
    (None, None, True),  # GPT-OSS's sinks
    (0.3, 2.0, True),
])
def test_paged_decode_scale_softcap_and_sinks_equal_brute_force(scale, softcap, sinks, splits):
    q, k, v, tables, ctx = decode_case(7, 2, 16, 24, [1, 37, 16, 50], seed=4)
    s = torch.randn(14, generator=torch.Generator().manual_seed(5)).to(DEV) * 3 if sinks else None
    want = brute_decode(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), ctx.cpu(), 20, scale, softcap,
                        None if s is None else s.cpu())
    got = paged_decode(q, k, v, tables, ctx, 20, splits=splits, scale=scale, softcap=softcap, sinks=s)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(paged_decode_torch(q, k, v, tables, ctx, 20, scale, softcap, s).cpu().double(), want,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_n, splits", [(16, 1), (64, 2), (128, 3)])
def test_paged_decode_tiles_of_any_size(block_n, splits):
    """Stage 1's tile (`block_n` tokens, the probe's sweep) changes the launch, not the result: contexts shorter
    than a tile, across several, and split at tile boundaries."""
    q, k, v, tables, ctx = decode_case(7, 2, 16, 64, [5, 130, 47])
    want = brute_decode(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), ctx.cpu(), None)
    got = paged_decode(q, k, v, tables, ctx, splits=splits, block_n=block_n, num_warps=2)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=0)


def test_paged_decode_in_bf16():
    """bf16 pools take the tensor-core products (on CPU the interpreter's fp32 ones, and its truncating casts)."""
    q, k, v, tables, ctx = decode_case(7, 2, 16, 64, [33, 1, 48], dtype=torch.bfloat16)
    want = brute_decode(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), ctx.cpu(), None)
    for splits in (1, 2):
        got = paged_decode(q, k, v, tables, ctx, splits=splits)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-2, rtol=0)


def test_split_count_is_fixed_by_host_integers(monkeypatch):
    """The split count depends on the batch (a graph bucket), the KV heads and the table width only, so a captured
    decode replays the count it was captured with; at Qwen2.5-0.5B's shape on an H200 (132 SMs, 2 KV heads, 640
    tokens) small batches split and full ones do not."""
    monkeypatch.setattr(paged_decode_module, "_sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert [num_splits(b, 2, 640, gpu) for b in (1, 8, 128, 512)] == [10, 10, 2, 1]  # (640 / 64 = 10 at most)
    assert num_splits(1, 1, 100_000, gpu) == MAX_SPLITS and num_splits(1, 1, 30, gpu) == 1  # one tile: one split


def test_triton_backend_equals_portable_on_a_mixed_row():
    """Through `paged_attention`: the decodes read the pool in the kernel, the prefill chunk and the fresh prompts
    keep the portable path, and the new k/v land in the same slots."""
    case = on_device(paged_case(None, 16), DEV)
    (got, got_pool), (want, want_pool) = run_paged(case, "triton"), run_paged(case, "sdpa")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got_pool.k_cache, want_pool.k_cache)


@pytest.mark.parametrize("window", [None, 21])
def test_triton_backend_in_the_static_decode(window, monkeypatch):
    """Five decodes and two padding rows on the reserved block, fixed-width tables; on a GPU also no host reads
    (the static decode is captured as a graph)."""
    case = on_device(static_case(16, window), DEV)
    torch.testing.assert_close(run_paged(case, "triton")[0], run_paged(case, "sdpa")[0], atol=1e-5, rtol=0)
    if DEV.type == "cpu":  # (the interpreter copies its arguments to the host: the check is the GPU's)
        return
    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, n=name: pytest.fail(f"host read in the static decode: {n}"))
    run_paged(case, "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual_add(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 3, 37, generator=g).to(DEV, dtype) for _ in range(2))
    w = torch.randn(37, generator=g).to(DEV, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # (bf16: the interpreter truncates where GPUs round)
    y, s = rms_norm(x, w, 1e-6, r)
    y0, s0 = rms_norm_torch(x, w, 1e-6, r)
    assert y.shape == x.shape and y.dtype == y0.dtype
    torch.testing.assert_close(s, s0, atol=tol, rtol=tol)
    torch.testing.assert_close(y, y0, atol=tol, rtol=tol)
    rows = torch.randn(6, 80, generator=g).to(DEV, dtype)[:, 20:57]  # a view with a row stride
    torch.testing.assert_close(rms_norm(rows, w, 1e-5), rms_norm_torch(rows, w, 1e-5), atol=tol, rtol=tol)


def test_silu_mul_reads_the_halves_of_a_stacked_gemm():
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(2, 7, 100, generator=g).to(DEV)
    gate, up = stacked.chunk(2, dim=-1)  # [2, 7, 50] views, row stride 100
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_torch(gate, up), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["stacked", "apart", "bias"])
def test_mlp_adds_into_the_residual_in_its_down_gemm(variant):
    """`TritonMLP.add_to` = residual + the MLP (the add inside the down projection's GEMM, in place), with gate/up
    stacked or apart; a down projection with a bias adds after it (the residual left as it was)."""
    from twinplane.model.blocks import MLP
    from twinplane.rollout.kernels.layers import TritonMLP, stack

    torch.manual_seed(0)
    mlp = MLP(64, 96, bias=variant == "bias").to(DEV)
    x, residual = torch.randn(1, 5, 64, device=DEV), torch.randn(1, 5, 64, device=DEV)
    with torch.no_grad():
        want = residual + mlp(x)
        mlp.__class__ = TritonMLP
        mlp.stacked = stack(mlp, ("gate_proj", "up_proj")) if variant != "apart" else None
        before = residual.clone()
        got = mlp.add_to(residual, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got.data_ptr() == residual.data_ptr()) == (variant != "bias")
    if variant == "bias":
        assert torch.equal(residual, before)


def test_rope_write_equals_rope_and_the_pool_write():
    """Odd head counts (7 query heads, 3 KV heads), positions out of order, slots in several blocks; the rest of
    the pool is untouched."""
    g = torch.Generator().manual_seed(0)
    T, H, H_kv, hd, N, bs = 5, 7, 3, 12, 4, 4
    q, k, v = (torch.randn(T, h, hd, generator=g).to(DEV) for h in (H, H_kv, H_kv))
    inv = 1.0 / 1e4 ** (torch.arange(0, hd, 2).double() / hd)
    freqs = torch.tensor([3.0, 0.0, 9.0, 4.0, 11.0]).double()[:, None] * inv
    cos, sin = (f(torch.cat((freqs, freqs), -1)).float().to(DEV) for f in (torch.cos, torch.sin))
    slots = torch.tensor([2, 7, 11, 0, 13], device=DEV)
    pools = [torch.randn(N, bs, H_kv, hd, generator=g).to(DEV) for _ in range(2)]
    mine = [p.clone() for p in pools]
    got = rope_write(q, k, v, cos, sin, *mine, slots)
    want = rope_write_torch(q, k, v, cos, sin, *pools, slots)
    for a, b in zip([*got, *mine], [*want, *pools], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def mid_interval_uniforms(x, banned, rows, g):
    """Per row a token with some mass under softmax(x) (banned ids out in `rows`) and the uniform at the middle of
    its CDF step, in float64: any correct inverse CDF picks that token, whatever order it sums in."""
    x = x.double().clone()
    x[rows[:, None] & torch.isin(torch.arange(x.shape[1]), banned)[None]] = float("-inf")
    p = torch.softmax(x, -1)
    cdf = p.cumsum(-1)
    want = torch.stack([torch.multinomial((r > 1e-4).double(), 1, generator=g)[0] for r in p])
    u = (cdf.gather(1, want[:, None])[:, 0] - p.gather(1, want[:, None])[:, 0] / 2) / cdf[:, -1]
    return want, u.float()


@pytest.mark.parametrize("V", [50, 3 * 4096 + 17])  # one level; several chunks and a ragged last one
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_sampler_equals_the_engines(V, temperature):
    """Tokens and policy log-probs as the engine's torch sampler gives them, stop tokens banned in some rows."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(4, V, generator=g) * 3
    banned, rows = torch.tensor([1, 3, 7, 20]), torch.tensor([True, False, True, False])
    logits[:, banned] += 6  # (the banned tokens would be likely)
    want, u = mid_interval_uniforms(logits / (temperature or 1.0), banned, rows, g)
    if temperature == 0:
        want = torch.where(rows[:, None] & torch.isin(torch.arange(V), banned), float("-inf"), logits).argmax(-1)
    args = (logits.to(DEV), temperature, u.to(DEV), banned.to(DEV), rows.to(DEV))
    tok, logp = sample_tokens(*args)
    ref_tok, ref_logp = sample_tokens_torch(*args)
    assert tok.tolist() == ref_tok.tolist() == want.tolist()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    tok, _ = sample_tokens(logits.to(DEV).bfloat16(), temperature, u.to(DEV))  # 16-bit logits, read as they are
    assert tok.tolist() == sample_tokens_torch(logits.to(DEV).bfloat16(), temperature, u.to(DEV))[0].tolist()


def test_sampler_never_chooses_a_token_without_mass():
    """u = 0 takes the first token with mass, u just below 1 the last one (also when u x total rounds up to the
    total), over one chunk and over several."""
    for V in (50, 2 * 4096 + 5):
        logits = torch.full((3, V), float("-inf"))
        logits[:, [4, 9, V - 3]] = torch.tensor([0.5, 2.0, 1.0])
        u = torch.tensor([0.0, 1 - 2**-24, 0.999999])
        tok, logp = sample_tokens(logits.to(DEV), 1.0, u.to(DEV))
        assert tok.tolist() == [4, V - 3, V - 3]
        assert torch.isfinite(logp).all()


def test_sampler_picks_in_any_chunk():
    """The chosen chunk first, middle or last (the chunks after it are not read): the token whose CDF step holds u."""
    V, where = 3 * 4096 + 17, [10, 5000, 3 * 4096 + 3]
    logits = torch.full((3, V), float("-inf"))
    logits[:, where] = 0.0  # three equal masses
    u = torch.tensor([1 / 6, 1 / 2, 5 / 6])  # the middle of each one's step
    tok, logp = sample_tokens(logits.to(DEV), 1.0, u.to(DEV))
    assert tok.tolist() == where
    torch.testing.assert_close(logp.cpu(), torch.full((3,), -math.log(3)))


def test_greedy_takes_the_first_maximum_across_chunks():
    """Greedy rows: the first of equal maxima, also when they lie in different chunks (each chunk's own argmax,
    then the row's), and a banned maximum is passed over in the banned row only."""
    V = 3 * 4096 + 17
    logits = torch.zeros(3, V)
    logits[:, [5000, 9000, 3 * 4096 + 1]] = 2.0
    logits[:, 100] = 3.0  # banned, in the first row only
    tok, logp = sample_tokens(logits.to(DEV), 0.0, torch.zeros(3, device=DEV), torch.tensor([100], device=DEV),
                              torch.tensor([True, False, False], device=DEV))
    assert tok.tolist() == [5000, 100, 100]
    torch.testing.assert_close(logp.cpu(), torch.log_softmax(logits, -1)[range(3), tok.cpu()])


@pytest.mark.parametrize("block, warps", [(256, 2), (4096, 8)])
def test_sampler_launch_settings_change_nothing(block, warps):
    """Loads of another width (the probe's sweep) sum in another order: the same tokens from mid-step uniforms."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3 * 4096 + 17, generator=g) * 3
    want, u = mid_interval_uniforms(logits, torch.tensor([1]), torch.zeros(4, dtype=torch.bool), g)
    tok, logp = sample_tokens(logits.to(DEV), 1.0, u.to(DEV), block=block, num_warps=warps)
    assert tok.tolist() == want.tolist()
    torch.testing.assert_close(logp, sample_tokens(logits.to(DEV), 1.0, u.to(DEV))[1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="power of two"):
        sample_tokens(logits.to(DEV), 1.0, u.to(DEV), block=3000)


def test_self_check_passes_here_and_catches_a_wrong_kernel(monkeypatch):
    assert kernels.self_check(DEV, torch.float32) is None
    monkeypatch.setattr(paged_decode_module, "paged_decode", lambda *a, **k: paged_decode(*a, **k) + 1e-3)
    assert kernels.self_check(DEV, torch.float32) == "paged decode attention, window None, 1 split(s)"


@pytest.mark.parametrize(("mode", "over", "sp"), [
    ("eager", {}, SamplingParams(temperature=0, max_new_tokens=6)),  # GQA 2, untied head
    ("static", {"model_type": "qwen3", "qk_norm": True, "sliding_window": 5, "tie_word_embeddings": True},
     SamplingParams(temperature=0.8, max_new_tokens=6, min_new_tokens=2, n=2, seed=3)),
])
def test_engine_with_triton_kernels_equals_the_torch_path(mode, over, sp):
    """Greedy (and seeded) tokens and their log-probs through the whole decode path: every norm, the MLP
    activation, rope with the KV write, paged attention and the sampler in Triton ("static": the graph path's
    fixed buffers and padded buckets; seeded with forks and stop tokens banned in the early rows)."""
    model = tiny_model(**over).to(DEV)
    engines = {k: RolloutEngine(copy.deepcopy(model), eos_token_id=EOS, kernels=k) for k in ("triton", "torch")}
    for e in engines.values():
        e.graph_backend = mode
    tri = engines["triton"]
    assert (tri.kernels, tri.backend, tri.block_size) == ("triton", "triton", 16)
    assert type(tri.model.model.layers[0]).__name__ == "TritonDecoderLayer"
    assert_same(tri.generate(PROMPTS, sp), engines["torch"].generate(PROMPTS, sp), atol=1e-5)
    assert (tri.pop_metrics()["rollout/engine_steps_graphed"] > 0) == (mode == "static")


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_soft_capped_and_sink_layers_decode_in_the_triton_kernel(family, mode, monkeypatch):
    """Gemma 2 (score scale and soft-cap, alternating windows) and GPT-OSS (sinks, experts) decode through the
    Triton paged decode and sample as the torch path does."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=5)
    hf = (transformers.Gemma2Config(**sizes, attn_logit_softcapping=3.0, query_pre_attn_scalar=8)
          if family == "gemma2" else transformers.GptOssConfig(**sizes, num_local_experts=4, num_experts_per_tok=2))
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(hf.to_dict()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.15 if p.ndim >= 2 else 1.0) if p.ndim >= 2 or name.endswith("sinks") else None
    calls = []
    real = paged_decode_module.paged_decode
    monkeypatch.setattr(paged_decode_module, "paged_decode", lambda *a, **k: calls.append(k) or real(*a, **k))
    engines = {k: RolloutEngine(copy.deepcopy(model).to(DEV), eos_token_id=EOS, kernels=k) for k in ("triton", "torch")}
    for e in engines.values():
        e.graph_backend = mode
    sp = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=1)
    assert_same(engines["triton"].generate(PROMPTS, sp), engines["torch"].generate(PROMPTS, sp), atol=1e-5)
    key = "softcap" if family == "gemma2" else "sinks"
    assert calls and all(k[key] is not None for k in calls)  # (every layer caps, or has sinks)


def test_stacked_projections_follow_weights_loaded_in_place():
    """The Triton side's q/k/v and gate/up GEMMs read one stacked weight each, of which the per-projection
    parameters are views: a weight sync in place lands in it (the engine then equals the torch path's on the new
    weights), names and state dict are unchanged, and LoRA-adapted projections keep their own GEMMs."""
    from twinplane.model.lora import apply_lora
    from twinplane.rollout.kernels.layers import stack

    a, b = tiny_model(seed=0).to(DEV), tiny_model(seed=1).to(DEV)
    engines = {k: RolloutEngine(copy.deepcopy(a), eos_token_id=EOS, kernels=k) for k in ("triton", "torch")}
    attn, mlp = engines["triton"].model.model.layers[0].self_attn, engines["triton"].model.model.layers[0].mlp
    w, _ = attn.stacked
    src = a.model.layers[0].self_attn
    assert torch.equal(w, torch.cat([src.q_proj.weight, src.k_proj.weight, src.v_proj.weight]))
    assert attn.q_proj.weight.data_ptr() == w.data_ptr() and mlp.stacked is not None
    assert engines["triton"].model.state_dict().keys() == a.state_dict().keys()
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    for e in engines.values():
        e.load_weights(b.named_parameters())
    assert torch.equal(attn.stacked[0][-attn.v_proj.out_features:], b.model.layers[0].self_attn.v_proj.weight)
    assert_same(engines["triton"].generate(PROMPTS, greedy), engines["torch"].generate(PROMPTS, greedy), atol=1e-5)
    adapted = copy.deepcopy(a)
    apply_lora(adapted, rank=2, alpha=4.0)
    adapted = adapted.model.layers[0].self_attn
    before = adapted.q_proj.weight
    assert stack(adapted, ("q_proj", "k_proj", "v_proj")) is None and adapted.q_proj.weight is before

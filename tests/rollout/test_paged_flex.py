"""The "flex" paged backend (FlexAttention reading the KV pool in place for the decodes) against the portable gather
+ SDPA path, itself checked against dense SDPA per sequence in test_paged_engine. On CPU flex runs torch's eager
reference, which ignores the BlockMask's block lists and applies the mask_mod to the whole pool; the lists (what
the GPU kernels read) are checked on their own by `attend_listed_blocks`."""

import copy
import shutil

import pytest
import torch
from conftest import EOS, PROMPTS, assert_same, paged_case, run_paged, static_case, tiny_model

from twinplane.model.attention import _FLEX
from twinplane.rollout import RolloutEngine, SamplingParams

WINDOWS = [None, 3, "bs+5"]  # "bs+5": a window whose first block is partial with full blocks after it


@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group", [2, 7])  # query heads per KV head (Qwen2.5's 7: flex packs them as query rows)
def test_flex_equals_portable_on_a_mixed_row(bs, window, group):
    case = paged_case(bs + 5 if window == "bs+5" else window, bs)
    q, k = case[:2]  # new queries with `group` heads per KV head
    case = (torch.randn(1, k.shape[1] * group, *q.shape[2:], generator=torch.Generator().manual_seed(2)), *case[1:])
    (flex, flex_pool), (portable, portable_pool) = run_paged(case, "flex"), run_paged(case, "sdpa")
    torch.testing.assert_close(flex, portable, atol=1e-5, rtol=0)
    assert torch.equal(flex_pool.k_cache, portable_pool.k_cache)  # the new k/v went to the same slots


@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("window", WINDOWS)
def test_flex_equals_portable_in_the_static_decode(bs, window, monkeypatch):
    case = static_case(bs, bs + 5 if window == "bs+5" else window)
    torch.testing.assert_close(run_paged(case, "flex")[0], run_paged(case, "sdpa")[0], atol=1e-5, rtol=0)
    # No host reads around the flex call (the pool write, the views, the BlockMask): on GPUs the static decode is
    # captured as a CUDA graph. (The call itself is stubbed: eager flex on CPU is torch's reference, not the kernel.)
    monkeypatch.setitem(_FLEX, "cpu", lambda q, k, v, block_mask: torch.zeros_like(q))
    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, n=name: pytest.fail(f"host read in the static decode: {n}"))
    run_paged(case, "flex")


def attend_listed_blocks(q, paged, window):
    """The decodes' outputs [H, d, D] as flex's GPU kernels compute them from the BlockMask: keys of the full
    blocks (`full_kv_indices`) without the mask_mod, keys of the partial blocks (`kv_indices`) where it holds,
    nothing else of the pool."""
    mask = paged.flex_block_mask(window)
    bs = paged.block_size
    keys, vals = paged.k_cache[0].flatten(0, 1), paged.v_cache[0].flatten(0, 1)  # [N * bs, H_kv, D]
    outs = []
    for b in range(paged.num_decodes):
        full = mask.full_kv_indices[b, 0, 0, :mask.full_kv_num_blocks[b, 0, 0]].tolist()
        part = mask.kv_indices[b, 0, 0, :mask.kv_num_blocks[b, 0, 0]].tolist()
        assert not set(full) & set(part) and len(set(full + part)) == len(full + part)
        slots = torch.tensor([blk * bs + i for blk in full + part for i in range(bs)])
        keep = torch.ones(len(slots), dtype=torch.bool)
        keep[len(full) * bs:] = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(0),
                                              slots[len(full) * bs:])
        slots = slots[keep]
        qb = q[0, :, b:b + 1][None]  # [1, H, 1, D]
        y = torch.nn.functional.scaled_dot_product_attention(qb, keys[slots].transpose(0, 1)[None],
                                                             vals[slots].transpose(0, 1)[None], enable_gqa=True)
        outs.append(y[0, :, 0])  # [H, D]
    return torch.stack(outs, 1)


@pytest.mark.parametrize("build", ["mixed", "static"])
@pytest.mark.parametrize("window", WINDOWS)
def test_block_mask_lists_what_the_kernels_must_read(build, window):
    bs = 16
    window = bs + 5 if window == "bs+5" else window
    case = paged_case(window, bs) if build == "mixed" else static_case(bs, window)
    portable, pool = run_paged(case, "sdpa")  # (also writes the new k/v into `pool`, as every layer does first)
    d = pool.num_decodes
    torch.testing.assert_close(attend_listed_blocks(case[0], pool, window), portable[0, :, :d], atol=1e-5, rtol=0)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU kernels need a C++ compiler")
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="inductor's AVX2 flex kernel also evaluates the mask_mod on lanes outside the listed blocks "
                    "(with indices past this test's block tables); the engine compiles flex on GPUs only")
@pytest.mark.parametrize("build", ["mixed", "static"])
def test_a_compiled_flex_kernel_reads_only_the_listed_blocks(build):
    """Inductor's CPU flex kernel, like the GPU ones, visits only the listed blocks and calls the mask_mod on the
    partial ones only. Here the mask_mod is right on partial blocks and wrong elsewhere (drops the keys of full
    blocks, keeps those of unlisted ones), so only a kernel that reads the lists as the GPU kernels do matches
    the portable path. (This CPU kernel also wants the index lists as wide as the pool: widened here.)"""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    bs = 16
    case = paged_case(bs + 5, bs) if build == "mixed" else static_case(bs, bs + 5)
    portable, pool = run_paged(case, "sdpa")
    d, N = pool.num_decodes, pool.k_cache.shape[1]
    q = case[0][0, :, :d].transpose(0, 1)  # [d, H, D]
    H, H_kv, D = q.shape[1], pool.k_cache.shape[3], q.shape[2]
    m = pool.flex_block_mask(bs + 5, H // H_kv)
    col = torch.arange(N)

    def widen(idx):  # [d, 1, 1, W] -> [d, 1, 1, N]
        return torch.cat([idx, idx[..., -1:].expand(d, 1, 1, N - idx.shape[-1])], -1)

    def blocks(num, idx):  # [d, N + 1] bool: the blocks of a list
        out = torch.zeros(d, N + 1, dtype=torch.bool)
        return out.scatter_(1, torch.where(col < num[:, 0, 0, None], idx[:, 0, 0].long(), N), True)

    kv_indices, full_kv_indices = widen(m.kv_indices), widen(m.full_kv_indices)
    partial, full = blocks(m.kv_num_blocks, kv_indices), blocks(m.full_kv_num_blocks, full_kv_indices)

    def wrong_off_partial_blocks(b, h, q_idx, kv_idx):
        blk = (kv_idx // bs).clamp(max=N)  # a vectorized kernel may evaluate columns past the pool: "unlisted"
        return torch.where(partial[b, blk], m.mask_mod(b, h, q_idx, kv_idx), ~full[b, blk])

    mask = BlockMask.from_kv_blocks(m.kv_num_blocks, kv_indices, m.full_kv_num_blocks, full_kv_indices,
                                    BLOCK_SIZE=m.BLOCK_SIZE,
                                    mask_mod=wrong_off_partial_blocks, seq_lengths=m.seq_lengths,
                                    compute_q_blocks=False)
    keys, vals = (x[0].flatten(0, 1).permute(1, 0, 2)[None] for x in (pool.k_cache, pool.v_cache))
    y = torch.compile(flex_attention, dynamic=False)(q.reshape(d, H_kv, H // H_kv, D), keys, vals, block_mask=mask)
    torch.testing.assert_close(y.reshape(d, H, D).transpose(0, 1), portable[0, :, :d], atol=1e-5, rtol=0)


def engine(model, backend, block_size, graphs="eager"):
    e = RolloutEngine(copy.deepcopy(model), eos_token_id=EOS)
    e.backend, e.block_size, e.graph_backend = backend, block_size, graphs
    return e


@pytest.mark.parametrize("graphs", ["eager", "static"])
@pytest.mark.parametrize("over", [{}, {"sliding_window": 4}])
def test_flex_engine_equals_portable_engine(graphs, over):
    model = tiny_model(**over)
    for sp in (SamplingParams(temperature=0, max_new_tokens=12, n=3),
               SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=7)):
        flex = engine(model, "flex", 128, graphs)
        got = flex.generate(PROMPTS, sp)
        assert_same(got, engine(model, "sdpa", 16).generate(PROMPTS, sp))
        assert (flex.pop_metrics()["rollout/engine_steps_graphed"] > 5) == (graphs == "static")
    assert len({tuple(s.token_ids) for s in got}) > 4  # sampled, not one sequence repeated


@pytest.mark.gpu  # compiled flex and CUDA/HIP graphs
def test_flex_engine_on_gpu_equals_portable_with_captured_graphs():
    model = tiny_model().cuda()
    for sp in (SamplingParams(temperature=0, max_new_tokens=16, n=3),
               SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=4)):
        flex = engine(model, "flex", 128, "cuda_graph")
        assert_same(flex.generate(PROMPTS, sp), engine(model, "sdpa", 16).generate(PROMPTS, sp), atol=1e-4)
        assert flex.graph_backend == "cuda_graph" and flex.pop_metrics()["rollout/engine_steps_graphed"] > 5

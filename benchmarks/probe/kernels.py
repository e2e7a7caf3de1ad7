"""Each Triton decode kernel against its torch reference at the decode shapes, with launch-setting sweeps."""

from __future__ import annotations

import torch

from twinplane.platform import backends

from .report import device_us
from .shapes import SHAPES


def kernels_section(a, device, dtype) -> dict:
    """Each Triton kernel against its torch reference at the decode shapes, per batch size."""
    out = {"shape": a.decode_shape, "context": a.context, "dtype": str(dtype), "block_size": backends.TRITON_PAGE_SIZE,
           "batches": {}}
    for B in a.kernel_batches:
        out["batches"][B] = kernel_batch(a, device, dtype, B)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def kernel_batch(a, device, dtype, B: int) -> dict:
    from twinplane.model import AttentionMetadata
    from twinplane.rollout.kernels.activation import silu_mul, silu_mul_torch
    from twinplane.rollout.kernels.norm import rms_norm, rms_norm_torch
    from twinplane.rollout.kernels.paged_decode import num_splits, paged_decode, paged_decode_torch
    from twinplane.rollout.kernels.rope import rope_write, rope_write_torch
    from twinplane.rollout.kernels.sampler import sample_tokens, sample_tokens_torch
    from twinplane.rollout.paged_attention import PagedKV, paged_attention

    shape, bs, ctx = SHAPES[a.decode_shape], backends.TRITON_PAGE_SIZE, a.context
    H, H_kv, D, hidden, inter = (shape[k] for k in ("num_heads", "num_kv_heads", "head_dim", "hidden_size",
                                                     "intermediate_size"))
    calls, reps = (20, a.reps) if device.type == "cuda" else (1, 1)
    g = torch.Generator().manual_seed(B)

    def rand(*size):
        return torch.randn(*size, generator=g).to(device, dtype)

    def us(fn) -> float:
        return device_us(fn, device, calls, reps)

    def sweep(launch, settings) -> dict:
        """Microseconds per launch setting (size, warps) as "size x warps", or why the launch failed (a tile
        too large for this device's shared memory)."""
        out = {}
        for n, w in settings:
            try:
                out[f"{n}x{w}"] = us(lambda n=n, w=w: launch(n, w))
            except Exception as e:
                out[f"{n}x{w}"] = f"{type(e).__name__}: {e}"[:300]
        return out

    def pair(tri, ref) -> dict:
        t, r = us(tri), us(ref)
        return {"triton_us": t, "torch_us": r, "speedup": r / t}

    def pool(bs: int):  # a KV pool of `bs`-token blocks, each sequence's blocks shuffled; its last-token slots
        per_seq = -(-ctx // bs)
        k, v = rand(B * per_seq + 1, bs, H_kv, D), rand(B * per_seq + 1, bs, H_kv, D)
        tables = torch.randperm(B * per_seq, generator=g).view(B, per_seq).to(device, torch.int32)
        return k, v, tables, (tables[:, -1].long() * bs + (ctx - 1) % bs).contiguous()

    k_pool, v_pool, tables, slots = pool(bs)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q, x, r, w, gate, up = rand(B, H, D), rand(B, hidden), rand(B, hidden), rand(hidden), rand(B, inter), rand(B, inter)
    qn, kn, vn, cos, sin = rand(B, H, D), rand(B, H_kv, D), rand(B, H_kv, D), rand(B, D), rand(B, D)
    res = {"paged_decode": pair(lambda: paged_decode(q, k_pool, v_pool, tables, lens, None, ctx),
                                lambda: paged_decode_torch(q, k_pool, v_pool, tables, lens))}
    res["paged_decode"] |= {"splits": num_splits(B, H_kv, ctx, device), "kv_bytes_per_s":
                            2 * B * ctx * H_kv * D * dtype.itemsize / (1e-6 * res["paged_decode"]["triton_us"])}
    res["paged_decode_by_splits_us"] = {s: us(lambda s=s: paged_decode(q, k_pool, v_pool, tables, lens, splits=s))
                                        for s in a.split_sweep}
    # stage 1's launch (tokens per tile, warps) at the split count the engine picks: "block_n x warps" -> us
    res["paged_decode_by_tile_us"] = sweep(lambda n, w: paged_decode(q, k_pool, v_pool, tables, lens, None, ctx,
                                                                     block_n=n, num_warps=w), a.tile_sweep)
    res["add_rms_norm"] = pair(lambda: rms_norm(x, w, 1e-6, r), lambda: rms_norm_torch(x, w, 1e-6, r))
    res["silu_mul"] = pair(lambda: silu_mul(gate, up), lambda: silu_mul_torch(gate, up))
    res["rope_write"] = pair(lambda: rope_write(qn, kn, vn, cos, sin, k_pool, v_pool, slots),
                             lambda: rope_write_torch(qn, kn, vn, cos, sin, k_pool, v_pool, slots))
    logits, u = rand(B, shape["vocab_size"]), torch.rand(B, generator=g).to(device)
    res["sampler"] = pair(lambda: sample_tokens(logits, 1.0, u), lambda: sample_tokens_torch(logits, 1.0, u))
    res["sampler_by_launch_us"] = sweep(lambda n, w: sample_tokens(logits, 1.0, u, block=n, num_warps=w),
                                        a.sampler_sweep)
    # one layer's paged attention as the static decode runs it (its pool write included), per backend
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, kn, vn))
    res["attention_layer_us"] = {}
    for backend in ("triton", "flex", "sdpa"):
        kb, vb, tb, sb = pool(backends.PAGED_BLOCK_SIZES[backend])  # (flex reads 128-token blocks)
        paged = PagedKV(kb[None], vb[None], sb, tb, lens, torch.arange(B + 1, device=device, dtype=torch.int32),
                        [1] * B, B, tb.shape[1] * kb.shape[1], static=True)
        meta = AttentionMetadata(torch.zeros(1, B, dtype=torch.long, device=device), backend=backend, paged=paged)
        try:
            res["attention_layer_us"][backend] = us(lambda meta=meta: paged_attention(q4, k4, v4, meta, 0))
        except Exception as e:  # flex may not compile here: the others still report
            res["attention_layer_us"][backend] = f"{type(e).__name__}: {e}"[:300]
    return res

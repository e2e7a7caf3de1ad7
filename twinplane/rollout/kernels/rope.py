"""Rotary embedding of q and k fused with the KV-cache write, in Triton: one program per token ropes its query and
key heads, writes its roped key and its value into the pool at its slot, and returns the roped q and k (the
prefill paths read k from the row). In torch this is ~10 elementwise kernels and two `index_copy_`s per layer.

Numerics as `twinplane.model.transformer.rope` (HF's rotate-half layout, `x * cos + rotate_half(x) * sin` in the
model's dtype): each product and the sum are rounded to the dtype as torch's kernels round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twinplane.model.blocks import rope


@triton.jit
def _rope_write(Q, K, V, Cos, Sin, Slots, QOut, KOut, KPool, VPool,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
                stride_qot, stride_qoh, stride_kot, stride_koh, stride_kps, stride_kph, stride_vps, stride_vph,
                H: tl.constexpr, H_KV: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    c1 = tl.load(Cos + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(Cos + t * stride_ct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(Sin + t * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(Sin + t * stride_st + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]

    # queries: out[:half] = x1 cos1 - x2 sin1, out[half:] = x2 cos2 + x1 sin2, each term rounded to the dtype
    hq = tl.arange(0, BLOCK_H)
    mq = (hq < H)[:, None] & d_ok[None, :]
    src = Q + t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    x1 = tl.load(src, mask=mq, other=0.0)
    x2 = tl.load(src + HALF, mask=mq, other=0.0)
    dt = x1.dtype
    a1, b1 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (-b1 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((b1 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    dst = QOut + t * stride_qot + hq[:, None] * stride_qoh + d[None, :]
    tl.store(dst, o1, mask=mq)
    tl.store(dst + HALF, o2, mask=mq)

    # keys: the same rotation, to the row and to the pool; values: to the pool
    slot = tl.load(Slots + t).to(tl.int64)
    hk = tl.arange(0, BLOCK_KV)
    mk = (hk < H_KV)[:, None] & d_ok[None, :]
    src = K + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    x1 = tl.load(src, mask=mk, other=0.0)
    x2 = tl.load(src + HALF, mask=mk, other=0.0)
    a1, b1 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (-b1 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((b1 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    dst = KOut + t * stride_kot + hk[:, None] * stride_koh + d[None, :]
    tl.store(dst, o1, mask=mk)
    tl.store(dst + HALF, o2, mask=mk)
    dst = KPool + slot * stride_kps + hk[:, None] * stride_kph + d[None, :]
    tl.store(dst, o1.to(KPool.dtype.element_ty), mask=mk)
    tl.store(dst + HALF, o2.to(KPool.dtype.element_ty), mask=mk)
    src = V + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    dst = VPool + slot * stride_vps + hk[:, None] * stride_vph + d[None, :]
    tl.store(dst, tl.load(src, mask=mk, other=0.0).to(VPool.dtype.element_ty), mask=mk)
    tl.store(dst + HALF, tl.load(src + HALF, mask=mk, other=0.0).to(VPool.dtype.element_ty), mask=mk)


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, hd], k and v [T, H_kv, hd], cos/sin [T, hd] (the model's, in its dtype), one layer's pool
    k/v_pool [N, block_size, H_kv, hd], slots [T] (pool slot of each token) -> roped q [T, H, hd] and k
    [T, H_kv, hd]; the roped keys and the values are written into the pool at `slots`."""
    T, H, hd = q.shape
    H_kv = k.shape[1]
    q_out = torch.empty(T, H, hd, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, H_kv, hd, dtype=k.dtype, device=k.device)
    kp, vp = k_pool.flatten(0, 1), v_pool.flatten(0, 1)  # [N * bs, H_kv, hd] views
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin, kp, vp)):
        raise ValueError("rope_write needs a unit stride along the head dim")
    if T:
        half = hd // 2
        _rope_write[(T,)](q, k, v, cos, sin, slots, q_out, k_out, kp, vp, q.stride(0), q.stride(1), k.stride(0),
                          k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), q_out.stride(0),
                          q_out.stride(1), k_out.stride(0), k_out.stride(1), kp.stride(0), kp.stride(1),
                          vp.stride(0), vp.stride(1), H=H, H_KV=H_kv, HALF=half,
                          BLOCK_H=triton.next_power_of_2(H), BLOCK_KV=triton.next_power_of_2(H_kv),
                          BLOCK_HALF=triton.next_power_of_2(half), num_warps=1 if H * hd <= 1024 else 2)
    return q_out, k_out


def rope_write_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """The reference: `rope` on q and k as the model applies it, and the pool write of `paged_attention`."""
    c, s = cos[:, None], sin[:, None]  # [T, 1, hd]
    q, k = rope(q, c, s), rope(k, c, s)
    k_pool.flatten(0, 1).index_copy_(0, slots, k)
    v_pool.flatten(0, 1).index_copy_(0, slots, v)
    return q, k

"""The paged layout of the attention seam: the rollout engine's row of prefill chunks and decodes over a KV pool.

One row [1, T] mixes one-token decodes and prefill chunks of many sequences whose earlier keys/values live in a
block pool; `PagedKV` says where each token's k/v goes and which blocks each sequence reads. Every layer hands its
q/k/v to `paged_attention`, which writes the new k/v into the pool at `slot_mapping`, then attends over each
sequence's blocks with the backend in `meta.backend` (chosen by `platform.backends.paged_attention_backend`):
- "sdpa" (portable, any device): gather each sequence's slots from the pool (one index_select per group), then
  SDPA: all decodes as one batched call, each prefill chunk on its own. Reads the context twice per layer.
  Prompts prefilled in one chunk (at the row's end: new admissions) need no gather: their keys are their own
  tokens, in the row, so they attend as packed sequences (`attention.sdpa_varlen`, batched by length).
- "flex" (GPUs with torch's FlexAttention, without flash-attn): the decode group reads the pool in place, one
  `flex_attention` call over the whole pool with a BlockMask built from the block tables (`flex_block_mask`).
  Prefill chunks keep the portable gather + SDPA: their cost is compute, not the gather.
- "triton" (GPUs, with the Triton kernels of twinplane.rollout.kernels): the decode group reads the pool in place, one
  paged decode kernel (GQA-grouped tiles, split-KV); prefill chunks as "flex".
- "flash" (GPUs with flash-attn): `flash_attn_varlen_func(..., block_table=...)` reads the pool in place.
Every fast path is tested against the portable one, and that against dense SDPA per sequence
(tests/rollout/test_paged_engine.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from twinplane.model.attention import AttentionMetadata, flex_attention_for, sdpa, sdpa_varlen

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from twinplane.rollout.recurrent_state import RecurrentStates

# The flex BlockMask's query tile. A decode's queries are the query heads sharing one KV head (`_flex_decodes`), at
# most a few dozen, but flex's kernels need the tile to be a multiple of their BLOCK_M (16 to 128 in torch 2.13);
# 128 is flex's default.
FLEX_Q_BLOCK = 128

Group = tuple[int, int, torch.Tensor, torch.Tensor | None]  # the portable path's gathers: see `PagedKV.plan`


@dataclass
class PagedKV:
    """Where the tokens of one paged forward come from and go to. The model reads only these tensors; the block
    pool's bookkeeping (free list, reference counts, copy-on-write) stays in twinplane.rollout.

    Sequence order: the first `num_decodes` sequences contribute one token each (decodes), the rest a prefill
    chunk each; token t of the row belongs to the sequence whose [cu_seqlens_q[s], cu_seqlens_q[s+1]) holds it.
    A physical block appears at most once in one sequence's table (the flex mask relies on it).
    """

    k_cache: torch.Tensor  # [L_kv, N, bs, H_kv, D] block pool (keys)
    v_cache: torch.Tensor  # [L_kv, N, bs, H_kv, D] block pool (values)
    slot_mapping: torch.Tensor  # [T] long: pool slot (block * bs + offset) each new token's k/v is written to
    block_tables: torch.Tensor  # [S, M] int32: blocks of each sequence in order (padded with any valid block)
    context_lens: torch.Tensor  # [S] int32: tokens of each sequence in the pool once this forward wrote its own
    cu_seqlens_q: torch.Tensor  # [S + 1] int32: query starts in the row
    query_lens: list[int]  # host copy of the query lengths (the portable path's loop bounds)
    num_decodes: int  # leading sequences with exactly one query token
    max_context: int  # longest context (fused kernels size their tiles by it)
    # Decode-only with fixed-width block tables (the rollout engine's static / graph-captured decode): the decode
    # group spans every table slot, masked by `context_lens` on the device: no host reads, no data-dependent shapes.
    static: bool = False
    # linear-attention layers: each sequence's recurrent state (twinplane.rollout.recurrent_state), at `states.slots`
    states: RecurrentStates | None = None
    # decoder layer -> its layer of the pools, where only some layers attend (`KVCache.index`; None: the same)
    kv_index: tuple[int, ...] | None = None
    # built once per forward, shared by every layer (per window: a model's layers may slide differently)
    _lens: list[int] | None = None  # host copy of context_lens (not in the static decode)
    _decodes: dict[int | None, Group] = field(default_factory=dict)  # portable path: the decode group's gathers
    _chunks: dict[int | None, list[Group]] = field(default_factory=dict)  # portable path: each prefill chunk's
    _fresh_start: int | None = None  # see `fresh_start`
    _fresh: dict[int | None, tuple[int, AttentionMetadata]] = field(default_factory=dict)  # see `fresh`
    _flex_mask: dict[tuple, BlockMask] = field(default_factory=dict)  # flex path: the decodes' BlockMask

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2]

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer `layer`'s key and value pools [N, bs, H_kv, D]."""
        at = layer if self.kv_index is None else self.kv_index[layer]
        return self.k_cache[at], self.v_cache[at]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               layer: int) -> torch.Tensor:
        """What every layer's `model.attention.attention` calls for this layout (`PagedLayout`)."""
        return paged_attention(q, k, v, meta, layer)

    def plan(self, window: int | None, decodes: bool = True) -> list[Group]:
        """(first query, last query + 1, key slots [G, S_k], mask [G, 1, Q, S_k] or None = causal, for the decode
        group all keys) per group: all decodes as one group (first; left out with `decodes=False`, for a path that
        reads them in place), each prefill chunk before `fresh_start` as its own."""
        d = self.num_decodes
        chunks = self._chunks.get(window)
        if chunks is None:
            chunks = self._chunks[window] = self._chunk_groups(window)
        if not (decodes and d):
            return chunks
        group = self._decodes.get(window)
        if group is None:
            group = self._decodes[window] = self._decode_group(window)
        return [group, *chunks]

    @property
    def fresh_start(self) -> int:
        """The first of the trailing sequences whose chunk is their whole context (a prompt prefilled in one
        chunk): they attend among their own tokens, which are in the row, so they need no gather from the pool."""
        if self._fresh_start is None:
            s = len(self.query_lens)
            if not self.static:  # (decode-only: no host reads)
                lens = self._host_lens()
                while s > self.num_decodes and self.query_lens[s - 1] == lens[s - 1]:
                    s -= 1
            self._fresh_start = s
        return self._fresh_start

    def fresh(self, window: int | None) -> tuple[int, AttentionMetadata] | None:
        """The trailing fresh prompts as packed sequences: (their first token in the row, their varlen metadata),
        None when there are none. `sdpa_varlen` batches them by length (a view of the row when lengths repeat)."""
        first = self.fresh_start
        if first == len(self.query_lens):
            return None
        if window not in self._fresh:
            lens = self.query_lens[first:]
            self._fresh[window] = sum(self.query_lens[:first]), AttentionMetadata.packed(
                lens, self.block_tables.device, window)
        return self._fresh[window]

    def _host_lens(self) -> list[int]:
        if self._lens is None:
            self._lens = self.context_lens.tolist()
        return self._lens

    def _decode_group(self, window: int | None) -> Group:
        d, bs, dev = self.num_decodes, self.block_size, self.block_tables.device
        lens = None if self.static else self._host_lens()[:d]
        width = self.block_tables.shape[1] * bs if lens is None else max(lens)
        slots = (self.block_tables[:d, :, None].long() * bs + torch.arange(bs, device=dev)).flatten(1)[:, :width]
        slots = slots.contiguous()  # (once here, not in every layer's gather)
        if lens is not None and min(lens) == width and (window is None or width <= window):
            return 0, d, slots, None  # every decode sees all `width` keys (sequences in lockstep): no mask
        k_pos = torch.arange(width, device=dev)[None]  # [1, S_k]
        ctx = self.context_lens[:d, None].long()
        mask = k_pos < ctx
        if window is not None:
            mask &= (ctx - 1 - k_pos) < window
        return 0, d, slots, mask[:, None, None]  # slots [d, S_k], mask [d, 1, 1, S_k]

    def _chunk_groups(self, window: int | None) -> list[Group]:
        d, bs, dev = self.num_decodes, self.block_size, self.block_tables.device
        groups, start = [], d
        for s in range(d, self.fresh_start):
            q_len, ctx = self.query_lens[s], self._host_lens()[s]
            slots = (self.block_tables[s, :, None].long() * bs + torch.arange(bs, device=dev)).flatten()[:ctx][None]
            mask = None
            if q_len != ctx or window is not None:  # a later chunk (earlier context in the pool) or a window
                q_pos = torch.arange(ctx - q_len, ctx, device=dev)[:, None]
                k_pos = torch.arange(ctx, device=dev)[None]
                m = k_pos <= q_pos
                if window is not None:
                    m &= (q_pos - k_pos) < window
                mask = m[None, None]
            groups.append((start, start + q_len, slots, mask))  # slots [1, ctx], mask [1, 1, q_len, ctx]
            start += q_len
        return groups

    def flex_block_mask(self, window: int | None, queries: int = 1) -> BlockMask:
        """The decode group's BlockMask over the whole pool seen as one sequence of N * bs keys, for `queries`
        query rows per decode (all at its last position), built on the device (no host reads: the static decode
        is captured as a CUDA graph).

        Decode b (context c, its query at position c - 1, keys from lo = max(0, c - window)) reads the physical
        blocks of its table's columns lo // bs .. (c - 1) // bs. The first of them when lo is not a block start
        and the last when partly filled are partial blocks (`kv_indices`, masked by the mask_mod); the ones
        between are full blocks (`full_kv_indices`, no mask_mod). flex_decoding reads both lists with the strides
        and width of `kv_indices`, so both are [d, 1, 1, W].

        The compiled kernels call the mask_mod on partial blocks only, but eager flex (CPU) ignores the lists and
        calls it on every key of the pool; so the mask_mod is exact everywhere: a key is kept when its block is
        listed for b and, in b's first or last block, its offset is inside the window / the written tokens. A
        physical block appears at most once in a table, so its id tells b's first and last blocks apart."""
        if (window, queries) in self._flex_mask:
            return self._flex_mask[window, queries]
        from torch.nn.attention.flex_attention import BlockMask

        d, bs, N, dev = self.num_decodes, self.block_size, self.k_cache.shape[1], self.block_tables.device
        table = self.block_tables[:d].long()  # [d, M]
        M = table.shape[1]
        col = torch.arange(max(M, 2), device=dev)  # [W]
        ctx = self.context_lens[:d].long()  # [d]
        last = (ctx - 1) // bs  # column of the block holding the query
        last_len = ctx - last * bs  # its written tokens, 1..bs
        lo = (ctx - window).clamp(min=0) if window is not None else torch.zeros_like(ctx)
        first, first_off = lo // bs, lo % bs  # column of the first block in the window; its first key
        single = first == last
        first_partial = (first_off > 0) | (single & (last_len < bs))  # (one block: counted here only)
        last_partial = ~single & (last_len < bs)
        first_blk, last_blk = table.gather(1, first[:, None])[:, 0], table.gather(1, last[:, None])[:, 0]  # [d]
        partial = last_blk[:, None].repeat(1, len(col))  # [d, W]: padded with a valid block id
        partial[:, 0] = torch.where(first_partial, first_blk, last_blk)
        num_partial = first_partial.long() + last_partial.long()
        start = first + first_partial.long()  # column of the first full block
        num_full = last + 1 - last_partial.long() - start
        full = table.gather(1, (start[:, None] + col).clamp(max=M - 1))  # [d, W]
        listed = torch.zeros(d, N + 1, dtype=torch.bool, device=dev)  # [d, N + 1]; column N takes the unlisted
        listed.scatter_(1, torch.where(col < num_partial[:, None], partial, N), True)
        listed.scatter_(1, torch.where(col < num_full[:, None], full, N), True)

        def paged_decode(b, h, q_idx, kv_idx):
            blk, off = kv_idx // bs, kv_idx % bs
            return (listed[b, blk] & ((blk != last_blk[b]) | (off < last_len[b]))
                    & ((blk != first_blk[b]) | (off >= first_off[b])))

        def rows(x):  # [d] or [d, W] -> [d, 1, 1] or [d, 1, 1, W] int32: one head group, one query tile
            return x.to(torch.int32)[:, None, None]

        mask = BlockMask.from_kv_blocks(rows(num_partial), rows(partial), rows(num_full), rows(full),
                                        BLOCK_SIZE=(FLEX_Q_BLOCK, bs), mask_mod=paged_decode,
                                        seq_lengths=(queries, N * bs), compute_q_blocks=False)
        self._flex_mask[window, queries] = mask
        return mask


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    layer: int, write: bool = True) -> torch.Tensor:
    """q [1, H, T, D], new k/v [1, H_kv, T, D] of a mixed prefill/decode row -> [1, H, T, D]; writes k/v into the
    pool first (unless the caller did: `write=False`), so each token attends to its sequence's earlier tokens and
    to itself."""
    p = meta.paged
    k_pool, v_pool = (pool.flatten(0, 1) for pool in p.pools(layer))  # [N * bs, H_kv, D] views
    if write:
        k_pool.index_copy_(0, p.slot_mapping, k[0].transpose(0, 1))
        v_pool.index_copy_(0, p.slot_mapping, v[0].transpose(0, 1))
    if meta.backend == "flash":
        return _flash_paged(q, meta, layer)
    outs = []
    in_place = meta.backend in ("flex", "triton") and p.num_decodes > 0
    if in_place:  # [H, d, D]
        outs.append(_flex_decodes(q, k_pool, v_pool, meta) if meta.backend == "flex" else
                    _triton_decodes(q, meta, layer))
    fresh = p.fresh(meta.window)
    for a, b, slots, mask in p.plan(meta.window, decodes=not in_place):
        # one index_select over the flat slots (about 1.5x faster than advanced indexing on CPU)
        flat, shape = slots.flatten(), (*slots.shape, *k_pool.shape[1:])
        keys = k_pool.index_select(0, flat).view(shape).transpose(1, 2)  # [G, H_kv, S_k, D]
        vals = v_pool.index_select(0, flat).view(shape).transpose(1, 2)
        if a < p.num_decodes:  # the decode group: one query per sequence, batched over sequences
            qg = q[0, :, a:b].transpose(0, 1)[:, :, None]  # decodes: [G, H, 1, D]
            y = sdpa(qg, keys, vals, meta, attn_mask=mask)
            outs.append(y[:, :, 0].transpose(0, 1))  # [H, G, D]
        else:
            y = sdpa(q[:, :, a:b], keys, vals, meta, attn_mask=mask, is_causal=mask is None)
            outs.append(y[0])  # [H, q_len, D]
    if fresh is not None:
        a, packed = fresh
        if meta.scale is not None or meta.softcap is not None or meta.sinks is not None:  # (the layer's own scores)
            packed = dataclasses.replace(packed, scale=meta.scale, softcap=meta.softcap, sinks=meta.sinks)
        outs.append(sdpa_varlen(q[:, :, a:], k[:, :, a:], v[:, :, a:], packed)[0])  # [H, T - a, D]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))[None]


def _flex_decodes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
    """The decode group -> [H, d, D]: one flex_attention call against the layer's whole pool as keys/values
    [1, H_kv, N * bs, D] (a view, nothing copied); the BlockMask (batch d) picks each decode's blocks. flex accepts
    a KV batch of 1 against a query batch of d when the BlockMask has the query's batch (torch 2.13: its kernels
    index K/V with batch 0; eager flex expands them).

    The G = H / H_kv query heads of a KV head go in as G query rows of one head, [d, H_kv, G, D], not as GQA
    heads [d, H, 1, D]. Why: compiled on GPUs with dynamic shapes (`attention.flex_attention_for`: d, table widths
    and pool sizes change every step), torch 2.13 lowers a symbolic batch to its main flex kernel (its short-query
    kernel, flex_decoding, wants a static batch and, with GQA, a power-of-two G; Qwen2.5 has G = 7): one program per
    (sequence, head) over a query tile of up to 128 rows. As GQA heads, each tile holds one real row and each KV
    block is read once per query head; packed, G rows and once per KV head. The G rows share the decode's
    position, so the mask_mod ignores q_idx. d == 1 is specialized and gets flex_decoding, whose KV splits are
    sized by the whole pool when full blocks are listed (a lone long sequence: one program per KV head). Not yet
    measured on a GPU: tune (BLOCK_M, all blocks as partial, ...) only against numbers."""
    p, d = meta.paged, meta.paged.num_decodes
    H, H_kv, D = q.shape[1], k_pool.shape[1], q.shape[-1]
    G = H // H_kv
    keys, vals = (x.permute(1, 0, 2)[None] for x in (k_pool, v_pool))  # [1, H_kv, N * bs, D]
    qd = q[0, :, :d].transpose(0, 1).reshape(d, H_kv, G, D)  # [d, H_kv, G, D]: head h uses KV head h // G
    flex = flex_attention_for(q.device.type)
    scale = {} if meta.scale is None else {"scale": meta.scale}
    y = flex(qd, keys, vals, block_mask=p.flex_block_mask(meta.window, G), **scale)  # [d, H_kv, G, D]
    return y.reshape(d, H, D).transpose(0, 1)


def _triton_decodes(q: torch.Tensor, meta: AttentionMetadata, layer: int) -> torch.Tensor:
    """The decode group -> [H, d, D] through the Triton paged decode kernel (twinplane.rollout.kernels.paged_decode),
    which reads each sequence's blocks of the pool in place."""
    from twinplane.rollout.kernels.paged_decode import paged_decode  # (imports Triton: only where it runs)

    p, d = meta.paged, meta.paged.num_decodes
    y = paged_decode(q[0, :, :d].transpose(0, 1), *p.pools(layer), p.block_tables[:d], p.context_lens[:d],
                     meta.window, p.max_context, scale=meta.scale, softcap=meta.softcap,
                     sinks=meta.sinks)  # [d, H, D]
    return y.transpose(0, 1)


def _flash_paged(q: torch.Tensor, meta: AttentionMetadata, layer: int) -> torch.Tensor:
    """The fused GPU path: flash-attn reads the block pool through the block table (bottom-right causal, so a
    chunk of later prompt tokens sees the earlier ones). Needs block_size % 256 == 0 (platform picks it)."""
    from flash_attn import flash_attn_varlen_func

    p = meta.paged
    cu_k = torch.zeros(len(p.context_lens) + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = p.context_lens.cumsum(0)
    window = (-1, -1) if meta.window is None else (meta.window - 1, 0)
    y = flash_attn_varlen_func(q[0].transpose(0, 1), *p.pools(layer), p.cu_seqlens_q, cu_k,
                               max(p.query_lens), p.max_context, softmax_scale=meta.scale, causal=True,
                               window_size=window,
                               block_table=p.block_tables)  # [T, H, D]
    return y.transpose(0, 1)[None]


def flex_decode_agrees(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    """The platform's self-check of the "flex" backend before an engine relies on it: a tiny paged decode through
    flex and through the portable path, on copies of one pool, both kernels flex may lower a decode to (one
    sequence; three, with full, partly filled and windowed blocks; the static decode's fixed-width tables), with
    2 and 3 query heads per KV head (the packed query rows of `_flex_decodes`, a power of two and not).
    True when they agree within the dtype's tolerance; raises what flex raises (no kernel, a failed compile)."""
    g = torch.Generator().manual_seed(0)
    L, N, bs, H_kv, D = 1, 8, block_size, 2, 64
    pool = [torch.randn(L, N, bs, H_kv, D, generator=g).to(device, dtype) for _ in range(2)]
    cases = [([[6, 2, 4], [1, 0, 7], [3, 7, 7]], [bs + 3, 3 * bs, 1], None, False),  # 7: the static pad block
             ([[5, 3, 6, 7, 7]], [3 * bs - 1], bs + 5, True)]  # first and last blocks both partial
    with torch.no_grad():
        for (tables, ctx, window, static), H in itertools.product(cases, (2 * H_kv, 3 * H_kv)):
            d = len(ctx)
            slots = torch.tensor([t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, ctx, strict=True)])
            q, k, v = (torch.randn(1, h, d, D, generator=g).to(device, dtype) for h in (H, H_kv, H_kv))
            outs = []
            for backend in ("flex", "sdpa"):
                paged = PagedKV(*(x.clone() for x in pool), slots.to(device),
                                torch.tensor(tables, dtype=torch.int32, device=device),
                                torch.tensor(ctx, dtype=torch.int32, device=device),
                                torch.arange(d + 1, dtype=torch.int32, device=device), [1] * d, d, max(ctx),
                                static=static)
                meta = AttentionMetadata(torch.tensor([[c - 1 for c in ctx]], device=device), window=window,
                                         backend=backend, paged=paged)
                outs.append(paged_attention(q, k, v, meta, 0).float())
            tol = 1e-3 if dtype == torch.float32 else 5e-2
            if not torch.allclose(outs[0], outs[1], atol=tol, rtol=0):
                return False
    return True

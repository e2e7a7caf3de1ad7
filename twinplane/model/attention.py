"""The attention seam shared by both planes: callers describe their tokens, the model never looks at a batch layout.

The trainer (padded or packed batches) and the rollout engine (KV cache) each build an `AttentionMetadata` for a
forward and pass it to `Transformer(..., meta=...)`; every decoder layer hands its q/k/v and the metadata to
`attention()`, which dispatches on the layout:
- dense: tokens [B, T] with an optional boolean mask [B, 1, T, S] (None = plain causal, the fused SDPA kernel);
- varlen (packed): one row [1, T] holding several sequences back to back, delimited by `cu_seqlens`; each token
  attends causally within its own sequence only. Portable path ("sdpa"): sequences of similar length gathered into
  batches for the fused causal SDPA kernel (no mask, at most 2x padding per batch). Fused paths: "flex"
  (FlexAttention with a document mask, its BlockMask built from `cu_seqlens` at block granularity),
  "flash_attn" (flash-attn's varlen kernel) and "torch_varlen" (torch's own varlen flash attention).
  Shared prefixes (`prefix`): a segment may continue another one, e.g. a GRPO group's n responses each continue one
  copy of their prompt, so the prompt is computed once (the prefix sharing of Prefix Grouper, Liu et al. 2025).
  Its tokens then attend to the whole parent segment, then causally to their own. The portable path gathers each
  such segment's keys (parent + own) and masks; "flex" adds the parent to its document mask; "torch_varlen" gathers
  parent + own keys per segment; flash-attn's varlen call here does not, so the platform never picks it for them.
- paged (the rollout engine's layout, twinplane.rollout.paged_attention; the model only knows it as a
  `PagedLayout`, which attends by itself): one row [1, T] mixing prefill chunks and one-token decodes of many
  sequences whose earlier keys/values live in a block pool (`PagedKV`). Each layer writes its new k/v to the pool at
  `slot_mapping` and attends over its sequence's blocks.
  Portable path ("sdpa"): gather each sequence's slots + SDPA. Fused paths reading the pool in place: "flex"
  (GPUs without flash-attn: FlexAttention over the pool with a BlockMask from the block tables, for the decodes;
  prefill chunks as the portable path) and "flash" (flash-attn's `flash_attn_varlen_func(..., block_table=...)`).
Backends for a layout are chosen in `platform.backends` (stored in `meta.backend`); every fast path keeps the
portable one and a test that they agree (tests/model/test_attention.py, tests/model/test_flex_block_mask.py,
tests/train/test_packing.py, tests/rollout/test_paged_engine.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from twinplane.platform import runtime

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


class PagedLayout(Protocol):
    """A paged layout (the rollout engine's `PagedKV`): it writes the layer's new k/v into its KV pool and
    attends over the pool itself; the model only hands it q/k/v."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               layer: int) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [B, T] rope position of every token of the forward
    mask: torch.Tensor | None = None  # dense layout: [B, 1, T, S] bool (True = may attend); None = causal
    cu_seqlens: torch.Tensor | None = None  # varlen layout (B == 1): [S + 1] int32 sequence starts in the row
    cu_seqlens_host: list[int] | None = None  # varlen: the same as host ints (from `packed`; see `offsets`)
    max_seqlen: int = 0  # varlen: longest sequence (what fused varlen kernels size their tiles by)
    window: int | None = None  # sliding-window size (Mistral/Qwen2 configs), None = full causal
    prefix: list[int] | None = None  # varlen: per sequence, the sequence it continues (-1 = none); see above
    backend: str = "sdpa"  # which kernel runs this layout (decided in twinplane.platform)
    paged: PagedLayout | None = None  # paged layout (B == 1): the KV pool and where each sequence's tokens are
    cache: dict = field(default_factory=dict, repr=False)  # per-forward derived data every layer reuses
    # one layer's own attention (`for_layer`): the scores' scale (None: 1/sqrt(head_dim)) and tanh soft-cap
    scale: float | None = None
    softcap: float | None = None
    # one layer's attention sinks (`with_sinks`): a learned logit per head [H] in the softmax's denominator
    sinks: torch.Tensor | None = None
    # longrope models: [B, T] True where a token's sequence takes the long factors (None: transformers' pick per
    # forward, see `rope.longrope_pick`)
    rope_long: torch.Tensor | None = None

    def for_layer(self, window: int | None, scale: float | None = None,
                  softcap: float | None = None) -> AttentionMetadata:
        """This forward's metadata for a layer with its own window, score scale or soft-cap (Gemma's alternating
        sliding and global layers): itself when they are the forward's, else a view made once per forward (the
        layers of one kind share it and what backends derive from it). Soft-capped scores have no fused kernel
        here but the Triton paged decode: elsewhere such a layer takes the portable path ("sdpa", explicit
        scores)."""
        if window == self.window and scale == self.scale and softcap == self.softcap:
            return self
        key = ("layer", window, scale, softcap)
        view = self.cache.get(key)
        if view is None:
            backend = "sdpa" if softcap is not None and self.backend != "triton" else self.backend
            mask = self.mask
            if window != self.window and not self.varlen and self.paged is None:
                mask = self._dense_mask(window)
            view = self.cache[key] = dataclasses.replace(self, window=window, scale=scale, softcap=softcap,
                                                         backend=backend, mask=mask, cache={})
        return view

    def with_sinks(self, sinks: torch.Tensor) -> AttentionMetadata:
        """This metadata for a layer whose softmax also counts a learned logit per head that takes no value
        (GPT-OSS's attention sinks, a parameter, so a view per layer and forward: it shares this one's derived
        data). Of the fused kernels only the Triton paged decode adds sinks: elsewhere such a layer takes the
        portable path ("sdpa", explicit scores)."""
        backend = self.backend if self.backend == "triton" else "sdpa"
        return dataclasses.replace(self, sinks=sinks, backend=backend, cache=self.cache)

    def _dense_mask(self, window: int | None) -> torch.Tensor | None:
        """The dense layout's mask with another window, from the key validity `Transformer.dense_metadata`
        keeps (`cache["valid"]`, None: no padding)."""
        if "valid" not in self.cache and self.mask is not None:
            raise ValueError("a dense mask with per-layer windows needs the rows' validity: build the metadata with "
                             "Transformer.dense_metadata")
        valid, T = self.cache.get("valid"), self.positions.shape[1]
        if valid is None and (window is None or T <= window):
            return None
        if valid is None:
            valid = torch.ones(self.positions.shape, dtype=torch.bool, device=self.positions.device)
        return build_mask(self.positions, self.positions, valid, torch.arange(T, device=valid.device), window)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    def offsets(self) -> list[int]:
        """`cu_seqlens` as host ints, what backends plan a forward with: kept by `packed`, so that planning reads
        nothing back from the device (on a GPU a read waits for every queued kernel, and the device then idles
        while the host plans); read back otherwise."""
        return self.cu_seqlens_host if self.cu_seqlens_host is not None else self.cu_seqlens.tolist()

    @classmethod
    def packed(cls, lengths: Sequence[int], device: torch.device | str = "cpu", window: int | None = None,
               backend: str = "sdpa", prefix: Sequence[int] | None = None) -> AttentionMetadata:
        """Metadata for sequences of `lengths` packed into one row: positions restart at 0 for each sequence, or
        with `prefix` (per sequence, an earlier sequence it continues, -1 = none) at the end of its parent."""
        lens = torch.as_tensor(list(lengths), dtype=torch.int32)
        if len(lens) == 0 or bool((lens <= 0).any()):
            raise ValueError(f"packed sequence lengths must be positive, got {list(lengths)}")
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        if prefix is not None:
            prefix = [int(p) for p in prefix]
            if len(prefix) != len(lens) or any(not -1 <= p < s or (p >= 0 and prefix[p] >= 0)
                                               for s, p in enumerate(prefix)):
                raise ValueError(f"prefix must name an earlier sequence without a prefix of its own, or -1: {prefix}")
        _, positions, _ = _documents(cu, prefix)  # [T]
        return cls(runtime.to_device(positions[None], device), cu_seqlens=runtime.to_device(cu, device),
                   cu_seqlens_host=cu.tolist(), max_seqlen=int(positions.max()) + 1, window=window, backend=backend,
                   prefix=prefix)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              layer: int = 0) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, H_kv, S, D] (GQA when H_kv < H) -> [B, H, T, D]. `layer` picks the paged pool's
    layer (paged layout only)."""
    if (meta.softcap is not None or meta.sinks is not None) and meta.backend != "sdpa" \
            and not (meta.backend == "triton" and meta.paged is not None):  # (the Triton paged decode can)
        raise ValueError(f"the {meta.backend} attention backend cannot soft-cap scores or add sinks: use sdpa")
    if meta.paged is not None:
        return meta.paged.attend(q, k, v, meta, layer)
    if meta.varlen:
        return VARLEN_BACKENDS[meta.backend](q, k, v, meta)
    if meta.mask is None:
        return sdpa(q, k, v, meta, is_causal=True)
    return sdpa(q, k, v, meta, attn_mask=meta.mask)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
         attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """The portable kernel: torch's SDPA at the layer's scale, or with soft-capped scores or sinks
    `capped_attention`."""
    if meta.softcap is not None or meta.sinks is not None:
        return capped_attention(q, k, v, attn_mask, is_causal, meta.scale, meta.softcap, meta.sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=meta.scale,
                                          enable_gqa=q.shape[-3] != k.shape[-3])


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                     is_causal: bool, scale: float | None, softcap: float | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with tanh soft-capped scores (Gemma 2) or sinks (GPT-OSS: a logit per head [H] that joins each
    row's softmax and takes no value), which SDPA cannot do: scores in q's dtype, capped, masked, softmax in fp32
    and cast back, as transformers' eager attention. q [..., H, T, D], k/v [..., H_kv, S, D]."""
    rep = q.shape[-3] // k.shape[-3]
    if rep > 1:
        k, v = (x.repeat_interleave(rep, dim=-3) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:  # top-left aligned, as SDPA's
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        return probs.to(q.dtype) @ v
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


VARLEN_GROUP_TOKENS = 4096  # portable varlen path: rows x longest of one batched SDPA call (bounds its padding)


def sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Portable varlen attention (q/k/v [1, H, T, D]) as a few batched causal SDPA calls.

    Sequences are sorted by length and gathered into groups of similar length (see `_varlen_plan`); a group is one
    [G, H, L, D] batch where every sequence starts at column 0, so its padding comes after its real tokens, where
    no real query looks, and the fused causal kernel needs no mask. Work is O(sum of L^2) with at most 2x padding
    per group, instead of a block-diagonal mask over many sequences (O(T x block), mostly masked out). Consecutive
    sequences of one length (uniform batches) are a view of the row: no gather, no scatter."""
    groups, unpermute = varlen_plan(meta)
    outs = []
    for index, key_index, G, L, Lk, mask in groups:
        qg, kg, vg = (_rows(x, i).unflatten(1, (G, n)).transpose(0, 1)  # [G, h, n, D]
                      for x, i, n in ((q, index, L), (k, key_index, Lk), (v, key_index, Lk)))
        y = sdpa(qg, kg, vg, meta, attn_mask=mask, is_causal=mask is None)  # [G, H, L, D]
        outs.append(y.transpose(0, 1).flatten(1, 2))  # [H, G * L, D], padding included
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    return (out if unpermute is None else out.index_select(1, unpermute))[None]


def varlen_plan(meta: AttentionMetadata):
    """`sdpa_varlen`'s grouping of `meta`'s sequences, made once per forward from its host offsets; a compiled
    layer finds it made already (`Transformer.hidden_states`), as host work would break its graph."""
    plan = meta.cache.get("varlen_plan")
    if plan is None:
        plan = meta.cache["varlen_plan"] = _varlen_plan(meta.offsets(), meta.window, meta.cu_seqlens.device,
                                                        meta.prefix)
    return plan


def _rows(x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """Columns `index` of x [1, h, T, D] -> [h, n, D]: a view for a slice, else one index_select."""
    return x[0][:, index] if isinstance(index, slice) else x[0].index_select(1, index)


def _varlen_plan(cu: list[int], window: int | None, device: torch.device, prefix: list[int] | None = None):
    """Per group (query index [G*L], or a slice when its sequences are consecutive in the row and all L long; key
    index [G*Lk] (the query index when no member has a parent); G; L; Lk; mask or None), and where each row token's
    output is in the groups' concatenated outputs (None = in place). A sequence's keys are its parent's tokens, if it
    has one (`prefix`), then its own. Greedy over sequences sorted by key length, longest first (stable: equal
    lengths keep row order): a group takes sequences while its shortest is at least half its longest and
    G x Lk <= VARLEN_GROUP_TOKENS."""
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    par = prefix or [-1] * len(lens)
    before = [lens[p] if p >= 0 else 0 for p in par]  # parent tokens each sequence sees first
    keys = [a + b for a, b in zip(before, lens, strict=True)]
    order = sorted(range(len(lens)), key=lambda s: -keys[s])
    groups, unpermute, offset, i = [], [0] * cu[-1], 0, 0
    while i < len(order):
        Lk, j = keys[order[i]], i + 1
        while j < len(order) and 2 * keys[order[j]] >= Lk and (j - i + 1) * Lk <= VARLEN_GROUP_TOKENS:
            j += 1
        members = order[i:j]
        L = max(lens[s] for s in members)
        index, key_index = [], []
        for g, s in enumerate(members):
            n, p = lens[s], par[s]
            own = list(range(cu[s], cu[s] + n))
            index += own + [cu[s]] * (L - n)  # pad with a real token (never attended)
            key_index += (list(range(cu[p], cu[p] + before[s])) if p >= 0 else []) + own + [cu[s]] * (Lk - keys[s])
            unpermute[cu[s]:cu[s] + n] = range(offset + g * L, offset + g * L + n)
        shared = any(before[s] for s in members)
        mask = None
        if shared:  # query t of member g sits at key column before[g] + t: it sees columns up to there
            q_col = torch.tensor([before[s] for s in members], device=device)[:, None] + torch.arange(L, device=device)
            k_col = torch.arange(Lk, device=device)
            m = k_col <= q_col[:, :, None]  # [G, L, Lk]
            if window is not None:
                m &= q_col[:, :, None] - k_col < window
            mask = m[:, None]
        elif window is not None and window < L:
            pos = torch.arange(L, device=device)
            mask = ((pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < window))[None, None]
        contiguous = index == list(range(index[0], index[0] + len(index)))
        q_index = slice(index[0], index[0] + len(index)) if contiguous else torch.tensor(index, device=device)
        groups.append((q_index, torch.tensor(key_index, device=device) if shared else q_index, len(members), L, Lk,
                       mask))
        offset += len(index)
        i = j
    in_place = offset == cu[-1] and unpermute == list(range(offset))
    return groups, None if in_place else torch.tensor(unpermute, device=device)


def block_causal_mask(cu_seqlens: torch.Tensor, window: int | None = None,
                      prefix: list[int] | None = None) -> torch.Tensor:
    """Block-diagonal causal mask [1, 1, T, T] (True = may attend) of the sequences delimited by `cu_seqlens`; with
    `prefix`, a sequence's tokens also see all of its parent's (the window counts positions, parent's first)."""
    doc, pos, parent = _documents(cu_seqlens, prefix)
    i = torch.arange(len(doc), device=doc.device)
    mask = ((doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])) | (parent[doc][:, None] == doc[None, :])
    if window is not None:
        mask &= (pos[:, None] - pos[None, :]) < window
    return mask[None, None]


def _documents(cu_seqlens: torch.Tensor, prefix: list[int] | None):
    """Per token: its sequence [T] and position [T] (after its parent's tokens); per sequence: its parent [S]."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens)  # [T]
    parent = torch.tensor(prefix if prefix is not None else [-1] * len(lens), device=cu.device)  # [S]
    before = torch.where(parent >= 0, lens[parent.clamp(min=0)], 0)
    pos = torch.arange(int(cu[-1]), device=cu.device) - (cu[:-1] - before)[doc]
    return doc, pos, parent


def varlen_mask(meta: AttentionMetadata) -> torch.Tensor:
    """The whole row's block-diagonal causal mask [1, 1, T, T] (reference for the grouped and fused paths)."""
    return block_causal_mask(meta.cu_seqlens, meta.window, meta.prefix)


def flex_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """FlexAttention with a document mask (sparse blocks are skipped). Compiled on GPUs; eager elsewhere, where
    torch 2.13 runs its forward only (tests compare it with the portable path on CPU without grad)."""
    scale = {} if meta.scale is None else {"scale": meta.scale}
    return flex_attention_for(q.device.type)(q, k, v, block_mask=flex_block_mask(meta), **scale,
                                             enable_gqa=q.shape[1] != k.shape[1])


def flex_block_mask(meta: AttentionMetadata) -> BlockMask:
    """`flex_varlen`'s BlockMask, made once per forward (every layer shares it)."""
    mask = meta.cache.get("flex_block_mask")
    if mask is None:
        mask = meta.cache["flex_block_mask"] = varlen_block_mask(torch.tensor(meta.offsets()), meta.window,
                                                                 meta.prefix, meta.cu_seqlens.device)
    return mask


FLEX_BLOCK = 128  # FlexAttention's sparse block size (the tile its compiled kernels skip or mask as a whole)


def varlen_block_mask(cu_seqlens: torch.Tensor, window: int | None, prefix: list[int] | None,
                      device: torch.device | str, block: int = FLEX_BLOCK) -> BlockMask:
    """The varlen layout's FlexAttention BlockMask, built from `cu_seqlens` at block granularity: what
    `create_block_mask` finds by evaluating the mask on all T x T pairs (GB-scale and tens of ms at 8-16k tokens),
    without ever forming a [T, T] tensor.

    The row is cut into pieces at every block start and sequence start (P <= T/block + S pieces); within a piece
    (one sequence, one query block), query i sees its own keys [lo(i), i] and its parent's [plo(i), parent end),
    with lo and plo non-decreasing in i, so over the piece and one key block both "some pair is kept" (unions: own
    [lo(first), last], parent [plo(first), end)) and "every pair is kept" (the keys before the sequence's start lie
    in the last query's parent range, the others in [lo(last), first]) are O(1) comparisons. A block
    pair is partial if any piece keeps a pair and full if all of them keep all pairs; like `create_block_mask`,
    blocks cut by the end of the row are never full. Work: O(P x T/block) small integers, on the host (from host
    offsets: `AttentionMetadata.offsets`; the layers share the mask through `meta.cache`)."""
    from torch.nn.attention.flex_attention import BlockMask

    cu = cu_seqlens.cpu().long()
    T, S = int(cu[-1]), len(cu) - 1
    n = -(-T // block)  # blocks per side
    starts = torch.unique(torch.cat([torch.arange(0, T, block), cu[:-1]]))  # [P] sorted piece starts
    last = torch.cat([starts[1:], torch.tensor([T])])[:, None] - 1  # [P, 1] each piece's last query
    first = starts[:, None]  # [P, 1]
    seq = torch.searchsorted(cu[1:], starts, right=True)  # [P] the sequence each piece belongs to
    c = cu[seq][:, None]  # [P, 1] its first token
    par = torch.tensor(prefix if prefix is not None else [-1] * S)[seq]
    has = (par >= 0)[:, None]
    p = par.clamp(min=0)
    p0 = torch.where(has, cu[p][:, None], 0)  # [P, 1] parent keys are [p0, p_end)
    p_end = torch.where(has, cu[p + 1][:, None], 0)
    before = p_end - p0  # parent tokens, seen first: query i sits at position before + i - c

    def lo(i):  # first own key of query i
        return c if window is None else torch.maximum(c, i - window + 1)

    def plo(i):  # first parent key of query i (p_end or more: none)
        return p0 if window is None else torch.maximum(p0, p0 + before + i - c - window + 1)

    k0 = torch.arange(n)[None] * block  # [1, n] key blocks [k0, k1)
    k1 = k0 + block
    k_end = k1.clamp(max=T)
    some = ((lo(first) < k_end) & (last >= k0)) | ((plo(first) < p_end) & (plo(first) < k_end) & (p_end > k0))
    parent_part = (k0 >= c) | ((plo(last) <= k0) & (p_end >= torch.minimum(k1, c)))  # keys [k0, min(k1, c))
    own_part = (k1 <= c) | ((lo(last) <= torch.maximum(k0, c)) & (first >= k1 - 1))  # keys [max(k0, c), k1)
    q_block = starts // block  # [P]
    some_blk = torch.zeros(n, n, dtype=torch.int32).index_add_(0, q_block, some.int()) > 0  # [n, n]
    not_all = torch.zeros(n, n, dtype=torch.int32).index_add_(0, q_block, (~(parent_part & own_part)).int())
    whole = (torch.arange(n) + 1) * block <= T  # [n] blocks inside the row
    full = (not_all == 0) & some_blk & whole[:, None] & whole[None]
    partial = some_blk & ~full

    def kv_lists(blocks: torch.Tensor):  # [n, n] bool -> counts [1, 1, n], indices [1, 1, n, n] (listed first)
        order = torch.argsort(blocks.int(), dim=-1, descending=True, stable=True)
        return (runtime.to_device(blocks.sum(-1).to(torch.int32)[None, None], device),
                runtime.to_device(order.to(torch.int32)[None, None], device))

    doc, pos, parent = (runtime.to_device(t, device) for t in _documents(cu, prefix))

    def document_causal(b, h, qi, ki):
        keep = ((doc[qi] == doc[ki]) & (ki <= qi)) | (parent[doc[qi]] == doc[ki])
        return keep & (pos[qi] - pos[ki] < window) if window is not None else keep

    return BlockMask.from_kv_blocks(*kv_lists(partial), *kv_lists(full), BLOCK_SIZE=block, mask_mod=document_causal,
                                    seq_lengths=(T, T))


_FLEX: dict[str, object] = {}


def flex_attention_for(device_type: str):
    """flex_attention compiled on GPUs, with dynamic shapes (row lengths, and for the paged decodes the batch and
    pool, change every step); eager elsewhere (a reference implementation, forward only on CPU)."""
    if device_type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[device_type] = torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention
    return _FLEX[device_type]


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """flash-attn's `flash_attn_varlen_func` (CUDA sm80+ and the ROCm CK build; bf16/fp16), GQA native. No shared
    prefixes (the platform picks another backend for them)."""
    from flash_attn import flash_attn_varlen_func

    if meta.prefix is not None:
        raise ValueError("flash_attn varlen attention cannot attend to a shared prefix: use flex or sdpa")
    cu, L = meta.cu_seqlens.to(q.device, torch.int32), meta.max_seqlen
    window = (-1, -1) if meta.window is None else (meta.window - 1, 0)
    out = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, L, L,
                                 softmax_scale=meta.scale, causal=True, window_size=window)  # [T, H, D]
    return out.transpose(0, 1)[None]


def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """torch's own varlen flash attention (`torch.nn.attention.varlen.varlen_attn`, in torch's GPU builds since
    2.10): flash-attn's kernel without the flash-attn package. Shared prefixes: a continuing segment's keys are its
    parent's then its own (key offsets apart from the query offsets), and the kernel's causal mask aligns a
    segment's last query with its last key (bottom-right, as flash-attn's), so its queries see the whole parent,
    then their own tokens causally (the window counted over both, as positions are). Any of `varlen_attn`'s
    signatures: torch 2.10's (`is_causal`, no sliding window), 2.11's (`window_size`) or a later one (`window_size`,
    `enable_gqa`); without `enable_gqa` the k/v heads are repeated for GQA."""
    cu_q, cu_k, max_q, max_k, keys, attn, params = varlen_keys(meta)
    x, kk, vv = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, H, D], [T, H_kv, D]
    if keys is not None:
        kk, vv = kk.index_select(0, keys), vv.index_select(0, keys)  # [T_k, H_kv, D]
    kw = {} if meta.scale is None else {"scale": meta.scale}
    if kk.shape[1] != x.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            kk, vv = (t.repeat_interleave(x.shape[1] // kk.shape[1], dim=1) for t in (kk, vv))
    if "window_size" in params:
        kw["window_size"] = (-1 if meta.window is None else meta.window - 1, 0)
    elif meta.window is not None:
        raise ValueError("this torch's varlen_attn has no sliding window: use flex or sdpa")
    else:
        kw["is_causal"] = True
    return attn(x, kk, vv, cu_q, cu_k, max_q, max_k, **kw).transpose(0, 1)[None]


def varlen_keys(meta: AttentionMetadata):
    """`torch_varlen`'s layout, made once per forward from the host offsets (before compiled layers run): query
    and key offsets (int32, on the device), the longest query and key segments, the key rows to gather (None where
    no segment continues another: the keys are the queries' rows), and `varlen_attn` with its parameter names."""
    layout = meta.cache.get("torch_varlen")
    if layout is None:
        from torch.nn.attention.varlen import varlen_attn

        dev, cu = meta.cu_seqlens.device, meta.offsets()
        lens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        cu_k, key_lens, keys = meta.cu_seqlens, lens, None
        if meta.prefix is not None and any(p >= 0 for p in meta.prefix):
            spans = []  # a segment's keys: its parent's tokens, then its own
            for s, p in enumerate(meta.prefix):
                spans += [(cu[p], cu[p + 1])] * (p >= 0) + [(cu[s], cu[s + 1])]
            key_lens = [n + (lens[p] if p >= 0 else 0) for n, p in zip(lens, meta.prefix, strict=True)]
            cu_k = runtime.to_device(torch.tensor([0, *itertools.accumulate(key_lens)], dtype=torch.int32), dev)
            keys = runtime.to_device(torch.cat([torch.arange(a, b) for a, b in spans]), dev)
        layout = meta.cache["torch_varlen"] = (meta.cu_seqlens, cu_k, max(lens), max(key_lens), keys, varlen_attn,
                                               frozenset(inspect.signature(varlen_attn).parameters))
    return layout


def torch_varlen_agrees(device: torch.device, dtype: torch.dtype) -> bool:
    """`torch_varlen`'s self-check: one tiny packed forward and backward (GQA, shared prefixes, segments off the
    kernel's tiles) against the portable path, within the dtype's rounding; with gradients in any grad mode (a run's
    first packed pass, which runs the check, is often a scoring pass under no_grad)."""
    with torch.inference_mode(False), torch.enable_grad():
        g = torch.Generator().manual_seed(0)
        lengths, prefix, heads, D = [37, 5, 20, 64, 1], [-1, 0, 0, -1, 3], (4, 2, 2), 64
        q, k, v = (torch.randn(1, h, sum(lengths), D, generator=g).to(device, dtype).requires_grad_() for h in heads)
        got = torch_varlen(q, k, v, AttentionMetadata.packed(lengths, device, prefix=prefix))
        want = sdpa_varlen(q, k, v, AttentionMetadata.packed(lengths, device, prefix=prefix))
        grad = torch.randn(want.shape, generator=g).to(device, dtype)
        pairs = zip((got, *torch.autograd.grad(got, (q, k, v), grad)),
                    (want, *torch.autograd.grad(want, (q, k, v), grad)), strict=True)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in pairs)


VARLEN_BACKENDS = {"sdpa": sdpa_varlen, "flex": flex_varlen, "flash_attn": flash_attn_varlen,
                   "torch_varlen": torch_varlen}
# per forward, what a backend derives from the layout on the host: made before compiled layers run
VARLEN_PREPARE = {"sdpa": varlen_plan, "flex": flex_block_mask, "torch_varlen": varlen_keys}


def build_mask(q_pos, k_pos, k_valid, self_index, window: int | None) -> torch.Tensor:
    """Boolean mask [B, 1, T, S] for padded rows: a query sees valid keys at positions <= its own (within the
    sliding window).

    Each query also sees its own key (`self_index[t]` is its column), so a padding row never has an empty
    row of keys; an all-masked row would make SDPA return NaN, which would leak into the real rows' grads.
    """
    q, k = q_pos[:, :, None], k_pos[:, None, :]  # [B, T, 1], [B, 1, S]
    mask = k_valid[:, None, :] & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    cols = torch.arange(k_pos.shape[1], device=k_pos.device)
    mask |= cols[None, None, :] == self_index[None, :, None]
    return mask[:, None]

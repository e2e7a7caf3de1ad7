"""The varlen FlexAttention BlockMask built at block granularity equals the one `create_block_mask` finds from the
dense [T, T] mask, block for block, and attention with it equals the portable path."""

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from twinplane.model.attention import AttentionMetadata, _documents, flex_varlen, sdpa_varlen, varlen_block_mask


def dense_block_mask(cu_seqlens, window, prefix, block):
    """Reference: the mask evaluated on all T x T pairs, then reduced to blocks by torch."""
    doc, pos, parent = _documents(cu_seqlens, prefix)

    def document_causal(b, h, qi, ki):
        keep = ((doc[qi] == doc[ki]) & (ki <= qi)) | (parent[doc[qi]] == doc[ki])
        return keep & (pos[qi] - pos[ki] < window) if window is not None else keep

    T = len(doc)
    return create_block_mask(document_causal, None, None, T, T, device="cpu", BLOCK_SIZE=block, _compile=False)


def _listed(num: torch.Tensor, indices: torch.Tensor) -> list[set[int]]:
    """Per row of blocks, the set of blocks listed (the order within a row carries no meaning)."""
    return [set(indices[0, 0, i, :num[0, 0, i]].tolist()) for i in range(num.shape[-1])]


def _random_case(seed: int):
    rng = random.Random(seed)
    lengths = [rng.choice([1, rng.randint(1, 40)]) for _ in range(rng.randint(1, 14))]
    prefix = None
    if seed % 2:  # every other case continues some earlier sequences without a parent of their own
        prefix = [-1] * len(lengths)
        for s in range(1, len(lengths)):
            p = rng.randrange(s)
            if rng.random() < 0.6 and prefix[p] < 0:
                prefix[s] = p
    return lengths, prefix, rng.choice([None, 1, 3, 7, 20]), rng.choice([4, 8, 16])


CASES = [
    ([37], None, None, 8),  # a single document, T not a multiple of the block
    ([64], None, None, 16),  # a single document filling whole blocks
    ([1] * 19, None, None, 4),  # many length-1 documents
    ([1] * 19, None, 2, 4),
    ([5, 2, 12, 1, 3, 6], None, 4, 4),
    ([6, 3, 9, 1, 4, 2, 5], [-1, 0, -1, 0, 0, 2, -1], None, 4),  # shared prompts
    ([6, 3, 9, 1, 4, 2, 5], [-1, 0, -1, 0, 0, 2, -1], 4, 4),
    ([16, 16, 16], [-1, 0, 0], None, 16),  # parents and children on block boundaries: full blocks both sides
    ([30, 1, 1, 45], [-1, 0, 0, -1], 9, 8),
] + [_random_case(seed) for seed in range(60)]


@pytest.mark.parametrize("lengths,prefix,window,block", CASES)
def test_block_mask_equals_the_dense_builders(lengths, prefix, window, block):
    cu = AttentionMetadata.packed(lengths, window=window, prefix=prefix).cu_seqlens
    got = varlen_block_mask(cu, window, prefix, "cpu", block)
    want = dense_block_mask(cu, window, prefix, block)
    assert got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == want.seq_lengths
    for a, b in ((got.kv_num_blocks, want.kv_num_blocks), (got.full_kv_num_blocks, want.full_kv_num_blocks),
                 (got.q_num_blocks, want.q_num_blocks), (got.full_q_num_blocks, want.full_q_num_blocks)):
        assert torch.equal(a, b)
    assert _listed(got.kv_num_blocks, got.kv_indices) == _listed(want.kv_num_blocks, want.kv_indices)
    assert _listed(got.full_kv_num_blocks, got.full_kv_indices) == _listed(want.full_kv_num_blocks,
                                                                           want.full_kv_indices)
    assert _listed(got.q_num_blocks, got.q_indices) == _listed(want.q_num_blocks, want.q_indices)
    assert torch.equal(got.to_dense(), want.to_dense())
    doc = torch.arange(cu[-1].item())
    qi, ki = doc[:, None], doc[None, :]  # the mask_mod on partial blocks is the dense mask itself
    assert torch.equal(got.mask_mod(0, 0, qi, ki), want.mask_mod(0, 0, qi, ki))


@pytest.mark.parametrize("lengths,prefix,window", [
    ([300], None, None),  # several 128-token blocks, T not a multiple of them
    ([130, 1, 77, 400, 1, 5, 90], None, None),
    ([130, 1, 77, 400, 1, 5, 90], None, 50),
    ([140, 60, 70, 129, 40, 3], [-1, 0, 0, -1, 3, 3], None),
    ([140, 60, 70, 129, 40, 3], [-1, 0, 0, -1, 3, 3], 100),
])
def test_flex_varlen_over_many_blocks_equals_portable(lengths, prefix, window):
    """flex_varlen with the block-granular BlockMask (FlexAttention's 128-token blocks, full ones skipping the
    mask) against the portable grouped SDPA path, fp32, forward (torch 2.13 runs flex eagerly on CPU)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, sum(lengths), 8, generator=g) for H in (4, 2, 2))
    meta = AttentionMetadata.packed(lengths, window=window, prefix=prefix, backend="flex")
    with torch.no_grad():
        got = flex_varlen(q, k, v, meta)
        torch.testing.assert_close(got, sdpa_varlen(q, k, v, meta), atol=1e-5, rtol=0)
    if window is None:
        assert meta.cache["flex_block_mask"].full_kv_num_blocks.sum() > 0  # full blocks are exercised

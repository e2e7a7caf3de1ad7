"""The attention seam: packed (varlen) rows give the same logits as padded rows and as each sequence alone."""

import pytest
import torch
from conftest import tiny_model

from twinplane.model.attention import AttentionMetadata


@pytest.mark.parametrize("window", [None, 3])
def test_packed_equals_padded_and_alone(window):
    model = tiny_model(sliding_window=window)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 50, (n,), generator=g) for n in (5, 1, 8, 3)]
    packed = model(torch.cat(seqs)[None], meta=AttentionMetadata.packed([len(s) for s in seqs], window=window))[0]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    padded = model(ids, mask)
    start = 0
    for i, s in enumerate(seqs):
        alone = model(s[None])[0]
        torch.testing.assert_close(packed[start:start + len(s)], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[start:start + len(s)], padded[i, :len(s)], atol=1e-5, rtol=0)
        start += len(s)


def test_packed_metadata_positions_restart():
    meta = AttentionMetadata.packed([2, 3])
    assert meta.positions.tolist() == [[0, 1, 0, 1, 2]]
    assert meta.cu_seqlens.tolist() == [0, 2, 5] and meta.max_seqlen == 3
    with pytest.raises(ValueError, match="positive"):
        AttentionMetadata.packed([2, 0])

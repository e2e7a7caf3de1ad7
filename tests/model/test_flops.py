"""FLOP accounting (twinplane.model.flops) against torch's own count of the matmuls a training pass runs."""

import pytest
import torch
from conftest import tiny_model
from torch.utils.flop_counter import FlopCounterMode

from twinplane.model.flops import forward_flops_per_token, lm_head_flops, train_flops
from twinplane.train import Batch
from twinplane.train.logprobs import response_logprobs

MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_}  # (attention: SDPA, not counted here)


def _addmm_flop(c_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@pytest.mark.parametrize("tied", [False, True])
def test_train_flops_count_the_matmuls_a_training_pass_runs(tied):
    """A packed forward + backward of the trainer's log-probs runs 3 x 2 x (layer matmul params) per token and the
    LM head only for the response tokens, plus the chunked log-probs' LM-head GEMM recomputed in backward (not a
    model FLOP): torch's flop counter sees exactly that."""
    model = tiny_model(tie_word_embeddings=tied).train()
    cfg = model.config
    prompts, responses = [[5] * 7, [6] * 3, [7] * 9], [[8] * 4, [9] * 11, [10] * 2]
    batch = Batch.collate(prompts, responses, 0)
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    logits = sum(len(r) for r in responses)
    # (the chunked log-probs accumulate the weight's grad with addmm_, which torch's counter does not know)
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_flop}) as counter:
        lp, _ = response_logprobs(model, batch, 1.0, chunk_tokens=4)
        lp.sum().backward()
    counted = sum(f for op, f in counter.get_flop_counts()["Global"].items() if op in MATMULS)
    recomputed = logits * lm_head_flops(cfg)
    assert train_flops(cfg, tokens, 0, logits) + recomputed == counted  # (context 0: the matmuls alone)


def test_forward_flops_per_token_by_hand():
    """Hand count for one small config: q/k/v/o, the MLP, the LM head, and the attention term 4 x L x H x hd x ctx."""
    cfg = tiny_model().config  # d 64, f 128, L 2, H 4, H_kv 2, hd 16, V 50
    layer = 64 * 16 * (4 + 2 + 2 + 4) + 3 * 64 * 128
    assert lm_head_flops(cfg) == 2 * 64 * 50
    assert forward_flops_per_token(cfg, 10) == 2 * (2 * layer + 64 * 50) + 4 * 2 * 4 * 16 * 10
    assert forward_flops_per_token(cfg, 10, lm_head=False) == 2 * 2 * layer + 4 * 2 * 4 * 16 * 10
    # 100 tokens in sequences of 20 (context 10 on average), 30 of them with logits
    assert train_flops(cfg, 100, 20, 30) == 3 * (100 * (4 * layer + 4 * 2 * 4 * 16 * 10) + 30 * 2 * 64 * 50)

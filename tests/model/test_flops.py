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


def test_hybrid_flops_count_deltanet_layers_by_hand():
    """Qwen3-Next's linear layers: their projections and convolution as matmul weights, the chunked delta rule per
    token (no context term); only the attention layer pays the quadratic term."""
    from test_memory import HYBRID  # layers 0, 2, 3 Gated DeltaNet: d 64, H_k 2 x d_k 8, H_v 4 x d_v 12, 4 taps

    from twinplane.model.flops import deltanet_flops_per_token, matmul_params

    # in_proj_qkvz 64 x (2*16 + 2*48), in_proj_ba 64 x 8, out_proj 48 x 64, the convolution's 80 channels x 4 taps
    deltanet = 64 * 128 + 64 * 8 + 48 * 64 + 80 * 4
    attention = 64 * 2 * 64 + 2 * 64 * 32 + 64 * 64  # q_proj makes the query and its gate; k, v; o
    assert matmul_params(HYBRID) == 3 * deltanet + attention + 4 * 3 * 64 * 96 + 64 * 64  # + MLPs, LM head
    # per value head, chunks of 64: 64 (5 * 8 + 3 * 12) within the chunk + 6 * 8 * 12 across chunks
    assert deltanet_flops_per_token(HYBRID) == 4 * (64 * 76 + 576) == 21760
    for ctx in (0, 100):
        assert forward_flops_per_token(HYBRID, ctx) == 2 * matmul_params(HYBRID) + 3 * 21760 + 4 * 1 * 4 * 16 * ctx

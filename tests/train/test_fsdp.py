"""Data parallelism: an FSDP2 step on 2 CPU ranks (gloo) equals one process on the same global batch."""

import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch, spawn, tiny_model, tiny_moe
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from twinplane.config import AlgoSection, TrainSection
from twinplane.model.moe import RoutingState
from twinplane.train import Trainer
from twinplane.train.fsdp import full_state_dict, shard_model, split_for_rank

ALGO = AlgoSection(kl_coef=0.1, entropy_coef=0.01)
METRICS = ("pg_loss", "kl", "entropy", "clip_frac", "ratio", "logprob_gap", "grad_norm")


def trainer(model, clip, group=None, packing=True, algo=ALGO, moe=False, tis_cap=None):
    train = TrainSection(micro_batch_size=2, lr=1e-3, grad_clip=clip, packing=packing)
    algo = dataclasses.replace(algo, routing_replay=moe)
    tr = Trainer(model, train, algo, temperature=1.0, total_steps=10, group=group, tis_cap=tis_cap)
    tr.opt.zero_grad = lambda set_to_none=True: None  # keep the (clipped) grads to compare: Adam's first step
    return tr  # is nearly sign(grad), blind to a wrong loss scale


def full_grads(model):
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}


def moe_batch(n):
    """A batch for the tiny MoE model with a routing record (the model's own, half of it replaced)."""
    model = tiny_moe()
    batch = make_batch(model, n=n)
    state = RoutingState()
    with torch.no_grad():
        model(batch.input_ids, batch.attention_mask, routing=state)
    rec = state.indices().view(*batch.input_ids.shape, -1, 2)
    rec[::2] = (rec[::2] + 1) % 4  # replay must matter
    batch.routing = torch.where(batch.attention_mask.bool()[..., None, None], rec, -1).to(torch.int16)
    return batch


# The off-policy correction under DP: sequence weights, a token band mask (the loss's token count falls), token-sum.
CORRECTED = dict(is_weight="sequence", is_mask="token", is_low=0.8, is_high=1.25, loss_agg="token-sum")


def corrected_batch(n):
    """A batch whose old log-probs differ from the engine's by e^(+-0.3) per token: some tokens leave the band."""
    batch = make_batch(tiny_model(), n=n)
    noise = 0.3 * torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(7))
    batch.old_logprobs = (batch.rollout_logprobs + noise) * batch.response_mask
    return batch


def _worker(rank, world, tmp, n, clip, tool_masks, name="grpo", moe=False, bf16=False, corrected=False):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        batch = moe_batch(n) if moe else make_batch(tiny_model(), n=n, tool_masks=tool_masks)
        batch = corrected_batch(n) if corrected else batch
        local = split_for_rank(batch, rank, world)
        # bf16: the mixed-precision policy GPUs use, whose input casting runs on every unit's forward arguments
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        model = shard_model(tiny_moe() if moe else tiny_model(), mp_policy=mp)
        algo = AlgoSection(name=name, kl_coef=0.1, entropy_coef=0.01, **(CORRECTED if corrected else {}))
        metrics = trainer(model, clip, dist.group.WORLD, algo=algo, moe=moe,
                          tis_cap=1.1 if corrected else None).train_step(local)
        state, grads = full_state_dict(model), full_grads(model)
        if rank == 0:
            torch.save({"state": state, "grads": grads, "metrics": metrics}, f"{tmp}/dp{world}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()  # every rank is done with the others
    os._exit(0)  # skip interpreter teardown: gloo's threads there intermittently abort ("terminate called ...")


# 5 rows: the ranks hold 3 and 2 and differ in micro-batch count; no clipping there, so the grads' scale shows.
# The ranks train on packed micro-batches; the tool-mask cases compare them with one process on padded ones, with
# multi-turn loss masks (tool outputs in the context, not in the loss). dr_grpo and gspo: the per-sequence
# aggregations (rows, not tokens, and a global horizon) under DP; the other presets share grpo's token-mean loss in
# the trainer (they differ in advantages, computed before it).
@pytest.mark.parametrize(("n", "clip", "tool_masks", "dp1_packing", "name"),
                         [(6, 1.0, False, True, "grpo"), (5, 0.0, True, False, "grpo"),
                          (5, 0.0, True, False, "dr_grpo"), (5, 0.0, False, True, "gspo")])
def test_dp2_fsdp_step_equals_dp1(tmp_path, n, clip, tool_masks, dp1_packing, name):
    spawn(_worker, (2, str(tmp_path), n, clip, tool_masks, name), nprocs=2)
    got = torch.load(tmp_path / "dp2.pt")

    batch = make_batch(tiny_model(), n=n, tool_masks=tool_masks)
    assert len({int(r.sum()) for r in batch.attention_mask}) > 1  # unequal lengths: the global normaliser matters
    model = tiny_model()
    want = trainer(model, clip, packing=dp1_packing,
                   algo=AlgoSection(name=name, kl_coef=0.1, entropy_coef=0.01)).train_step(batch)
    diffs = {name: float((got["state"][name] - p.detach()).abs().max()) for name, p in model.named_parameters()}
    assert set(got["state"]) == set(diffs)
    assert max(diffs.values()) < 1e-5, diffs
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    for k in METRICS:
        assert abs(got["metrics"][f"actor/{k}"] - want[f"actor/{k}"]) < 1e-5, k


def test_dp2_off_policy_correction_equals_dp1(tmp_path):
    """The correction's mask changes the global token count and its metrics are shares of the global batch:
    2 ranks equal 1 process (the ratio quantiles, a mean of each rank's, are left out)."""
    spawn(_worker, (2, str(tmp_path), 5, 0.0, False, "grpo", False, False, True), nprocs=2)
    got = torch.load(tmp_path / "dp2.pt")
    model = tiny_model()
    algo = AlgoSection(kl_coef=0.1, entropy_coef=0.01, **CORRECTED)
    want = trainer(model, 0.0, algo=algo, tis_cap=1.1).train_step(corrected_batch(5))
    assert 0 < want["actor/tis_masked_frac"] < 1 and 0 < want["actor/tis_clip_frac"] < 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    for k in (*METRICS, "tis_weight_mean", "tis_clip_frac", "tis_masked_frac"):
        assert abs(got["metrics"][f"actor/{k}"] - want[f"actor/{k}"]) < 1e-5, k


# pi_old from the update's own forward: sequence weights (whole rows per micro-batch), tool-masked rows.
CURRENT = dict(kl_coef=0.1, entropy_coef=0.01, is_weight="sequence")


def _current_worker(rank, world, tmp):
    """One step with pi_old from each rank's own training forwards (`Batch.old_is_current`) and one with a
    separate scoring pass first, on fresh copies of the model."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        local = split_for_rank(make_batch(tiny_model(), n=5, tool_masks=True), rank, world)
        out = {}
        for current in (True, False):
            model = shard_model(tiny_model())
            tr = trainer(model, 0.0, dist.group.WORLD, algo=AlgoSection(**CURRENT), tis_cap=1.1)
            batch = dataclasses.replace(local, old_is_current=True) if current else \
                dataclasses.replace(local, old_logprobs=tr.logprobs(local))
            metrics = tr.train_step(batch)
            out[current] = {"state": full_state_dict(model), "grads": full_grads(model), "metrics": metrics}
        if rank == 0:
            torch.save(out, f"{tmp}/current.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    os._exit(0)


def test_dp2_old_logprobs_from_the_update_equal_a_separate_forward_and_dp1(tmp_path):
    """Each rank's micro-batches hold whole rows and the correction's metrics are reduced like the recomputed
    ones: on 2 ranks the step equals the one with a separate forward (every metric, the per-rank ratio
    quantiles included) and one process's (the quantiles, a mean of each rank's, left out)."""
    spawn(_current_worker, (2, str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "current.pt")
    model = tiny_model()
    batch = dataclasses.replace(make_batch(tiny_model(), n=5, tool_masks=True), old_is_current=True)
    want = trainer(model, 0.0, algo=AlgoSection(**CURRENT), tis_cap=1.1).train_step(batch)
    assert 0 < want["actor/tis_clip_frac"] < 1
    on, off = got[True], got[False]
    assert set(on["metrics"]) == set(off["metrics"])
    for k, v in off["metrics"].items():
        assert on["metrics"][k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    for name, p in model.named_parameters():
        torch.testing.assert_close(on["grads"][name], off["grads"][name], atol=1e-9, rtol=1e-6, msg=name)
        torch.testing.assert_close(on["grads"][name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(on["state"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
    for k in (*METRICS, "tis_weight_mean", "tis_clip_frac", "tis_masked_frac"):
        assert abs(on["metrics"][f"actor/{k}"] - want[f"actor/{k}"]) < 1e-5, k


def test_dp2_moe_step_equals_dp1(tmp_path):
    """Experts sharded like any parameter; replay and the load/agreement metrics are global-batch quantities. (The
    aux loss is per micro-batch, as in Megatron, so it depends on how rows are split and is left out here.)"""
    spawn(_worker, (2, str(tmp_path), 5, 1.0, False, "grpo", True), nprocs=2)
    got = torch.load(tmp_path / "dp2.pt")
    model = tiny_moe()
    want = trainer(model, 1.0, moe=True).train_step(moe_batch(5))
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["state"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(got["grads"][name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert want["rollout/routing_agreement"] == 1.0 and want["moe/router_agreement"] < 1.0
    for k in ("actor/pg_loss", "moe/load_imbalance", "moe/router_agreement", "actor/grad_norm"):
        assert abs(got["metrics"][k] - want[k]) < 1e-5, k


def test_moe_step_under_a_bf16_policy_keeps_its_routing_and_aux_loss(tmp_path):
    """With bf16 compute (the GPU policy) the router logits still reach the load-balancing loss: its value and the
    routing metrics stay those of the fp32 step, up to bf16 rounding."""
    spawn(_worker, (1, str(tmp_path), 5, 1.0, False, "grpo", True, True), nprocs=1)
    got = torch.load(tmp_path / "dp1.pt")["metrics"]
    want = trainer(tiny_moe(), 1.0, moe=True).train_step(moe_batch(5))
    assert want["moe/aux_loss"] > 0 and got["rollout/routing_agreement"] == 1.0
    for k in ("moe/aux_loss", "moe/load_imbalance", "actor/pg_loss"):
        assert abs(got[k] - want[k]) < 0.05 * abs(want[k]) + 1e-3, (k, got[k], want[k])


def test_split_for_rank_covers_the_batch_balanced():
    batch = make_batch(tiny_model(), n=7)
    parts = [split_for_rank(batch, r, 3) for r in range(3)]
    assert sorted(len(p) for p in parts) == [2, 2, 3]
    assert sum(p.num_response_tokens for p in parts) == batch.num_response_tokens
    rows = sorted(tuple(x for x in row.tolist() if x) for p in parts for row in p.input_ids)
    assert rows == sorted(tuple(x for x in row.tolist() if x) for row in batch.input_ids)

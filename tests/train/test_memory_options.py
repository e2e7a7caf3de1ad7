"""Training-plane memory options change memory, never the step: activation checkpointing, token-budget
micro-batches, optimizer-state offload; and scoring that stays in lockstep across FSDP ranks."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from conftest import make_batch, spawn, tiny_model, tiny_moe

import twinplane.train.trainer as trainer_module
from twinplane.config import AlgoSection, TrainSection
from twinplane.platform import backends
from twinplane.train import Reference, Trainer
from twinplane.train.fsdp import full_state_dict, micro_batches, row_groups, shard_model, split_for_rank
from twinplane.train.logprobs import response_logprobs, score
from twinplane.train.offload import move_optimizer_state

ALGO = AlgoSection(kl_coef=0.1, entropy_coef=0.01)


def step(n=6, **train):
    model = tiny_model()
    trainer = Trainer(model, TrainSection(**{"micro_batch_size": 2, "lr": 1e-2, "grad_clip": 1.0, **train}), ALGO,
                      temperature=1.0, total_steps=10)
    trainer.opt.zero_grad = lambda set_to_none=True: None  # keep the grads to compare: Adam's first step is
    metrics = trainer.train_step(make_batch(tiny_model(), n=n))  # nearly sign(grad), so params amplify rounding
    return model, trainer, metrics


def assert_same_step(a, b, atol):
    (model_a, _, m_a), (model_b, _, m_b) = a, b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=0, msg=name)
    assert m_a.keys() == m_b.keys()
    for k in m_a:
        assert abs(m_a[k] - m_b[k]) <= atol, k


@pytest.fixture
def checkpoint_calls(monkeypatch):
    """Counts torch.utils.checkpoint.checkpoint calls (still running the real one)."""
    calls, real = [], torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_activation_checkpointing_same_grads(checkpoint_calls):
    batch = make_batch(tiny_model())
    grads = []
    for on in (False, True):
        model = tiny_model().train()
        model.activation_checkpointing = on
        lp, ent = response_logprobs(model, batch, 1.0, with_entropy=True)
        ((lp * batch.advantages).sum() + ent.sum()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert len(checkpoint_calls) == model.config.num_layers  # only the run with it on, once per block
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=0, msg=n)


def test_activation_checkpointing_moe_first_forward_same_grads(monkeypatch):
    """The experts' one-time kernel probe first runs inside a checkpointed block; the recompute must match it."""
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    grads = []
    for on in (False, True):
        monkeypatch.setattr(backends, "_GROUPED_MM", {})  # as in a fresh process: the probe runs again
        model = tiny_moe().train()
        model.activation_checkpointing = on
        model(ids).float().logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=0, msg=n)


def test_activation_checkpointing_only_when_training_with_grad(checkpoint_calls):
    model = tiny_model()
    model.activation_checkpointing = True
    batch = make_batch(model)
    model.eval()(batch.input_ids, batch.attention_mask)  # eval
    with torch.no_grad():
        model.train()(batch.input_ids, batch.attention_mask)  # no grad
    assert checkpoint_calls == []
    model(batch.input_ids, batch.attention_mask)
    assert len(checkpoint_calls) == model.config.num_layers


def test_activation_checkpointing_train_step_equals_off(checkpoint_calls):
    off = step()
    assert checkpoint_calls == []
    on = step(activation_checkpointing=True)
    assert on[0].activation_checkpointing and len(checkpoint_calls) > 0
    assert_same_step(on, off, atol=1e-6)


def test_row_groups_respect_the_token_budget():
    batch = make_batch(tiny_model(), n=9)
    budget = 2 * batch.input_ids.shape[1] - 1  # below two full-width rows
    groups = row_groups(batch, size=3, max_tokens=budget)
    assert [i for g in groups for i in range(len(batch))[g]] == list(range(len(batch)))  # consecutive, all rows
    mbs = micro_batches(batch, 3, max_tokens=budget)
    assert len(mbs) == len(groups) and all(w == 1.0 for _, w in mbs)
    for g, (mb, _) in zip(groups, mbs, strict=True):
        assert len(mb) == g.stop - g.start <= 3
        assert mb.input_ids.numel() <= budget or len(mb) == 1
        if g.stop < len(batch) and len(mb) < 3:  # greedy: the next row would have broken the budget
            assert batch.select(slice(g.start, g.stop + 1)).input_ids.numel() > budget, g
    assert len(groups) > len(batch) // 3  # the budget, not the row cap, decided some splits
    assert row_groups(batch, size=3) == [slice(0, 3), slice(3, 6), slice(6, 9)]
    assert row_groups(batch, size=4, max_tokens=1) == [slice(i, i + 1) for i in range(9)]  # a lone row may exceed


@pytest.mark.parametrize("packing", [False, True])
def test_token_budget_train_step_equals_fixed_micro_batches(monkeypatch, packing):
    shapes, real = [], response_logprobs
    monkeypatch.setattr(trainer_module, "response_logprobs", lambda m, mb, *a, **k: shapes.append(
        (len(mb), int(mb.attention_mask.sum()) if packing else mb.input_ids.shape[1])) or real(m, mb, *a, **k))
    fixed = step(n=9, micro_batch_size=9, packing=packing)
    assert [n for n, _ in shapes] == [9]
    shapes.clear()
    budget = 24
    dynamic = step(n=9, micro_batch_size=9, max_tokens_per_micro_batch=budget, packing=packing)
    assert len(shapes) > 2 and sum(n for n, _ in shapes) == 9
    if packing:  # the budget counts real tokens
        assert all(t <= budget or n == 1 for n, t in shapes), shapes
    else:  # rows x padded width
        assert all(n * t <= budget or n == 1 for n, t in shapes), shapes
    assert_same_step(dynamic, fixed, atol=1e-6)


def test_optimizer_offload_keeps_state_on_cpu_and_same_step():
    off = step()
    on = step(optimizer_offload=True)
    state = on[1].opt.state
    assert len(state) == len(list(on[0].parameters()))
    assert all(v.device.type == "cpu" for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert_same_step(on, off, atol=1e-7)
    for p, q in zip(on[0].parameters(), off[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)


def adam_with_state(device="cpu"):
    p = torch.nn.Parameter(torch.randn(3, 4, device=device))
    opt = torch.optim.AdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    return opt, opt.state[p]


def test_move_optimizer_state_moves_moments_not_step():
    opt, st = adam_with_state()
    before = dict(st)
    move_optimizer_state(opt, torch.device("cpu"))  # already there: no copies
    assert all(st[k] is before[k] for k in before)
    move_optimizer_state(opt, "meta")  # a second device CPU-only torch has: new tensors, same shapes
    for k in ("exp_avg", "exp_avg_sq"):
        assert st[k] is not before[k] and st[k].device.type == "meta" and st[k].shape == before[k].shape
    assert st["step"] is before["step"] and st["step"].device.type == "cpu"  # AdamW's scalar stays on the host


@pytest.mark.gpu
def test_move_optimizer_state_round_trip_gpu():
    opt, st = adam_with_state("cuda")
    before = {k: v.clone() for k, v in st.items()}
    move_optimizer_state(opt, "cpu")
    assert st["exp_avg"].device.type == "cpu" and st["exp_avg_sq"].device.type == "cpu"
    move_optimizer_state(opt, "cuda")
    for k, v in before.items():
        assert torch.equal(st[k].cpu(), v.cpu()), k
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.randn_like(p)
    opt.step()  # the optimizer accepts the moved state


def _worker(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        local = split_for_rank(make_batch(tiny_model(), n=5), rank, world)  # 3 and 2 rows: 2 and 1 micro-batches
        train = TrainSection(micro_batch_size=2, lr=1e-3, activation_checkpointing=True, max_tokens_per_micro_batch=24)
        trainer = Trainer(shard_model(tiny_model()), train, ALGO, 1.0, 10, group)
        reference = Reference(shard_model(tiny_model()), 1.0, 2, group=group)
        out = {"logprobs": trainer.logprobs(local), "ref": reference.logprobs(local),
               "metrics": trainer.train_step(local)}
        out["state"] = full_state_dict(trainer.model)
        torch.save(out, f"{tmp}/rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    os._exit(0)  # skip interpreter teardown: gloo's threads there intermittently abort


def test_fsdp_scoring_and_memory_options_on_uneven_ranks(tmp_path):
    """Ranks with 3 and 2 rows run different micro-batch counts; scoring must neither hang nor shift rows, and
    a step with checkpointing and a token budget equals the plain unsharded step."""
    spawn(_worker, (2, str(tmp_path)), nprocs=2)
    batch = make_batch(tiny_model(), n=5)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        local = split_for_rank(batch, rank, 2)
        want = score(tiny_model(), local, 1.0, micro_batch_size=len(local))
        torch.testing.assert_close(got["logprobs"], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got["ref"], want, atol=1e-5, rtol=0)

    model = tiny_model()
    want = Trainer(model, TrainSection(micro_batch_size=5, lr=1e-3), ALGO, 1.0, 10).train_step(batch)
    got = torch.load(tmp_path / "rank0.pt")
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["state"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
    for k, v in want.items():
        assert abs(got["metrics"][k] - v) < 1e-5, k

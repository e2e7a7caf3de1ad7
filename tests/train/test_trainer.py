"""Training plane: gradient accumulation invariance, the loss it optimises, and parameters moving."""

import copy

import pytest
import torch
from conftest import make_batch, tiny_model

from twinplane.algos import PRESETS, LossSettings, aggregate, kl_penalty, token_policy_loss
from twinplane.config import AlgoSection, TrainSection
from twinplane.train import Batch, Reference, Trainer
from twinplane.train import trainer as trainer_module
from twinplane.train.critic import Critic, ValueModel
from twinplane.train.logprobs import response_logprobs

# keep_grads replaces the optimizer's step, which the LR scheduler notices and warns about
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def keep_grads(trainer: Trainer) -> None:
    """A trainer whose steps leave the gradients in place to inspect (no optimizer update, no zeroing)."""
    trainer.opt.step = lambda: None
    trainer.opt.zero_grad = lambda set_to_none=True: None


def step(micro, algo=None):
    model = tiny_model()
    trainer = Trainer(model, TrainSection(micro_batch_size=micro, lr=1e-2, grad_clip=0.0),
                      algo or AlgoSection(kl_coef=0.1, entropy_coef=0.01), temperature=1.0, total_steps=10)
    metrics = trainer.train_step(make_batch(tiny_model()))
    return model, metrics


def test_collate_lays_out_prompts_left_and_responses_right_by_hand():
    from twinplane.train.batch import Batch

    b = Batch.collate([[1, 2], [3]], [[4], [5, 6, 7]], pad_id=9, rollout_logprobs=[[-0.5], [-1.0, -2.0, -3.0]],
                      loss_masks=[[1], [1, 0, 1]])
    assert b.prompt_len == 2
    assert b.input_ids.tolist() == [[1, 2, 4, 9, 9], [9, 3, 5, 6, 7]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[1, 0, 0], [1, 0, 1]]
    assert b.rollout_logprobs.tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]]
    assert Batch.collate([[1], [2]], [[], [3]], pad_id=0).input_ids.tolist() == [[1, 0], [2, 3]]


def test_grad_accumulation_equals_one_batch():
    big, m1 = step(micro=6)
    small, m3 = step(micro=2)
    # after one Adam step at lr 1e-2: a near-zero gradient element moves by ~lr * sign, so summation-order rounding
    # (different micro-batches pack into different attention groups) can show at ~1e-6; a wrong loss shows at ~lr
    for (n, a), (_, b) in zip(big.named_parameters(), small.named_parameters(), strict=False):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=n)
    for k in m1:
        assert abs(m1[k] - m3[k]) < 1e-5, k


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_grad_accumulation_equals_one_batch_for_every_algorithm(name):
    """Every preset's loss (its policy loss and aggregation, with KL and entropy terms) is normalised over the
    global batch: 3 micro-batches give the same gradient and metrics as one. (Gradients, not Adam's update: a
    near-zero gradient element makes Adam's first step ~lr * sign, which amplifies rounding.)"""
    algo = AlgoSection(name=name, kl_coef=0.1, entropy_coef=0.01)
    batch = make_batch(tiny_model())
    grads, metrics = [], []
    for micro in (6, 2):
        model = tiny_model()
        trainer = Trainer(model, TrainSection(micro_batch_size=micro, grad_clip=0.0), algo, 1.0, 10, horizon=8)
        keep_grads(trainer)
        metrics.append(trainer.train_step(batch))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5, msg=n)
    assert any(g.abs().max() > 0 for g in grads[0].values())
    for k in metrics[0]:
        assert abs(metrics[0][k] - metrics[1][k]) < 1e-5, k


def test_loss_is_token_mean_of_clipped_objective():
    """Recompute the objective by hand on the whole batch and compare gradients."""
    algo = AlgoSection(kl_coef=0.1, kl_estimator="k2", clip_low=0.1, clip_high=0.1)
    batch = make_batch(tiny_model())
    model = tiny_model()
    lp, _ = response_logprobs(model, batch, 1.0)
    m = batch.response_mask
    s = LossSettings(clip_low=0.1, clip_high=0.1)
    pg, _, _ = token_policy_loss("ppo", lp, batch.rollout_logprobs, batch.advantages, m, s)
    loss = ((pg + 0.1 * kl_penalty(lp, batch.ref_logprobs, "k2")) * m).sum() / m.sum()
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model2 = tiny_model()
    trainer = Trainer(model2, TrainSection(micro_batch_size=4, grad_clip=0.0), algo, 1.0, 10)
    keep_grads(trainer)
    trainer.train_step(batch)
    for n, p in model2.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=1e-5, msg=n)


def test_parameters_change_and_reference_is_frozen():
    model = tiny_model()
    ref = Reference(copy.deepcopy(model), 1.0, 4)
    before = {n: p.clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, TrainSection(lr=1e-3), AlgoSection(kl_coef=0.05), 1.0, 10)
    batch = make_batch(tiny_model())
    ref_before = ref.logprobs(batch)
    m = trainer.train_step(batch)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(ref.logprobs(batch), ref_before)
    assert m["actor/grad_norm"] > 0 and m["actor/kl"] > 0


def test_seq_mean_token_sum_norm_loss_by_hand():
    """dr_grpo's aggregation in the trainer: mean over rows of row sums / the horizon (the generation cap)."""
    algo = AlgoSection(name="dr_grpo")
    batch = make_batch(tiny_model())
    model = tiny_model()
    lp, _ = response_logprobs(model, batch, 1.0)
    m = batch.response_mask
    s = LossSettings(clip_low=0.2, clip_high=0.28)
    pg, _, _ = token_policy_loss("ppo", lp, batch.rollout_logprobs, batch.advantages, m, s)
    loss = aggregate(pg, m, "seq-mean-token-sum-norm", horizon=8)
    assert float(loss.detach()) == pytest.approx(float(((pg.detach() * m).sum(-1) / 8).mean()), rel=1e-6)
    loss.backward()
    model2 = tiny_model()
    trainer = Trainer(model2, TrainSection(micro_batch_size=4, grad_clip=0.0), algo, 1.0, 10, horizon=8)
    keep_grads(trainer)
    trainer.train_step(batch)
    for n, p in model2.named_parameters():
        torch.testing.assert_close(p.grad, dict(model.named_parameters())[n].grad, atol=1e-6, rtol=1e-5, msg=n)


def test_autocast_runs_the_residual_stream_in_the_compute_dtype():
    """Mixed precision with fp32 master weights (one rank, autocast): each decoder layer's input, and cos/sin,
    are in the compute dtype, as with FSDP's params cast to it; the logits equal a bf16 copy's within bf16's
    rounding."""
    model = tiny_model()
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, args[1].dtype)))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        got = model(ids).float()
    assert seen == [(torch.bfloat16, torch.bfloat16)] * len(model.model.layers)
    with torch.no_grad():
        want = copy.deepcopy(model).to(torch.bfloat16)(ids).float()
        full = model(ids)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    assert (got - full).abs().max() < 0.2 and seen[-1] == (torch.float32, torch.float32)  # no autocast: fp32


class ReadBack(Exception):
    pass


def shared_prompt_batch():
    """Six rows, each prompt twice (a shared prompt where `train.share_prompts`), ragged responses."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 50, (n,), generator=g).tolist() for n in (3, 6, 2)] * 2
    responses = [torch.randint(4, 50, (n,), generator=g).tolist() for n in (4, 1, 7, 5, 3, 2)]
    batch = Batch.collate(prompts, responses, 0, [[-1.0] * len(r) for r in responses])
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch, g


@pytest.mark.parametrize("share", [False, True])
def test_a_step_reads_the_device_once_at_its_end(monkeypatch, share):
    """A training step, a scoring pass and the critic's values and step read nothing back from the device until
    the step's one readback: on a GPU each read waits for every queued kernel, and the device idles while the
    host catches up. Run on the meta device, where every read raises (a boolean index, `.tolist()`, `.item()`, a
    `nonzero`), each step gets to its readback; the micro-batches are planned from the host batch."""
    real_enabled, real_autocast = torch.is_autocast_enabled, torch.autocast

    class Autocast(real_autocast):  # (autocast knows no meta device: it does nothing there)
        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: a[:1] != ("meta",) and real_enabled(*a))
    monkeypatch.setattr(torch, "autocast", Autocast)

    def readback(sums, grad_norm, group, device):
        assert {t.device.type for t in sums.values() if isinstance(t, torch.Tensor)} == {"meta"}
        raise ReadBack

    monkeypatch.setattr(trainer_module, "step_readback", readback)
    batch, g = shared_prompt_batch()
    train = TrainSection(micro_batch_size=4, max_tokens_per_micro_batch=24, share_prompts=share, lr=1e-3)
    reference = Reference(tiny_model().to("meta"), 1.0, 4, max_tokens=24, train=train)
    batch.ref_logprobs = reference.logprobs(batch)  # a scoring pass
    assert batch.ref_logprobs.device.type == "meta"
    trainer = Trainer(tiny_model().train().to("meta"), train, AlgoSection(kl_coef=0.1, entropy_coef=0.01), 1.0, 10)
    with pytest.raises(ReadBack):
        trainer.train_step(batch)
    critic = Critic(ValueModel(tiny_model().config).to("meta"), 1e-3, (0.9, 0.999), 0.0, 0.2, 1.0, 4, 24)
    batch.old_values = critic.values(batch)  # (padded rows: the critic runs a padded batch)
    batch.returns = torch.randn(batch.response_mask.shape, generator=g)
    assert batch.old_values.device.type == "meta"
    with pytest.raises(ReadBack):
        critic.train_step(batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("share", [False, True])
def test_a_step_on_a_gpu_waits_for_it_once(monkeypatch, share):
    """On a GPU, with CUDA's sync debug mode set to raise at any host wait: a training step (after a first one,
    which runs the kernels' self-checks) and a reference scoring pass never wait for the device; the step's one
    read happens after the mode is switched off."""
    batch, _ = shared_prompt_batch()
    train = TrainSection(micro_batch_size=4, max_tokens_per_micro_batch=24, share_prompts=share, lr=1e-3,
                         compile="off")  # (the probe counts the compiled step's waits)
    trainer = Trainer(tiny_model().cuda().train(), train, AlgoSection(kl_coef=0.1, entropy_coef=0.01), 1.0, 10)
    reference = Reference(tiny_model().cuda(), 1.0, 4, max_tokens=24, train=train)
    batch.ref_logprobs = reference.logprobs(batch).cpu()
    trainer.train_step(batch)
    real = trainer_module.step_readback

    def readback(*args):
        torch.cuda.set_sync_debug_mode("default")
        return real(*args)

    monkeypatch.setattr(trainer_module, "step_readback", readback)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        reference.logprobs(batch)
        trainer.train_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")

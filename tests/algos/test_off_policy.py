"""The off-policy correction suite: weights and masks by hand, verl's `rollout_corr_helper` numbers reproduced by
independent few-line references, the decoupled objective, the metrics, and their effect on a train step."""

import copy
import math

import pytest
import torch
from conftest import make_batch, tiny_model

from twinplane.algos import Algorithm, LossSettings, policy_loss, truncated_is_weights
from twinplane.algos.off_policy import (
    CorrectionSettings,
    band_keep,
    correction,
    correction_metrics,
    icepop_weights,
    masked_quantiles,
    sequence_is_weights,
)
from twinplane.cluster import LocalPlanes
from twinplane.config import AlgoSection, ConfigError, TrainSection, load_config
from twinplane.controller import Controller
from twinplane.data.prompts import Prompt
from twinplane.data.tasks import ALPHABET
from twinplane.model.lora import apply_lora
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.tokenizer import build_char_tokenizer
from twinplane.train import Reference, Trainer
from twinplane.train.logprobs import response_logprobs

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]]).float()  # row 2 has a gap


def _log(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float64))


def test_sequence_weights_by_hand():
    # ratios per token (rollout log-probs 0): row 0 1.5 * 1.2 (the 5.0 is padding), row 1 3 * 0.5 * 1, row 2 4 * 1
    old = _log([[1.5, 1.2, 5.0], [3.0, 0.5, 1.0], [4.0, 7.0, 1.0]])
    w = sequence_is_weights(old, torch.zeros(3, 3, dtype=torch.float64), MASK.double(), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.8] * 3, [1.5] * 3, [2.0] * 3], dtype=torch.float64))
    assert not w.requires_grad


def test_icepop_and_band_masks_by_hand():
    old = _log([[0.4, 0.5, 1.0, 3.0, 6.0]])
    zero = torch.zeros_like(old)
    torch.testing.assert_close(icepop_weights(old, zero, 0.5, 5.0),
                               torch.tensor([[0.0, 0.5, 1.0, 3.0, 0.0]], dtype=torch.float64))
    m = torch.ones(1, 5)
    assert band_keep(old, zero, m, "token", 0.5, 5.0).tolist() == [[False, True, True, True, False]]
    # rows: ratios (1.5, 1.2): product 1.8, geometric mean sqrt(1.8) = 1.34; (3, 0.5, 1): 1.5, 1.145; (4, _, 1): 4, 2
    old = _log([[1.5, 1.2, 5.0], [3.0, 0.5, 1.0], [4.0, 7.0, 1.0]])
    zero = torch.zeros_like(old)
    seq = band_keep(old, zero, MASK, "sequence", 0.5, 1.6)
    assert seq[:, 0].tolist() == [False, True, False] and seq.shape == (3, 3) and (seq == seq[:, :1]).all()
    geo = band_keep(old, zero, MASK, "geometric", 0.8, 1.2)
    assert geo[:, 0].tolist() == [False, True, False]
    assert band_keep(old, zero, MASK, "geometric", 0.8, 1.4)[:, 0].tolist() == [True, True, False]
    # the mean is over the row's masked tokens: row 0's 1.34 (over the padded width, 1.8^(1/3) = 1.22) leaves
    assert band_keep(old, zero, MASK, "geometric", 0.8, 1.25)[:, 0].tolist() == [False, True, False]
    with pytest.raises(ValueError, match="unknown mask level"):
        band_keep(old, zero, MASK, "row", 0.5, 2.0)


def _spread(seed):
    g = torch.Generator().manual_seed(seed)
    old = -1.0 + 0.5 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    rollout = old - 0.6 * torch.randn(6, 5, generator=g, dtype=torch.float64)  # ratios ~ e^(+-0.6)
    mask = (torch.rand(6, 5, generator=g) > 0.2).double()
    mask[:, 0] = 1
    return old, rollout, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_weights_equal_verl(level):
    """verl `compute_rollout_correction_weights(log_ratio, mask, rollout_is=level, rollout_is_threshold=2.0)`."""
    old, rollout, m = _spread(0)
    log_ratio = old - rollout
    if level == "token":
        verl = torch.exp(log_ratio.clamp(-20, 20))
    else:
        verl = torch.exp((log_ratio * m).sum(-1, keepdim=True).clamp(-20, 20)).expand_as(log_ratio)
    verl = (verl * m).clamp(max=2.0)
    w, keep = correction(old, rollout, m, weight=level, keep="off",
                         settings=CorrectionSettings(cap=2.0, low=0.5, high=2.0))
    assert keep is None and 0 < int(((w == 2.0) & (m > 0)).sum()) < int(m.sum())  # some truncated, not all
    torch.testing.assert_close(w * m, verl)
    if level == "token":
        torch.testing.assert_close(w, truncated_is_weights(old, rollout, 2.0))


@pytest.mark.parametrize(("level", "option", "low", "high"), [("token", "token_k1", 0.7, 1.6),
                                                              ("sequence", "seq_sum_k1", 0.4, 3.0),
                                                              ("geometric", "seq_mean_k1", 0.85, 1.2)])
def test_band_masks_equal_verl(level, option, low, high):
    """verl `compute_rollout_rejection_mask(log_ratio, mask, rollout_rs=option, rollout_rs_threshold=f"{1/high}_
    {1/low}")`: verl's k1 statistic is log(pi_rollout / pi_old), so its band is the reciprocal of ours."""
    old, rollout, m = _spread(1)
    k1 = -(old - rollout).clamp(-20, 20)
    if option == "token_k1":
        stat = k1
    elif option == "seq_sum_k1":
        stat = (k1 * m).sum(-1, keepdim=True)
    else:
        stat = (k1 * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) + 1e-8)
    verl = m * ((stat >= math.log(1 / high)) & (stat <= math.log(1 / low)))
    keep = band_keep(old, rollout, m, level, low, high)
    assert 0 < int((keep & (m > 0)).sum()) < int(m.sum())  # the band keeps some tokens and drops others
    torch.testing.assert_close(m * keep, verl)


def test_decoupled_objective_equals_verl():
    """verl's decoupled mode: `compute_policy_loss_vanilla(old_log_prob=proximal, ..., rollout_is_weights=w)` with
    w from `compute_rollout_correction_weights(proximal - behaviour, rollout_is="token")`, dual clip 3, token-mean:
    the clip is centred on the proximal policy, the weight corrects towards the behaviour policy."""
    g = torch.Generator().manual_seed(5)
    prox = -1.0 + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    lp = (prox + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)).requires_grad_()
    behaviour = prox - 0.5 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 5, generator=g, dtype=torch.float64)
    m = torch.ones(4, 5, dtype=torch.float64)
    m[1, 3:] = 0
    w_verl = (torch.exp((prox - behaviour).clamp(-20, 20)) * m).clamp(max=2.0)
    ratio = torch.exp((lp - prox).clamp(-20, 20))
    l1, l2 = -adv * ratio, -adv * ratio.clamp(0.8, 1.28)
    clip1 = torch.maximum(l1, l2)
    pg = torch.where(adv < 0, torch.min(-adv * 3.0, clip1), clip1) * w_verl
    want = (pg * m).sum() / m.sum()
    w, _ = correction(prox, behaviour, m, weight="token", keep="off",
                      settings=CorrectionSettings(cap=2.0, low=0.5, high=2.0))
    got, _ = policy_loss("ppo", lp, prox, adv, m, LossSettings(clip_low=0.2, clip_high=0.28, clip_c=3.0), is_weights=w)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got, lp)
    (g_want,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(g_got, g_want)


def test_masked_quantiles_against_torch_quantile():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 9, generator=g, dtype=torch.float64)
    m = (torch.rand(7, 9, generator=g) > 0.4).double()
    qs = (0.0, 0.05, 0.5, 0.95, 1.0)
    want = torch.quantile(x[m > 0], torch.tensor(qs, dtype=torch.float64))  # linear interpolation
    torch.testing.assert_close(masked_quantiles(x, m, qs), want)
    one = torch.zeros(2, 2)
    one[1, 0] = 1
    torch.testing.assert_close(masked_quantiles(torch.full((2, 2), 3.0), one, qs), torch.full((5,), 3.0))
    assert masked_quantiles(x, torch.zeros_like(m), qs).tolist() == [0.0] * 5


def test_correction_metrics_by_hand():
    # one row of ratios 0.4, 1, 2, 4 and a padding token; icepop band [0.5, 3]: weights 0, 1, 2, 0
    old = _log([[0.4, 1.0, 2.0, 4.0, 9.0]])
    rollout = torch.zeros_like(old)
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    w, keep = correction(old, rollout, m, weight="icepop", keep="token",
                         settings=CorrectionSettings(cap=2.0, low=0.5, high=3.0))
    out = {k: float(v) for k, v in correction_metrics(old, rollout, m, w, keep, 2.0, num_tokens=8.0,
                                                      ranks=2).items()}
    # the global batch has 8 tokens (this rank's 4 and another's); the quantiles are halved (mean over 2 ranks)
    assert out["tis_weight_mean"] == pytest.approx(3 / 8)
    assert out["tis_clip_frac"] == pytest.approx(1 / 8)  # the weight 2 is at the cap
    assert out["tis_masked_frac"] == pytest.approx(2 / 8)  # 0.4 and 4: dropped by both mask and icepop
    # ratios sorted 0.4, 1, 2, 4: p50 at position 1.5 -> 1.5, p05 at 0.15 -> 0.49, p95 at 2.85 -> 3.7
    assert (out["tis_ratio_p05"], out["tis_ratio_p50"], out["tis_ratio_p95"]) == pytest.approx((0.49 / 2, 0.75,
                                                                                                3.7 / 2))


def _step(batch, **algo):
    model = tiny_model()
    cfg = AlgoSection(clip_low=0.2, clip_high=0.2, **algo)
    trainer = Trainer(model, TrainSection(micro_batch_size=2, lr=1e-2, grad_clip=0.0), cfg, 1.0, 10, tis_cap=2.0)
    return trainer.train_step(batch)


def _skewed_batch():
    """pi_old = the model itself (PPO ratio 1), the engine off by a factor 1.5 on even rows and 4 on odd rows."""
    batch = make_batch(tiny_model(), n=6)
    with torch.no_grad():
        batch.old_logprobs = response_logprobs(tiny_model(), batch, 1.0)[0] * batch.response_mask
    odd = (torch.arange(6) % 2 == 1)[:, None]  # [N, 1]
    batch.rollout_logprobs = batch.old_logprobs - torch.where(odd, math.log(4.0), math.log(1.5))
    return batch, odd


def test_token_mask_leaves_the_loss_and_its_denominator():
    """is_mask=token with the band [0.5, 2]: the odd rows (ratio 4) leave the loss, the even rows keep their token
    TIS weight 1.5: pg_loss = -sum(A w) / (even rows' tokens)."""
    batch, odd = _skewed_batch()
    m = batch.response_mask
    metrics = _step(batch, is_mask="token")
    even = m * ~odd
    assert metrics["actor/pg_loss"] == pytest.approx(float((-batch.advantages * 1.5 * even).sum() / even.sum()))
    assert metrics["actor/tis_masked_frac"] == pytest.approx(float((m * odd).sum() / m.sum()))
    ratios = torch.where(odd, 4.0, 1.5).expand_as(m)[m > 0]  # the quantiles are over all tokens, masked or not
    want = torch.quantile(ratios.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    got = [metrics[f"actor/tis_ratio_p{p}"] for p in ("05", "50", "95")]
    assert got == pytest.approx(want) and got[0] != got[2]
    plain = _step(batch)  # the defaults: token TIS only, nothing masked
    assert plain["actor/tis_masked_frac"] == 0.0
    w = torch.where(odd, 2.0, 1.5)
    assert plain["actor/pg_loss"] == pytest.approx(float((-batch.advantages * w * m).sum() / m.sum()))


def test_sequence_weight_and_icepop_in_a_step():
    batch, odd = _skewed_batch()
    m = batch.response_mask
    # sequence: each row's weight is min(ratio^|y|, 2): 1.5 for one-token even rows, 2 otherwise
    n = m.sum(-1, keepdim=True)
    w = torch.where(odd | (n > 1), 2.0, 1.5)
    seq = _step(batch, is_weight="sequence")
    assert seq["actor/pg_loss"] == pytest.approx(float((-batch.advantages * w * m).sum() / m.sum()))
    # icepop in [0.5, 2]: the odd rows' weight is 0 but their tokens stay in the denominator
    ice = _step(batch, is_weight="icepop")
    w = torch.where(odd, 0.0, 1.5)
    assert ice["actor/pg_loss"] == pytest.approx(float((-batch.advantages * w * m).sum() / m.sum()))
    assert ice["actor/tis_masked_frac"] == pytest.approx(float((m * odd).sum() / m.sum()))


def test_the_algorithm_applies_the_keys():
    old = _log([[1.0, 3.0]])
    algo = Algorithm(AlgoSection(is_weight="off", is_mask="token", is_low=0.5, is_high=2.0), 0)
    w, keep, _ = algo.off_policy(old, torch.zeros_like(old), torch.ones(1, 2), 2.0, 2.0)
    assert w is None and keep.tolist() == [[True, False]]


@pytest.mark.parametrize(("override", "message"), [
    ("algo.is_low=1.0 algo.is_high=1.0", r"^algo\.is_low: must be below algo\.is_high, got 1\.0$"),
    ("algo.is_low=1.5", r"^algo\.is_low: must be in \(0, 1\], got 1\.5$"),
    ("algo.is_high=0.9", r"^algo\.is_high: must be >= 1, got 0\.9$"),
    ("algo.policy_loss=cispo algo.clip_c=3",
     r"^algo\.clip_c: is the dual clip of policy_loss ppo and gspo \(this one is cispo\), got 3\.0$"),
    ("algo.is_mask=row", r"^algo\.is_mask: must be one of"),
])
def test_bad_keys_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())
    assert load_config(None, ["algo.is_mask=geometric", "algo.policy_loss=gmpo", "algo.loss_agg=token-sum"])


# --- pi_old from the update's own forward (`Batch.old_is_current`) ------------------------------------------------

def _updates(algo, current, lora_dropout=0.0):
    """One step with pi_old from a separate scoring pass (`current` False) or from the step's own forward:
    (metrics, updated weights, grads). Rollout log-probs are the model's plus noise, so the correction acts;
    tool-masked responses, several micro-batches."""
    model = tiny_model()
    if lora_dropout:
        apply_lora(model, 4, 8.0, lora_dropout)
        with torch.no_grad():  # B = 0 at init: make the adapters (and their dropout) change the log-probs
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    cfg = AlgoSection(kl_coef=0.1, entropy_coef=0.01, **algo)
    trainer = Trainer(model, TrainSection(micro_batch_size=2, lr=1e-2, grad_clip=1.0), cfg, 1.0, 10, tis_cap=1.1)
    trainer.opt.zero_grad = lambda set_to_none=True: None  # keep the grads to compare
    batch = make_batch(tiny_model(), n=7, tool_masks=True)
    if current:
        batch.old_is_current = True
    else:
        batch.old_logprobs = trainer.logprobs(batch)
    torch.manual_seed(3)  # the dropout masks
    metrics = trainer.train_step(batch)
    params = dict(model.named_parameters())
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    return metrics, {n: p.detach() for n, p in params.items()}, grads


@pytest.mark.parametrize("algo", [
    dict(is_weight="token"),
    dict(is_weight="sequence"),
    dict(is_weight="icepop", is_low=0.9, is_high=1.1),
    dict(is_weight="sequence", policy_loss="gspo", loss_agg="seq-mean-token-mean"),
    dict(is_weight="token", is_mask="geometric", is_low=0.97, is_high=1.03),  # scored first: sets the denominator
    dict(is_weight="token", lora_dropout=0.3),  # scored first: a forward with dropout is not the policy
])
def test_old_logprobs_from_the_update_equal_a_separate_forward(algo):
    """With one update per batch pi_old is the policy the step's forwards evaluate: taking it from them (detached,
    per micro-batch, the correction's metrics over the whole batch) gives the separate forward's loss, grads,
    weights and metrics. (On the CPU they are in fact bitwise equal, the two forwards being one computation; the
    tolerance leaves a scoring pass free to use other kernels than a training forward.)"""
    algo = dict(algo)
    dropout = algo.pop("lora_dropout", 0.0)
    (want, w_params, w_grads), (got, g_params, g_grads) = (_updates(algo, c, dropout) for c in (False, True))
    assert 0 < want["actor/tis_clip_frac"] < 1 or 0 < want["actor/tis_masked_frac"] < 1  # the correction acts
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert g_grads.keys() == w_grads.keys() and g_grads
    for n in w_grads:
        torch.testing.assert_close(g_grads[n], w_grads[n], rtol=1e-6, atol=1e-9, msg=n)
    for n in w_params:
        torch.testing.assert_close(g_params[n], w_params[n], rtol=1e-6, atol=1e-9, msg=n)


class _Scorer:
    last_verifier: list[float] = []

    def __call__(self, completions, answers, prompts=None):
        self.last_verifier = [float(i % 2) for i in range(len(completions))]  # rewards that differ in each group
        return self.last_verifier, {}


class _Recording(Trainer):
    def train_step(self, batch):
        self.seen.append(batch.old_is_current)
        return super().train_step(batch)


@pytest.mark.parametrize(("mini_batches", "recompute", "algo", "phase"), [
    (1, True, {}, False),  # pi_old from the update's forward
    (2, True, {}, True),  # the second mini-batch trains a moved policy
    (1, True, {"kl_in_reward": True}, True),  # the reward reads pi_old before the update
    (1, True, {"is_mask": "token"}, True),  # the band sets the loss's denominator
    (1, False, {}, False),  # the ratio and nothing else against the engine's log-probs
])
def test_the_old_logprob_phase_runs_only_when_pi_old_is_read_before_the_update(mini_batches, recompute, algo, phase):
    tok = build_char_tokenizer(ALPHABET)
    model = tiny_model(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16)
    engine = RolloutEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, 64, seed=0)
    cfg = AlgoSection(**algo)
    trainer = _Recording(model, TrainSection(micro_batch_size=4), cfg, 1.0, 10, tis_cap=2.0)
    trainer.seen = []
    reference = Reference(copy.deepcopy(model), 1.0, 4) if cfg.kl_in_reward else None
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, n=2)
    controller = Controller(LocalPlanes(engine, trainer, reference), _Scorer(), tok, sampling, mini_batches,
                            recompute, algo=Algorithm(cfg, 4))
    m = controller.step([Prompt(tok.encode(q), a, q) for q, a in (("12+34=", "46"), ("5+6=", "11"))])
    assert ("time/old_logprob" in m) == phase
    assert trainer.seen == [recompute and not phase] * mini_batches
    assert ("actor/tis_weight_mean" in m) == recompute  # corrected either way

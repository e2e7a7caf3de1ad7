"""Keys that name a registered function (`algo.policy_loss`, `algo.adv_estimator`, ..., `reward.name`) read their
choices from the registry when asked: a policy loss registered after the config was defined validates, is listed in
`twinplane train --help` and is offered for a misspelling; an unknown name is one line naming the choices."""

import pytest
import torch

from twinplane.algos import POLICY_LOSSES, Algorithm, register_policy_loss
from twinplane.algos.losses import ppo
from twinplane.cli import main
from twinplane.config import AlgoSection, ConfigError, load_config


@pytest.fixture
def twin():
    """ppo under another name, registered for the test only."""

    @register_policy_loss("ppo_twin", "ppo under another name")
    def ppo_twin(logprobs, old_logprobs, advantages, mask, s, is_weights):
        return ppo(logprobs, old_logprobs, advantages, mask, s, is_weights)

    yield "ppo_twin"
    POLICY_LOSSES.unregister("ppo_twin")


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    return str(e.value)


def test_a_registered_policy_loss_validates_and_trains(twin):
    cfg = load_config(None, [f"algo.policy_loss={twin}"])
    assert cfg.algo.policy_loss == twin
    lp, old = torch.tensor([[0.1, -0.2]]), torch.tensor([[0.0, 0.0]])
    adv, m = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    kw = dict(entropy=torch.zeros(1, 2), ref_logprobs=None, is_weights=None, norm=2.0, num_tokens=2.0)
    got, _ = Algorithm(cfg.algo, 8).loss(lp, old, adv, m, **kw)
    want, _ = Algorithm(AlgoSection(policy_loss="ppo"), 8).loss(lp, old, adv, m, **kw)
    assert torch.equal(got, want)


def test_a_registered_policy_loss_is_in_the_help(twin, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    line = next(line for line in capsys.readouterr().out.splitlines() if "algo.policy_loss =" in line)
    assert f" | {twin} (ppo under another name): the per-token policy loss" in line


def test_a_misspelt_policy_loss_gets_the_registered_name(twin):
    names = ", ".join(POLICY_LOSSES)
    assert twin in names
    assert refusal("algo.policy_loss=ppo_twni") == \
        f"algo.policy_loss: must be one of {names}, got 'ppo_twni' (did you mean {twin}?)"
    assert refusal("algo.policy_loss=nope") == f"algo.policy_loss: must be one of {names}, got 'nope'"


def test_the_registry_refuses_an_unknown_name_in_one_line():
    with pytest.raises(ValueError, match=r"^unknown policy loss 'ppo_twin' \(choose from ppo, gspo, .*\)$"):
        POLICY_LOSSES.lookup("ppo_twin")
    with pytest.raises(ValueError, match="policy loss 'ppo' is registered already"):
        register_policy_loss("ppo")(ppo)


@pytest.mark.parametrize(("key", "typo", "meant"), [
    ("algo.adv_estimator", "rlo", "rloo"),
    ("algo.loss_agg", "token_mean", "token-mean"),
    ("algo.kl_estimator", "k33", "k3"),
    ("algo.is_weight", "icepops", "icepop"),
    ("algo.is_mask", "geometrc", "geometric"),
    ("algo.name", "dr-grpo", "dr_grpo"),
    ("reward.name", "gsm8", "gsm8k"),
])
def test_each_registry_key_hints_its_names(key, typo, meant):
    assert refusal(f"{key}={typo}").endswith(f", got '{typo}' (did you mean {meant}?)")


def test_reward_name_lists_the_built_ins_and_takes_a_user_function(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "exact_int | code | module:function | path/file.py:function: " in out
    assert load_config(None, ["reward.name=twinplane.rewards:exact_int"]).reward.name == "twinplane.rewards:exact_int"
    assert refusal("reward.name=nope") == ("reward.name: must be one of gsm8k, math, exact_match, exact_int, code, "
                                           "module:function, path/file.py:function, got 'nope'")

"""PPO's critic (value model vs transformers, value loss falling, resume) and DAPO's dynamic sampling."""

import copy

import pytest
import torch
from conftest import TINY_RUN, make_batch, outcome, tiny_model

from twinplane.algos import Algorithm
from twinplane.cli import main
from twinplane.cluster import LocalPlanes
from twinplane.config import AlgoSection, TrainSection
from twinplane.controller import Controller
from twinplane.data.prompts import Prompt
from twinplane.data.tasks import ALPHABET
from twinplane.model import ModelConfig
from twinplane.model.export import export_weights
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.tokenizer import build_char_tokenizer
from twinplane.train import Trainer
from twinplane.train.critic import Critic, build_value_model, response_values

transformers = pytest.importorskip("transformers")


def test_value_model_matches_transformers_token_classification():
    """The critic is LlamaForTokenClassification(num_labels=1): same names, same values on a padded batch."""
    hf_cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    ref = transformers.LlamaForTokenClassification(hf_cfg).eval()
    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    ours = build_value_model(cfg, ref.state_dict().items(), torch.device("cpu"), torch.float32).eval()
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in ref.named_parameters()}
    ids = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        got = ours(ids, mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-4)


def test_critic_starts_from_the_policy_and_its_value_loss_falls():
    policy = tiny_model()
    model = build_value_model(policy.config, export_weights(policy), torch.device("cpu"), torch.float32)
    for n, p in model.named_parameters():
        if n.startswith("model."):
            assert torch.equal(p, dict(policy.named_parameters())[n]), n
    critic = Critic(model, 1e-2, [0.9, 0.999], 0.0, value_clip=0.5, grad_clip=1.0, micro_batch_size=2)
    batch = make_batch(tiny_model())
    assert torch.equal(critic.values(batch), torch.zeros_like(batch.response_mask))  # the zero-initialised head
    batch.returns = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    batch.returns = batch.returns * batch.response_mask
    losses = []
    for _ in range(15):
        batch.old_values = critic.values(batch)
        losses.append(critic.train_step(batch)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    # the value at each response position is the one the full forward gives there
    full = response_values(model, batch)
    torch.testing.assert_close(critic.values(batch), full.detach() * batch.response_mask, atol=1e-6, rtol=1e-5)


def test_critic_token_sum_is_the_token_mean_times_the_tokens():
    """critic.loss_agg=token-sum: the first step's value loss (same weights, same batch) is the token-mean one
    times the batch's response tokens, with micro-batches of 2 rows summed."""
    def first_loss(agg):
        model = build_value_model(tiny_model().config, export_weights(tiny_model()), torch.device("cpu"),
                                  torch.float32)
        critic = Critic(model, 1e-2, [0.9, 0.999], 0.0, value_clip=0.5, grad_clip=1.0, micro_batch_size=2,
                        loss_agg=agg)
        batch = make_batch(tiny_model())
        batch.returns = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
        batch.old_values = critic.values(batch)
        return critic.train_step(batch)["critic/vf_loss"], batch.num_response_tokens

    mean, tokens = first_loss("token-mean")
    total, _ = first_loss("token-sum")
    assert total == pytest.approx(mean * tokens, rel=1e-5) and tokens > 6


PPO = ["algo.name=ppo", "critic.warmup_steps=2", "algo.kl_in_reward=true", "algo.kl_ctrl=adaptive",
       "critic.lr=1e-3"]


@pytest.mark.slow
def test_ppo_interrupted_then_resumed_is_bitwise(tmp_path):
    """Critic weights and AdamW state, the adaptive KL coefficient and the warmup all come back exactly."""
    def train(run_dir, *extra, fault=None):
        import os

        os.environ.pop("TWINPLANE_FAULT", None)
        if fault:
            os.environ["TWINPLANE_FAULT"] = fault
        try:
            return main(["train", "--run-dir", str(run_dir), *TINY_RUN, *PPO, *extra])
        finally:
            os.environ.pop("TWINPLANE_FAULT", None)

    assert train(tmp_path / "a") == 0
    assert train(tmp_path / "b", fault="train@3") == 75
    assert (next((tmp_path / "b" / "checkpoints").iterdir()) / "critic.safetensors").exists()
    assert train(tmp_path / "b", "--resume", "auto") == 0
    (wa, ra), (wb, rb) = outcome(tmp_path / "a"), outcome(tmp_path / "b")
    assert wa == wb and ra == rb
    steps = [r for r in ra if r["step"] > 0]
    assert "actor/pg_loss" not in steps[0] and "actor/pg_loss" in steps[2]  # critic warmup: the actor waited
    assert all("critic/vf_loss" in r and "critic/explained_variance" in r for r in steps)
    assert len({r["actor/reward_kl_coef"] for r in steps}) > 1  # the adaptive controller moved


class PromptScorer:
    """Rewards by prompt: prompt 'A' always scores 1 (an all-equal group); 'B' alternates 1, 0 (informative)."""

    def __init__(self):
        self.last_verifier = []

    def __call__(self, completions, answers, prompts=None):
        out = [1.0 if p == "A" else float(i % 2) for i, p in enumerate(prompts)]
        self.last_verifier = out
        return out, {}


class Recording(Trainer):
    def train_step(self, batch):
        self.seen.append(batch)
        return super().train_step(batch)


def test_dapo_trains_only_on_informative_groups_and_counts_extra_batches():
    tok = build_char_tokenizer(ALPHABET)
    cfg = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               num_kv_heads=1, head_dim=16)
    model = tiny_model(**cfg)
    engine = RolloutEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, 64, seed=0)
    algo = AlgoSection(name="dapo", overlong_buffer=0, max_gen_batches=3)
    trainer = Recording(model, TrainSection(micro_batch_size=64), algo, 1.0, 10)
    trainer.seen = []
    prompt = {name: Prompt(tok.encode("12+34="), "46", name) for name in "AB"}
    queue = [[prompt["A"], prompt["A"]], [prompt["B"], prompt["A"]]]
    n = 4
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, n=n)
    controller = Controller(LocalPlanes(engine, trainer), PromptScorer(), tok, sampling, algo=Algorithm(algo, 4),
                            more_prompts=lambda: queue.pop(0))
    m = controller.step([prompt["A"], prompt["B"]])  # one informative group; 2 wanted; the next batch has none
    assert m["rollout/gen_batches"] == 3 and m["rollout/groups_kept"] == 2 and m["rollout/groups_dropped"] == 4
    (batch,) = trainer.seen
    assert len(batch) == 2 * n  # the two 'B' groups only
    adv = batch.advantages.sum(-1) / batch.response_mask.sum(-1)
    assert (adv.abs() > 0).all()  # every trained sample carries a signal
    assert queue == []  # exactly two extra batches were drawn
    controller.more_prompts = lambda: [prompt["A"], prompt["A"]]
    m = controller.step([prompt["A"], prompt["A"]])  # never informative: stops at max_gen_batches
    assert m["rollout/gen_batches"] == 3 and m["rollout/groups_kept"] == 0


def test_critic_starts_from_critic_model_path(tmp_path):
    """`critic.model_path`: a value model folder of the policy's shape (decoder + `score`) is where the critic
    starts, head included; preflight refuses a folder of another shape before anything runs."""
    import json

    from safetensors.torch import save_file

    from twinplane.cluster.planes import build_critic, critic_weights
    from twinplane.config import load_config
    from twinplane.errors import InputError
    from twinplane.run.preflight import check_critic

    policy = tiny_model()
    value = build_value_model(policy.config, export_weights(policy), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        value.score.weight.normal_()
        value.score.bias.fill_(0.25)
        for p in value.model.parameters():
            p.add_(0.01)  # not the policy's decoder either
    save_file({n: t.contiguous() for n, t in value.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(policy.config.to_hf()))
    check_critic(str(tmp_path), policy.config)
    cfg = load_config(None, ["algo.name=ppo", f"critic.model_path={tmp_path}"])
    critic = build_critic(cfg, policy.config, critic_weights(cfg, policy), torch.device("cpu"))
    for (name, got), (_, want) in zip(critic.model.state_dict().items(), value.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
    with pytest.raises(InputError, match="hidden_size 64 differs from the policy's 32"):
        check_critic(str(tmp_path), ModelConfig(**{**policy.config.__dict__, "hidden_size": 32, "head_dim": 8}))

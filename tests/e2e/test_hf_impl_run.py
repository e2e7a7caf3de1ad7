"""`twinplane train` on an architecture with no native family (OLMo, through transformers' code): a run ends with a
final/ folder transformers loads, a killed run resumes to the uninterrupted one's bytes, LoRA trains and exports
through PEFT, and what the hf path cannot do is refused in one line."""

import pytest
import torch
from conftest import NATIVE_RUN, char_hf_folder, outcome, rows, train

transformers = pytest.importorskip("transformers")
RUN = [*NATIVE_RUN, "checkpoint.every=1"]


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    """A random OLMo folder with the demo's character tokenizer."""
    return char_hf_folder(tmp_path_factory.mktemp("olmo"), transformers.OlmoConfig, hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64)


@pytest.fixture(scope="module")
def whole(olmo, tmp_path_factory):
    run = tmp_path_factory.mktemp("whole")
    assert train(run, f"model.path={olmo}", args=RUN) == 0
    return run


def test_a_run_trains_reports_the_gap_and_saves_a_transformers_folder(whole, olmo):
    steps = [r for r in rows(whole) if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["actor/logprob_gap"] < 1e-4 for r in steps)  # engine vs trainer: one model, fp32
    final = transformers.AutoModelForCausalLM.from_pretrained(whole / "final")
    start = transformers.AutoModelForCausalLM.from_pretrained(olmo)
    assert type(final).__name__ == "OlmoForCausalLM"
    moved = [n for n, p in final.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert len(moved) == len(list(final.parameters()))  # every parameter changed


def test_kill_and_resume_equals_the_uninterrupted_run(whole, olmo, tmp_path):
    assert train(tmp_path, f"model.path={olmo}", fault="train@2", args=RUN) == 75
    assert train(tmp_path, f"model.path={olmo}", "--resume", "auto", args=RUN) == 0
    weights, got = outcome(tmp_path)
    want = outcome(whole)
    assert weights == want[0] and got == want[1]


def test_lora_run_exports_a_peft_adapter(olmo, tmp_path):
    peft = pytest.importorskip("peft")
    assert train(tmp_path, f"model.path={olmo}", "train.lora.rank=4", "train.steps=2", args=RUN) == 0
    adapter = tmp_path / "final_adapter"
    base = transformers.AutoModelForCausalLM.from_pretrained(olmo)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    got = peft.PeftModel.from_pretrained(base, adapter).eval()
    ids = torch.randint(0, 15, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("override, message", [
    ("model.impl=native", "model_type 'olmo'"),
    ("rollout.batch_invariant=true", "rollout.batch_invariant: is a property of the native engine's GEMMs"),
    ("cluster.max_staleness=1", "cluster.max_staleness: must be 0"),
    ("algo.name=ppo", "algo.name: PPO's critic is built on the native decoder"),
])
def test_what_hf_cannot_do_is_one_line_and_exit_2(olmo, tmp_path, capsys, override, message):
    assert train(tmp_path, f"model.path={olmo}", override, args=RUN) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_on_ray_equals_the_local_run(whole, olmo, tmp_path):
    """A trainer actor and an engine actor, each building the model from its transformers config: the same run."""
    pytest.importorskip("ray")
    from conftest import train_on_ray

    assert train_on_ray(tmp_path, f"model.path={olmo}", args=RUN) == 0
    got, want = rows(tmp_path), rows(whole)
    assert [r["step"] for r in got if r["step"] >= 1] == [1, 2, 3]
    for g, w in zip([r for r in got if r["step"] >= 1], [r for r in want if r["step"] >= 1], strict=True):
        learned = {k: v for k, v in w.items() if k.startswith(("actor/", "reward", "grad", "kl"))}
        assert "actor/logprob_gap" in learned and len(learned) > 5
        for key, value in learned.items():
            assert g[key] == pytest.approx(value, abs=1e-5), key

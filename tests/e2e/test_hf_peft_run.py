"""`twinplane train` with LoRA on GPT-NeoX through transformers' code and PEFT: its layers have no Llama-style names
(`query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`), so `train.lora.targets=all` is PEFT's all-linear.
Three steps move only the adapters (final/ is the base plus scale * B A on the adapted weights and the base bitwise
elsewhere), the engine scores its samples as the trainer does after every update, the saved adapter loads in PEFT
over the base with the trained policy's logits (as do final/ and `twinplane export`'s merged model), a killed run
resumes to the uninterrupted one's bytes, and targets that cannot be adapted are refused in one line."""

import json

import pytest
import torch
from conftest import NATIVE_RUN, char_hf_folder, outcome, rows, train
from safetensors.torch import load_file

from twinplane.cli import main
from twinplane.model.hf import load_hf
from twinplane.model.lora import apply_lora
from twinplane.model.lora_io import load_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# an entropy bonus: the random model's answers all score 0, and the adapters should still move
RUN = [*NATIVE_RUN, "checkpoint.every=1", "algo.entropy_coef=0.01", "train.lr=1e-2", "train.lora.rank=4"]
PREFIX = "base_model.model."


def saved(path, config):
    """A random transformers model of `config` with the demo's character tokenizer, in `path`."""
    return char_hf_folder(path, config, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=64)


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("neox"), lambda **kw: transformers.GPTNeoXConfig(
        **kw, intermediate_size=64, rotary_pct=0.5, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def whole(neox, tmp_path_factory):
    run = tmp_path_factory.mktemp("whole")
    assert train(run, f"model.path={neox}", args=RUN) == 0
    return run


def test_three_steps_move_only_the_adapters_and_the_engine_scores_as_the_trainer(whole, neox):
    steps = [r for r in rows(whole) if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["actor/logprob_gap"] < 1e-5 for r in steps)  # engine vs trainer, after each update (fp32)
    assert steps[-1]["actor/kl"] > 0  # the reference is the base itself, the adapters off
    base, final = (transformers.AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (neox, whole / "final"))
    adapter = load_file(whole / "final_adapter" / "adapter_model.safetensors")
    config = json.loads((whole / "final_adapter" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    adapted = {k[len(PREFIX):-len(".lora_A.weight")] for k in adapter if k.endswith(".lora_A.weight")}
    assert sorted({m.rsplit(".", 1)[-1] for m in adapted}) == ["dense", "dense_4h_to_h", "dense_h_to_4h",
                                                                "query_key_value"] and len(adapted) == 8
    assert final.keys() == base.keys()
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if module in adapted:
            b, a = adapter[f"{PREFIX}{module}.lora_B.weight"], adapter[f"{PREFIX}{module}.lora_A.weight"]
            assert b.abs().max() > 0, name
            torch.testing.assert_close(final[name], w + scale * b @ a, rtol=0, atol=1e-6)
        else:
            assert torch.equal(final[name], w), name  # embeddings, norms, biases, the LM head: the base's bits


def test_the_adapter_loads_in_peft_with_the_trained_policys_logits(whole, neox, tmp_path):
    last = whole / "checkpoints" / "step_00000003"
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(neox),
                                            whole / "final_adapter").eval()
    trainer = load_hf(neox, "cpu")  # the trainer's model as a resume rebuilds it from the last checkpoint
    apply_lora(trainer, 4, 32.0)
    load_adapter(trainer, last / "adapter")
    assert main(["export", str(last), "--out", str(tmp_path / "merged")]) == 0  # the base with them folded in
    ids = torch.randint(0, 15, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        torch.testing.assert_close(got, trainer(ids), rtol=0, atol=1e-5)
        for merged in (whole / "final", tmp_path / "merged"):
            model = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
            torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_kill_and_resume_equals_the_uninterrupted_run(whole, neox, tmp_path):
    assert train(tmp_path, f"model.path={neox}", fault="train@2", args=RUN) == 75
    assert train(tmp_path, f"model.path={neox}", "--resume", "auto", args=RUN) == 0
    weights, got = outcome(tmp_path)
    want = outcome(whole)
    assert weights == want[0] and got == want[1]
    adapter = "final_adapter/adapter_model.safetensors"
    assert (tmp_path / adapter).read_bytes() == (whole / adapter).read_bytes()


@pytest.mark.parametrize("targets, message", [
    ("lm_head", "train.lora.targets: lm_head is the LM head"),
    ("q_proj,v_proj", "train.lora.targets: q_proj,v_proj matches no module of GPTNeoXForCausalLM (its linear "
                      "layers: dense, dense_4h_to_h, dense_h_to_4h, query_key_value)"),
])
def test_targets_that_cannot_be_adapted_are_one_line_and_exit_2(neox, tmp_path, capsys, targets, message):
    assert train(tmp_path, f"model.path={neox}", f"train.lora.targets={targets}", args=RUN) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"twinplane: error: {message}"), err


def test_peft_forms_on_a_native_model_are_one_line_and_exit_2(tmp_path, capsys):
    llama = saved(tmp_path / "llama", lambda **kw: transformers.LlamaConfig(**kw, intermediate_size=64))
    assert train(tmp_path / "run", f"model.path={llama}", "train.lora.targets=all-linear", args=RUN) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.lora.targets: must be all or a comma list of q_proj" in err[0], err


@pytest.mark.slow
def test_on_ray_equals_the_local_run(whole, neox, tmp_path):
    """A trainer actor and an engine actor, each injecting PEFT's layers into the model it builds from the
    transformers config; only the adapters travel: the same run."""
    pytest.importorskip("ray")
    from conftest import train_on_ray

    assert train_on_ray(tmp_path, f"model.path={neox}", args=RUN) == 0
    got, want = ([r for r in rows(d) if r["step"] >= 1] for d in (tmp_path, whole))
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert g["sync/bytes"] == w["sync/bytes"] < 20_000  # the adapters only
        for key, value in w.items():
            if key.startswith(("actor/", "reward", "kl")):
                assert g[key] == pytest.approx(value, abs=1e-5), key

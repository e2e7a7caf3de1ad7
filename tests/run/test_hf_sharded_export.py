"""`twinplane export` of a sharded checkpoint (`checkpoint.format=sharded`) of a run through transformers' code
(`model.impl=hf`): full weights and LoRA (`--format merged` and `peft`) give the files the same run exports from a
full-tensor checkpoint, byte for byte, and transformers and PEFT load them as the run's trained policy. Covered:
OLMo (every parameter in the shards, the LM head tied), ERNIE-4.5-MoE (a router correction bias its code freezes,
which no shard holds),
GPT-2 LoRA (transformers' Conv1D layers, PEFT's all-linear targets, adapter dropout)."""

import json
from contextlib import contextmanager

import pytest
import torch
from conftest import char_hf_folder, train
from safetensors.torch import load_file

from twinplane.cli import main

transformers = pytest.importorskip("transformers")
RUN = ["warmstart.steps=0", "train.steps=2", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=4",
       "task.heldout_size=8", "eval.before=false", "eval.every=0", "eval.after=false", "log.progress=false",
       "checkpoint.every=2", "train.micro_batch_size=8", "algo.kl_coef=0.05", "train.lr=1e-2",
       "algo.entropy_coef=0.01"]  # (an entropy bonus: the random model's answers all score 0, and weights should move)
LAYERS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
MODELS = {
    "olmo": lambda path: char_hf_folder(path, transformers.OlmoConfig, intermediate_size=64, num_key_value_heads=2,
                                        tie_word_embeddings=True, **LAYERS),
    "ernie": lambda path: char_hf_folder(path, transformers.Ernie4_5_MoeConfig, intermediate_size=64,
                                         moe_intermediate_size=16, moe_num_experts=4, moe_k=2,
                                         moe_layer_start_index=1, num_key_value_heads=2, **LAYERS),
    "gpt2": lambda path: char_hf_folder(path, transformers.GPT2Config, n_embd=32, n_layer=2, n_head=4,
                                        n_positions=64),
}


def runs(tmp, name, *extra):
    """The model `name`'s folder and the same run with full-tensor and with sharded checkpoints: their last
    checkpoints (step 2, also what final/ holds)."""
    folder = MODELS[name](tmp / name)
    ckpt = {}
    for fmt in ("full", "sharded"):
        assert train(tmp / fmt, f"model.path={folder}", f"checkpoint.format={fmt}", *extra, args=RUN) == 0
        ckpt[fmt] = tmp / fmt / "checkpoints" / "step_00000002"
    assert (ckpt["sharded"] / "policy" / ".metadata").is_file() and not (ckpt["sharded"] / "model.safetensors").exists()
    return folder, ckpt


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """runs(name) once per model for this module."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = runs(tmp_path_factory.mktemp(name), name)
        return done[name]
    return get


@contextmanager
def moved_away(folder):
    """`folder` gone while the block runs (put back after it)."""
    aside = folder.with_name(folder.name + "-aside")
    folder.rename(aside)
    try:
        yield
    finally:
        aside.rename(folder)


def exported(ckpt: dict, out, fmt="merged") -> dict:
    """Both checkpoints exported (to out/full and out/sharded): every file of the two is the same bytes."""
    for how, source in ckpt.items():
        assert main(["export", str(source), "--out", str(out / how), "--format", fmt]) == 0
    names = sorted(p.name for p in (out / "full").iterdir())
    assert names == sorted(p.name for p in (out / "sharded").iterdir())
    for name in names:
        assert (out / "sharded" / name).read_bytes() == (out / "full" / name).read_bytes(), name
    return {how: out / how for how in ckpt}


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("name", ["olmo", "ernie"])
def test_full_weights_export_as_from_a_full_checkpoint(trained, tmp_path, name):
    folder, ckpt = trained(name)
    out = exported(ckpt, tmp_path)
    got = transformers.AutoModelForCausalLM.from_pretrained(out["sharded"]).state_dict()
    final = transformers.AutoModelForCausalLM.from_pretrained(ckpt["sharded"].parents[1] / "final").state_dict()
    start = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert got.keys() == final.keys()
    assert all(torch.equal(got[n], final[n]) for n in final)
    assert any(not torch.equal(got[n], start[n]) for n in start)  # the trained weights, not the start's
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()  # (both tie them)
    if name == "ernie":  # the frozen bias is the model folder's, not a zero
        bias = next(n for n in start if n.endswith("e_score_correction_bias"))
        assert torch.equal(got[bias], start[bias]) and start[bias].abs().sum() > 0


def test_without_frozen_parameters_the_checkpoint_alone_exports(trained, tmp_path):
    """Every parameter is in the shards: the model folder the run started from is not read."""
    folder, ckpt = trained("olmo")
    with moved_away(folder):
        exported(ckpt, tmp_path)


def test_frozen_parameters_without_their_model_folder_are_one_line_and_exit_2(trained, tmp_path, capsys):
    folder, ckpt = trained("ernie")
    capsys.readouterr()
    with moved_away(folder):
        assert main(["export", str(ckpt["sharded"]), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "e_score_correction_bias is frozen in Ernie4_5_MoeForCausalLM, so no shard holds it, " \
                              f"and the run's model.path {folder} that does is missing" in err[0], err


def test_lora_exports_merged_and_peft_as_from_a_full_checkpoint(tmp_path):
    peft = pytest.importorskip("peft")
    folder, ckpt = runs(tmp_path, "gpt2", "train.lora.rank=4", "train.lora.dropout=0.1")
    merged, adapter = exported(ckpt, tmp_path / "merged"), exported(ckpt, tmp_path / "peft", "peft")
    assert {k.split(".")[-3] for k in load_file(adapter["sharded"] / "adapter_model.safetensors")} == {
        "c_attn", "c_proj", "c_fc"}  # GPT-2's Conv1D layers, all-linear
    assert json.loads((adapter["sharded"] / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    ids = torch.randint(0, 15, (2, 6), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    want = logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded" / "final"), ids)
    assert not torch.allclose(want, logits(base, ids), atol=1e-4)  # the adapters moved
    got = logits(peft.PeftModel.from_pretrained(base, adapter["sharded"]), ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(transformers.AutoModelForCausalLM.from_pretrained(merged["sharded"]), ids),
                               want, rtol=0, atol=1e-5)

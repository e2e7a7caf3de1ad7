"""The transformers fallback (`model.impl`): which folders get it, its log-probs against transformers', packed
against padded, its engine against `generate` and against the native engine, names and saving (LoRA through PEFT:
test_hf_peft_lora.py). Architectures without a native family: OLMo (Llama-style names) and GPT-NeoX (its own
names, partial rotary)."""

import json
import shutil

import pytest
import torch
from conftest import hf_reference, make_batch

from twinplane.cli import main
from twinplane.errors import InputError
from twinplane.model import load_model
from twinplane.model.export import export_weights
from twinplane.model.hf import load_hf
from twinplane.model.impl import choose
from twinplane.model.weights import load_weights
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.hf_engine import HFEngine
from twinplane.train.logprobs import response_logprobs

transformers = pytest.importorskip("transformers")
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, bos_token_id=1, eos_token_id=3, pad_token_id=0)
CONFIGS = {"olmo": lambda: transformers.OlmoConfig(**SIZES, num_key_value_heads=2),
           "gpt_neox": lambda: transformers.GPTNeoXConfig(**SIZES, rotary_pct=0.5, tie_word_embeddings=False),
           "llama": lambda: transformers.LlamaConfig(**SIZES, num_key_value_heads=2),
           # logits scaled after the LM head (Granite), soft-capped (Gemma 2, here forced through transformers' code)
           "granite": lambda: transformers.GraniteConfig(**SIZES, num_key_value_heads=2, logits_scaling=4.0,
                                                         embedding_multiplier=2.0, residual_multiplier=0.5),
           "gemma2": lambda: transformers.Gemma2Config(**SIZES, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                       final_logit_softcapping=2.0, attn_logit_softcapping=5.0),
           # a causal LM whose `base_model` and `get_decoder()` are itself: the decoder is found by its layers
           "llama4": lambda: transformers.Llama4TextConfig(**SIZES, num_key_value_heads=2, head_dim=8,
                                                           num_local_experts=2, intermediate_size_mlp=64)}


def hf_folder(path, kind, seed=0):
    """A random transformers model saved to `path` (larger-than-default weights: peaked distributions)."""
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.15)
    m.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {k: hf_folder(root / k, k) for k in CONFIGS}


reference = hf_reference


def test_auto_native_hf_and_refusals(folders, tmp_path):
    assert choose(folders["olmo"]).impl == "hf" and choose(folders["gpt_neox"], "auto").impl == "hf"
    assert choose(folders["llama"]).impl == "native" and choose(folders["llama"], "hf").impl == "hf"
    with pytest.raises(InputError, match="model_type 'olmo'"):
        choose(folders["olmo"], "native")
    bad = tmp_path / "gpt9"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt9", "architectures": ["Gpt9ForCausalLM"]}))
    with pytest.raises(InputError, match=r"Gpt9ForCausalLM cannot run: transformers .* does not know model_type "
                                         r"'gpt9'"):
        choose(bad)
    # a native family with a bad value keeps native's error (and a hint) instead of running through transformers
    broken = tmp_path / "broken"
    broken.mkdir()
    cfg = json.loads((folders["llama"] / "config.json").read_text()) | {"num_key_value_heads": 3}
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="num_key_value_heads=3.*model.impl=hf runs it"):
        choose(broken)


def test_a_model_whose_logits_overflow_is_refused_in_one_line(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(folders["olmo"], nan)
    weights = load_file(nan / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="^OlmoForCausalLM: its logits on a test input are not finite"):
        load_hf(nan, "cpu")


@pytest.mark.parametrize("kind", ["olmo", "gpt_neox", "granite", "gemma2", "llama4"])
def test_logits_names_and_save_match_transformers(kind, folders, tmp_path):
    ours, ref = load_hf(folders[kind], "cpu"), reference(folders[kind])
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        torch.testing.assert_close(ours(ids, mask)[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5)
    names = [n for n, _ in export_weights(ours)]
    # transformers' own parameter names (what its loader takes; GPT-NeoX's checkpoint still says embed_out)
    assert names == [n for n, _ in ref.named_parameters()]
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01)
    ours.save_pretrained(tmp_path / "out")
    back = reference(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    again = load_hf(folders[kind], "cpu")
    load_weights(again, export_weights(ours))  # weight sync / resume: by name, in place
    assert torch.equal(again(ids), ours(ids))


@pytest.mark.parametrize("kind", ["olmo", "gpt_neox"])
def test_packed_equals_padded_and_shared_prompts(kind, folders):
    model = load_hf(folders[kind], "cpu")
    batch = make_batch(model)
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, 1.0, packed=False)
        packed, _ = response_logprobs(model, batch, 1.0, packed=True)
        assert model._packs is True  # transformers' block-diagonal mask from restarting positions held
        shared_batch = make_batch(model, n=4)
        shared_batch.input_ids[1], shared_batch.attention_mask[1] = shared_batch.input_ids[0], \
            shared_batch.attention_mask[0]
        want, _ = response_logprobs(model, shared_batch, 1.0, packed=False)
        shared, _ = response_logprobs(model, shared_batch, 1.0, packed=True, share_prompts=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["granite", "gemma2"])
def test_trainer_logprobs_through_a_scaled_or_capped_head(kind, folders):
    """The trainer's chunked log-probs (the shared head path) equal log-softmax of transformers' own logits."""
    model, ref = load_hf(folders[kind], "cpu"), reference(folders[kind])
    batch = make_batch(model)
    with torch.no_grad():
        got, _ = response_logprobs(model, batch, 1.0, packed=False)
        mask = batch.attention_mask
        logits = ref(input_ids=batch.input_ids, attention_mask=mask,
                     position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    want = lp[:, batch.prompt_len - 1:]
    keep = batch.response_mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


def test_a_model_that_ignores_packing_falls_back_to_padded_rows(folders, monkeypatch):
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)  # packing not honoured
    model = load_hf(folders["olmo"], "cpu")
    assert not model.packing_agrees()
    batch = make_batch(model)
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, 1.0, packed=False)
        packed, _ = response_logprobs(model, batch, 1.0, packed=True)
    assert model._packs is False
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


@pytest.mark.parametrize("kind", ["olmo", "gpt_neox", "granite", "gemma2"])
def test_engine_greedy_equals_generate_and_sampling_is_seeded(kind, folders):
    model = load_hf(folders[kind], "cpu")
    engine = HFEngine(model, eos_token_id=3, pad_token_id=0, max_num_seqs=3)  # two static batches
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
    ref = reference(folders[kind])
    for prompt, s in zip(PROMPTS, out, strict=True):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=3,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert s.token_ids == want and s.finish_reason == ("stop" if want[-1] == 3 else "length")
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=6, n=3, seed=7)
    a, b = engine.generate(PROMPTS, sp), engine.generate(PROMPTS, sp)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert len({tuple(s.token_ids) for s in a}) > 4  # sampled, not all alike
    for s in a:  # the engine's log-probs are the trainer's quantity (logits / T, no truncation)
        full = torch.tensor([s.prompt_ids + s.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(full)[0].float() / 0.9, -1)[len(s.prompt_ids) - 1:-1]
        want = lp.gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.logprobs), want, rtol=1e-4, atol=1e-5)


def test_hf_engine_samples_as_the_native_engine_does(folders):
    """One Llama folder, native vs transformers' code: the same seeded samples and log-probs."""
    native = RolloutEngine(load_model(folders["llama"], "cpu"), eos_token_id=3, graphs=False)
    hf = HFEngine(load_hf(folders["llama"], "cpu"), eos_token_id=3)
    sp = SamplingParams(temperature=1.0, top_k=30, max_new_tokens=5, n=2, min_new_tokens=2, seed=3)
    a, b = native.generate(PROMPTS, sp), hf.generate(PROMPTS, sp)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    torch.testing.assert_close(torch.tensor([x for s in b for x in s.logprobs]),
                               torch.tensor([x for s in a for x in s.logprobs]), rtol=1e-4, atol=1e-5)


def test_routing_is_refused(folders):
    from twinplane.model.moe import RoutingState

    model = load_hf(folders["olmo"], "cpu")
    with pytest.raises(ValueError, match="MoE routing record/replay needs a native model"):
        model(torch.tensor([[5, 6]]), routing=RoutingState())


def test_doctor_model_says_which_and_why(folders, capsys):
    assert main(["doctor", "--model", str(folders["olmo"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "architecture: OlmoForCausalLM"
    assert out[2].startswith("implementation: hf (OlmoForCausalLM: no native family for model_type 'olmo'")
    assert any(line.startswith("LoRA targets: down_proj,gate_proj,k_proj") for line in out)
    assert main(["doctor", "--model", str(folders["llama"])]) == 0
    assert "implementation: native" in capsys.readouterr().out
    assert main(["doctor", "--model", str(folders["olmo"]), "--impl", "native"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model_type 'olmo'" in err


def _grads(model, batch):
    model.train()
    lp, _ = response_logprobs(model, batch, 1.0)
    lp.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return lp.detach(), grads


@pytest.mark.parametrize("setting", ["activation_checkpointing",
                                     pytest.param("compile_layers", marks=pytest.mark.slow)])
def test_checkpointing_and_compiled_layers_change_nothing(folders, setting):
    """transformers' gradient checkpointing, and each decoder layer's training forward compiled: the same log-probs
    and gradients as the plain model (compiling: to rounding)."""
    plain = load_hf(folders["olmo"], "cpu")
    batch = make_batch(plain)
    lp, grads = _grads(plain, batch)
    other = load_hf(folders["olmo"], "cpu")
    setattr(other, setting, True)
    lp2, grads2 = _grads(other, batch)
    torch.testing.assert_close(lp2, lp, rtol=1e-5, atol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads2[n], grads[n], rtol=1e-4, atol=1e-5)
    assert not plain.activation_checkpointing and getattr(other, setting)

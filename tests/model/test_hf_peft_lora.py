"""LoRA through PEFT on models run with transformers' code (`model.impl=hf`): which layers `train.lora.targets`
adapts (Llama-style names, GPT-NeoX's own through all-linear, GPT-2's Conv1D), what is refused, training moves only
the adapters, the saved adapter loads in PEFT and the merged export in transformers with the trainer's logits, the
reference is the base with the adapters off, dropout is seeded and in training forwards only, and after an update
the engine (adapter-only or merged sync) scores its samples as the trainer does."""

import copy

import pytest
import torch
from conftest import make_batch

from twinplane.cluster.sync import sync_in_process
from twinplane.config import AlgoSection, ConfigError, TrainSection, load_config
from twinplane.model.export import export_weights
from twinplane.model.hf import load_hf
from twinplane.model.lora import adapted, adapter_numel, apply_lora, is_adapter, merge_lora
from twinplane.model.lora_io import save_adapter
from twinplane.rollout import SamplingParams
from twinplane.rollout.hf_engine import HFEngine
from twinplane.train import Reference, Trainer
from twinplane.train.batch import Batch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
SIZES = dict(vocab_size=64, num_hidden_layers=2, bos_token_id=1, eos_token_id=3, pad_token_id=0)
CONFIGS = {
    "olmo": lambda: transformers.OlmoConfig(**SIZES, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                            num_key_value_heads=2, max_position_embeddings=64),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SIZES, hidden_size=32, intermediate_size=64,
                                                   num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                                                   tie_word_embeddings=False),
    "gpt2": lambda: transformers.GPT2Config(**SIZES, n_embd=32, n_head=4, n_positions=64),
}
ALGO = AlgoSection(kl_coef=0.1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    out = {}
    for kind, config in CONFIGS.items():
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config())
        with torch.no_grad():
            for p in m.parameters():
                if p.ndim >= 2:
                    p.normal_(0, 0.15)
        m.save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def lora(path, targets="all", dropout=0.0):
    model = load_hf(path, "cpu")
    apply_lora(model, 4, 8.0, dropout, targets, seed=1)
    return model


def trained(path, steps=3):
    """A PEFT-adapted model after `steps` optimizer steps (its adapters no longer zero), and its trainer."""
    model = lora(path)
    trainer = Trainer(model, TrainSection(micro_batch_size=4, lr=2e-2), ALGO, temperature=1.0, total_steps=10)
    batch = make_batch(model)
    for _ in range(steps):
        trainer.train_step(batch)
    return model.eval(), trainer


LLAMA = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("kind, targets, layers, count", [
    ("olmo", "all", LLAMA, 14),
    ("olmo", "all-linear", LLAMA, 14),  # (never the LM head)
    ("gpt_neox", "all", ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"], 8),  # no Llama names
    ("gpt_neox", "query_key_value,mlp.dense_4h_to_h", ["dense_4h_to_h", "query_key_value"], 4),
    ("gpt_neox", r"re:.*\.attention\.dense", ["dense"], 2),
    ("gpt2", "all", ["c_attn", "c_fc", "c_proj"], 8),  # transformers' Conv1D; c_proj in attention and MLP
])
def test_targets_in_peft_forms_adapt_those_layers_from_the_base(folders, kind, targets, layers, count):
    base, rng = load_hf(folders[kind], "cpu"), torch.get_rng_state()
    model = lora(folders[kind], targets)
    assert torch.equal(torch.get_rng_state(), rng)  # the adapters come from their own seed
    assert sorted({a.name.rsplit(".", 1)[-1] for a in adapted(model)}) == layers and len(adapted(model)) == count
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if is_adapter(n)}
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if is_adapter(n))
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))  # B = 0: exactly the base


@pytest.mark.parametrize("kind, targets, message", [
    ("gpt_neox", "q_proj", r"train.lora.targets: q_proj matches no module of GPTNeoXForCausalLM \(its linear "
                           r"layers: dense, dense_4h_to_h, dense_h_to_4h, query_key_value\)"),
    ("olmo", "q_proj,lm_head", "train.lora.targets: lm_head is the LM head"),
    ("gpt_neox", "embed_in", "train.lora.targets: gpt_neox.embed_in is a Embedding; LoRA here adapts linear"),
])
def test_what_cannot_be_adapted_is_one_line(folders, kind, targets, message):
    with pytest.raises(ValueError, match=message) as e:
        lora(folders[kind], targets)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, problem", [
    ("train.lora.targets=all-linear", "for the native decoder"),  # no model.path: the native demo model
    ("train.lora.targets=re:(", r"re:\( is not a regular expression"),
    ("train.lora.targets=q proj", "must be all, all-linear, re:REGEX or a comma list of module names"),
])
def test_target_forms_are_checked_with_the_config(override, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, [override])
    load_config(None, ["model.path=x", "model.impl=hf", "train.lora.targets=all-linear"])  # PEFT's: at preflight


@pytest.mark.parametrize("kind", ["gpt_neox", "gpt2"])
def test_training_moves_only_adapters_and_peft_and_transformers_load_what_is_saved(folders, kind, tmp_path):
    model, trainer = trained(folders[kind])
    base = dict(load_hf(folders[kind], "cpu").named_parameters())
    params = dict(model.named_parameters())
    plain = {n.replace(".base_layer.", "."): p for n, p in params.items() if not is_adapter(n)}
    assert plain.keys() == base.keys() and all(torch.equal(p, base[n]) for n, p in plain.items())  # base bitwise
    assert all(p.abs().sum() > 0 for n, p in params.items() if n.endswith("lora_B.default.weight"))
    assert set(trainer.opt.state) == {p for n, p in params.items() if is_adapter(n)}  # optimizer: adapters only
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        ours = model(ids)
    # PEFT's own loader over transformers' own base, from the adapter folder twinplane wrote
    save_adapter(model, tmp_path / "adapter", str(folders[kind]))
    start = transformers.AutoModelForCausalLM.from_pretrained(folders[kind]).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])  # (PEFT adapts it in place)
    loaded = peft.PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    # the merged export (base names, W + s B A) in a fresh transformers model
    merged = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    missing, unexpected = merged.load_state_dict(dict(export_weights(model, merged=True)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # (GPT-2's is tied to the embedding)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
        assert (ours - start(input_ids=ids).logits).abs().max() > 1e-2  # training moved the policy
    assert [n for n, _ in merge_lora(copy.deepcopy(model)).named_parameters()] == list(base)


def test_reference_from_disabled_adapters_equals_the_base(folders):
    model, _ = trained(folders["gpt_neox"], steps=1)
    batch = make_batch(model, seed=1)
    shared = Reference(model, 1.0, micro_batch_size=4).logprobs(batch)
    separate = Reference(load_hf(folders["gpt_neox"], "cpu"), 1.0, micro_batch_size=4).logprobs(batch)
    assert torch.equal(shared, separate)
    assert all(not a.module.disable_adapters for a in adapted(model))  # switched back on afterwards
    assert all(p.requires_grad for n, p in model.named_parameters() if is_adapter(n))


def test_dropout_draws_from_the_seeded_stream_in_training_forwards_only(folders):
    plain, dropped = lora(folders["gpt_neox"]), lora(folders["gpt_neox"], dropout=0.5)
    for model in (plain, dropped):
        with torch.no_grad():
            for a in adapted(model):
                a.b.copy_(torch.linspace(-1, 1, a.b.numel()).view_as(a.b))
    ids = torch.randint(0, 64, (2, 7))

    def forward(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return dropped.train()(ids)

    assert torch.equal(forward(0), forward(0)) and not torch.equal(forward(0), forward(1))
    with torch.no_grad():
        assert torch.equal(dropped.eval()(ids), plain.eval()(ids))  # (dropout on the adapters' input only)
        assert not torch.equal(forward(0), plain(ids))


@pytest.mark.parametrize("merge", [False, True])
def test_after_an_update_the_engine_scores_like_the_trainer(folders, merge):
    """Adapter-only sync into the engine's PEFT copy, or merged weights into a plain model: the engine's sampled
    log-probs equal the trainer's of the same tokens (fp32)."""
    path = folders["gpt_neox"]
    model, trainer = trained(path)
    engine_model = merge_lora(lora(path)) if merge else copy.deepcopy(lora(path))  # the step-0 policy
    engine = HFEngine(engine_model, eos_token_id=None)
    report = sync_in_process(engine, trainer, version=1)
    assert report.mismatched() == []
    full = sum(p.numel() * 4 for p in load_hf(path, "cpu").parameters())
    assert report.bytes == (full if merge else adapter_numel(model) * 4)
    samples = engine.generate([[5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(temperature=1.0, max_new_tokens=6, n=3,
                                                                              seed=2))
    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0,
                          [s.logprobs for s in samples])
    gap = ((trainer.logprobs(batch) - batch.rollout_logprobs).abs() * batch.response_mask).max().item()
    assert gap < 1e-5, gap

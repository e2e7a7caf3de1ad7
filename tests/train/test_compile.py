"""Regional torch.compile of the decoder layers (`train.compile`): a compiled training step is the eager one."""

import copy
import shutil

import pytest
import torch
from conftest import make_batch, simulate_gpu, tiny_model
from torch._dynamo.utils import counters

from twinplane.config import AlgoSection, TrainSection
from twinplane.errors import InputError
from twinplane.model import transformer
from twinplane.platform import platform
from twinplane.rollout.engine import RolloutEngine
from twinplane.rollout.sampling import SamplingParams
from twinplane.train import Trainer

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs g++")


def step(model, compile: str, **train):
    """One training step: (metrics, the gradients the optimizer stepped on). A small lr: AdamW's first update is
    about lr x sign(gradient), so a gradient within rounding of 0 may move its weight by lr either way."""
    trainer = Trainer(model, TrainSection(micro_batch_size=3, lr=1e-6, compile=compile, **train),
                      AlgoSection(kl_coef=0.1, entropy_coef=0.01), temperature=1.0, total_steps=10)
    grads = {}
    trainer.opt.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in model.named_parameters()}))
    metrics = trainer.train_step(make_batch(model, n=6))
    return metrics, grads


@pytest.mark.slow  # inductor's first compile: 30-70 s on a busy 2-core host
@needs_compiler
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "AVX2",
                    reason="inductor's AVX2 CPU code gives a NaN loss for this step (train.compile is off on CPU "
                    "unless asked for; see docs/configuration.md)")
@pytest.mark.parametrize("packing,checkpointing", [(True, False), (False, False), (True, True)])
def test_compiled_step_equals_eager(packing, checkpointing):
    torch._dynamo.reset()
    counters.clear()
    eager_model, compiled_model = tiny_model(), tiny_model()
    want, want_grads = step(eager_model, "off", packing=packing, activation_checkpointing=checkpointing)
    assert not eager_model.compile_layers and not counters["stats"]["unique_graphs"]
    got, got_grads = step(compiled_model, "on", packing=packing, activation_checkpointing=checkpointing)
    assert compiled_model.compile_layers and counters["stats"]["unique_graphs"] > 0  # it did compile
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-5), k
    for name, g in want_grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(got_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-5, msg=name)

def test_auto_resolves_by_device(monkeypatch):
    assert not platform.compile_layers("cpu", "auto")
    assert platform.compile_layers("cpu", "on")
    assert not platform.compile_layers("cuda", "off")
    with pytest.raises(InputError, match="train.compile"):
        platform.compile_layers("cpu", "yes")
    model = tiny_model()
    Trainer(model, TrainSection(), AlgoSection(), 1.0, 10)
    assert not model.compile_layers  # (the default is auto)
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert platform.compile_layers("cuda", "auto") and platform.compile_layers(torch.device("cuda", 1))
    simulate_gpu(monkeypatch, "AMD Instinct MI300X", hip="6.2", cc=(9, 4))
    assert platform.compile_layers("cuda", "auto")


def test_eval_forwards_and_the_engine_stay_eager(monkeypatch):
    def refuse():
        raise AssertionError("an eval forward ran compiled")

    model = tiny_model()
    Trainer(model, TrainSection(compile="on"), AlgoSection(), 1.0, 10)
    engine_model = copy.deepcopy(model)  # as a colocated engine's copy made after the trainer
    monkeypatch.setattr(transformer, "compiled_layer", refuse)
    with torch.no_grad():
        model.train()(torch.tensor([[5, 6, 7]]))  # scoring: no grad
    model.eval()(torch.tensor([[5, 6, 7]]))
    engine = RolloutEngine(engine_model.eval(), eos_token_id=1, pad_token_id=0, seed=0)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(out) == 1
    model.train()
    with pytest.raises(AssertionError, match="compiled"):
        model(torch.tensor([[5, 6, 7]]))

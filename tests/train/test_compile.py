"""Regional torch.compile of the decoder layers (`train.compile`): a compiled training step is the eager one."""

import copy
import shutil

import pytest
import torch
from conftest import make_batch, simulate_gpu, spawn, tiny_model
from torch._dynamo.utils import counters

from twinplane.config import AlgoSection, TrainSection
from twinplane.errors import InputError
from twinplane.model import layer as decoder_layer
from twinplane.platform import backends
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


def _sharded_worker(rank, world, tmp):
    import torch.distributed as dist
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from twinplane.train.fsdp import shard_over

    symbols = []  # where each symbol Dynamo makes comes from (a tensor's size, a module's int attribute, ...)
    create = ShapeEnv.create_symbol

    def spy(self, val, source, *args, **kwargs):
        name = source.name
        symbols.append(name() if callable(name) else name)  # (a method before torch 2.11)
        return create(self, val, source, *args, **kwargs)

    ShapeEnv.create_symbol = spy
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    want, _ = step(tiny_model(), "on")
    plain, frames = set(symbols), counters["frames"]["total"]
    torch._dynamo.reset()
    counters.clear()
    symbols.clear()
    got, _ = step(shard_over(tiny_model(), dist.group.WORLD), "on")
    assert not counters["graph_break"], list(counters["graph_break"])
    extra = {n for n in set(symbols) - plain if not any(t in n for t in ("size()", "stride()", "storage_offset()"))}
    assert counters["frames"]["total"] == frames and not extra, sorted(extra)  # (tensor sizes are inputs' own)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    dist.destroy_process_group()


@pytest.mark.slow
@needs_compiler
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "AVX2", reason="as test_compiled_step_equals_eager")
def test_fsdp2_sharded_layers_compile_like_unsharded_ones(tmp_path):
    """Under FSDP2 Dynamo would make the layers' int attributes (head counts, head size) symbolic, which breaks the
    graph at SDPA's enable_gqa and leaves kernels generic over sizes that never change: the sharded layers' step
    compiles as many frames as the unsharded one's, and makes no symbol but tensor sizes that that one lacks."""
    spawn(_sharded_worker, (1, str(tmp_path)), nprocs=1, timeout=300)


def test_auto_resolves_by_device(monkeypatch):
    assert not backends.compile_layers("cpu", "auto")
    assert backends.compile_layers("cpu", "on")
    assert not backends.compile_layers("cuda", "off")
    with pytest.raises(InputError, match="train.compile"):
        backends.compile_layers("cpu", "yes")
    model = tiny_model()
    Trainer(model, TrainSection(), AlgoSection(), 1.0, 10)
    assert not model.compile_layers  # (the default is auto)
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert backends.compile_layers("cuda", "auto") and backends.compile_layers(torch.device("cuda", 1))
    simulate_gpu(monkeypatch, "AMD Instinct MI300X", hip="6.2", cc=(9, 4))
    assert backends.compile_layers("cuda", "auto")


def test_eval_forwards_and_the_engine_stay_eager(monkeypatch):
    def refuse():
        raise AssertionError("an eval forward ran compiled")

    model = tiny_model()
    Trainer(model, TrainSection(compile="on"), AlgoSection(), 1.0, 10)
    engine_model = copy.deepcopy(model)  # as a colocated engine's copy made after the trainer
    monkeypatch.setattr(decoder_layer, "compiled_layer", refuse)
    with torch.no_grad():
        model.train()(torch.tensor([[5, 6, 7]]))  # scoring: no grad
    model.eval()(torch.tensor([[5, 6, 7]]))
    engine = RolloutEngine(engine_model.eval(), eos_token_id=1, pad_token_id=0, seed=0)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(out) == 1
    model.train()
    with pytest.raises(AssertionError, match="compiled"):
        model(torch.tensor([[5, 6, 7]]))


@torch.library.custom_op("twinplane_test::varlen_attn", mutates_args={})
def _varlen_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, is_causal: bool = False) -> torch.Tensor:
    _varlen_stand_in.calls += 1
    return q * 1.0  # (any output of q's shape: only what Dynamo guards on matters here)


_varlen_stand_in.calls = 0
_varlen_stand_in.register_fake(lambda q, *rest, **kw: torch.empty_like(q))
_varlen_stand_in.register_autograd(lambda ctx, grad: (grad,) + (None,) * 7)


def test_gpu_packed_layers_compile_once_for_batches_of_any_shape(monkeypatch):
    """Compiled layers on the GPUs' packed path (`torch_varlen`, here with a stand-in op of `varlen_attn`'s
    signature) compile for the first micro-batches and serve every later one, of other lengths, sequence counts and
    shared prompts, without recompiling: a recompile per batch would cost seconds per step and, past Dynamo's
    recompile limit, leave the layers eager. (Dynamo's guards do not depend on the compiler: aot_eager keeps it
    quick.)"""
    from twinplane.train import Batch

    varlen = pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn (torch < 2.10)")

    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, cq, ck, mq, mk, is_causal=False:
                        _varlen_stand_in(q, k, v, cq, ck, mq, mk, is_causal))
    monkeypatch.setattr(backends, "varlen_backend", lambda *a, **k: "torch_varlen")
    monkeypatch.setattr(_varlen_stand_in, "calls", 0)
    layer = torch.compile(decoder_layer.DecoderLayer.run, dynamic=True, backend="aot_eager")
    monkeypatch.setattr(decoder_layer, "compiled_layer", lambda: layer)
    torch._dynamo.reset()
    counters.clear()

    def grouped(seed, groups):  # GRPO-like: 3 responses per prompt (shared prompts in the packed rows)
        g = torch.Generator().manual_seed(seed)
        prompts = [p for _ in range(groups) for p in [torch.randint(4, 50, (int(torch.randint(2, 9, (1,),
                   generator=g)),), generator=g).tolist()] * 3]
        responses = [torch.randint(4, 50, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
                     for _ in prompts]
        batch = Batch.collate(prompts, responses, 0)
        batch.advantages = torch.randn(len(prompts), 1, generator=g) * batch.response_mask
        batch.rollout_logprobs = torch.zeros(batch.response_mask.shape)
        return batch

    model = tiny_model()
    trainer = Trainer(model, TrainSection(micro_batch_size=3, lr=1e-6, compile="on"), AlgoSection(), 1.0, 100)
    trainer.train_step(make_batch(model, seed=0, n=6))
    trainer.train_step(grouped(0, 2))
    compiled = counters["frames"]["ok"]
    assert compiled and _varlen_stand_in.calls  # it compiled, and the packed path ran the (stand-in) kernel
    for seed, n in [(1, 5), (2, 7), (3, 1), (4, 9)]:
        trainer.train_step(make_batch(model, seed=seed, n=n))
        trainer.train_step(grouped(seed, n // 2 + 1))
    assert counters["frames"]["ok"] == compiled  # (a recompile is a frame compiled again)


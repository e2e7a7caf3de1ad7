"""Routers in bf16 choose the experts transformers' bf16 model chooses. DeepSeek-V3's router weight and
score-correction bias stay fp32 (transformers' `_keep_in_fp32_modules_strict`) through every cast, export, weight
sync and FSDP2 sharding, and its logits are fp32 under autocast; the softmax routers (Qwen-MoE, Mixtral, GPT-OSS)
route in the hidden dtype, as transformers' do."""

import copy
import datetime
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import spawn
from test_config_sweep import CONFIGS, settings
from test_native_deepseek_v3 import hf_model

import twinplane
from twinplane.cluster.sync import bucket_plan, sync_in_process
from twinplane.model import ModelConfig, Transformer
from twinplane.model.export import export_weights
from twinplane.model.families import FAMILIES
from twinplane.model.lora import cast_base
from twinplane.model.moe import RoutingState
from twinplane.model.precision import fp32_names
from twinplane.rollout import RolloutEngine

transformers = pytest.importorskip("transformers")

ROUTER = ("weight", "e_score_correction_bias")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A DeepSeek-V3 folder in fp32 whose correction biases sit where bf16's step is 2^-7: rounded, they move the
    scores that choose by up to 4e-3."""
    path = tmp_path_factory.mktemp("deepseek_bias") / "model"
    m = hf_model("q_latent")
    with torch.no_grad():
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05).add_(1.5)
    m.save_pretrained(path)
    return path


def routers(model) -> dict[int, torch.nn.Module]:
    return {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}


def test_deepseek_routes_as_transformers_bf16_model(folder):
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ours = twinplane.load_model(folder, dtype=torch.bfloat16)
    fp32 = twinplane.load_model(folder)
    assert ours.model.layers[1].mlp.experts.gate_proj.dtype == torch.bfloat16
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    flips = 0
    for (i, gate), theirs in zip(routers(ours).items(), routers(ref).values(), strict=True):
        for name in ROUTER:  # fp32, the checkpoint's values exactly
            assert getattr(gate, name).dtype == getattr(theirs, name).dtype == torch.float32
            assert torch.equal(getattr(gate, name), getattr(routers(fp32)[i], name))
        with torch.no_grad():
            want_logits, want_w, want_idx = theirs(x)
            logits, scores, own = gate(x)
            state = RoutingState()
            ours.model.layers[i].mlp(x, state)
            with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's mixed precision: still fp32
                assert torch.equal(gate(x)[0], logits)
            rounded = copy.deepcopy(gate)  # the bias as bf16 would hold it
            rounded.e_score_correction_bias.data = rounded.e_score_correction_bias.bfloat16().float()
            flips += int((rounded(x)[2].sort(-1).values != own.sort(-1).values).any(-1).sum())
        assert torch.equal(logits, want_logits)
        assert torch.equal(own.sort(-1).values, want_idx.sort(-1).values)
        assert torch.equal(state.chosen[ours.config.moe_layers.index(i)].sort(-1).values, want_idx.sort(-1).values)
    assert flips > 0, flips  # the case is one where a bf16 bias picks other experts


def test_fp32_router_survives_casts_exports_and_syncs(folder):
    model = twinplane.load_model(folder)
    names = fp32_names(model)
    assert names == {f"model.layers.{i}.mlp.gate.{n}" for i in (1, 2) for n in ROUTER}
    held = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    half = copy.deepcopy(model).to(torch.bfloat16)
    cast = cast_base(copy.deepcopy(model), torch.bfloat16)  # the engines' cast
    with torch.device("meta"):
        empty = Transformer(model.config)
    empty = empty.to_empty(device="cpu").to(torch.bfloat16)
    for m in (half, cast, empty):
        params = dict(m.named_parameters())
        assert all(params[n].dtype == torch.float32 for n in names)
        assert params["model.layers.1.mlp.experts.gate_proj"].dtype == torch.bfloat16
    for m in (half, cast):
        assert all(torch.equal(dict(m.named_parameters())[n], t) for n, t in held.items())
    sent = dict(export_weights(model, torch.bfloat16))
    assert {n for n, t in sent.items() if t.dtype == torch.float32} == names
    engine = RolloutEngine(cast, eos_token_id=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    trainer = SimpleNamespace(model=model, named_weights=lambda dtype, **kw: export_weights(model, dtype, **kw))
    report = sync_in_process(engine, trainer, 1)  # bitwise: the fp32 router arrives as it is
    assert not report.mismatched()
    shapes = [(n, torch.Size([4])) for n in ("a", "b", "c", "d", "e")]
    plan = bucket_plan(shapes, 2, 100, apart=frozenset({"b", "c"}))
    assert [[n for n, _ in b] for b in plan] == [["a"], ["b", "c"], ["d", "e"]]


def _fsdp_worker(rank, world, tmp, hf):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from twinplane.train.fsdp import shard_model

        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_hf(hf))
        model = shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
        seen = {}
        layer = model.model.layers[1]
        layer.mlp.gate.register_forward_pre_hook(lambda m, a: seen.update(router=m.weight.dtype))
        layer.mlp.shared_experts.register_forward_pre_hook(lambda m, a: seen.update(mlp=m.gate_proj.weight.dtype))
        model(torch.tensor([[5, 6, 7, 8]])).float().sum().backward()
        grad = layer.mlp.gate.weight.grad
        seen["router_grad"] = grad is not None and bool(grad.full_tensor().abs().sum() > 0)
        if rank == 0:
            torch.save(seen, f"{tmp}/seen.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    os._exit(0)


def test_fsdp_gathers_the_router_in_fp32_under_a_bf16_policy(folder, tmp_path):
    import json

    hf = json.loads((folder / "config.json").read_text())
    spawn(_fsdp_worker, (2, str(tmp_path), hf), nprocs=2)
    seen = torch.load(tmp_path / "seen.pt")
    assert seen == {"router": torch.float32, "mlp": torch.bfloat16, "router_grad": True}


SOFTMAX = {"qwen2_moe": "gate", "qwen3_moe": "gate", "mixtral": "gate", "gpt_oss": "router", "qwen3_next": "gate",
           "qwen3_5_moe_text": "gate"}


@pytest.mark.parametrize("model_type", list(SOFTMAX))
def test_softmax_routers_choose_as_transformers_bf16(model_type, tmp_path):
    """Qwen-MoE, Mixtral, GPT-OSS and Qwen3-Next route in the hidden dtype in transformers (no fp32 router): the
    same logits and top-k on the same bf16 inputs."""
    torch.manual_seed(0)
    cfg = getattr(transformers, CONFIGS[model_type])(**settings(model_type))
    src = getattr(transformers, FAMILIES[model_type].architecture)(cfg)
    with torch.no_grad():
        for n, p in src.named_parameters():
            if n.endswith("router.weight") or n.endswith("gate.weight"):
                p.normal_(0, 0.3)
    src.save_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours = twinplane.load_model(tmp_path, dtype=torch.bfloat16)
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    compared = 0
    for m, layer in enumerate(ours.config.moe_layers):
        theirs = getattr(ref.model.layers[layer].mlp, SOFTMAX[model_type])
        assert theirs.weight.dtype == torch.bfloat16
        state = RoutingState(keep_logits=True)
        with torch.no_grad():
            want_logits, _, want_idx = theirs(x)
            ours.model.layers[layer].mlp(x, state)
        assert torch.equal(state.logits[m], want_logits)
        assert torch.equal(state.chosen[m].sort(-1).values, want_idx.sort(-1).values)
        compared += 1
    assert compared >= 1

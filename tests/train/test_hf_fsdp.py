"""FSDP2 over a model run with transformers' code (`model.impl=hf`): one unit per decoder layer found through
`_no_split_modules`, and two ranks take the one-process steps, with every weight training or PEFT's LoRA layers
(the base frozen bitwise; the reference, the adapters switched off, scored before and after the steps)."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch, spawn

from twinplane.config import AlgoSection, TrainSection
from twinplane.model.hf import load_hf
from twinplane.model.lora import apply_lora
from twinplane.train import Reference, Trainer
from twinplane.train.fsdp import full_state_dict, shard_model, split_for_rank

transformers = pytest.importorskip("transformers")
ALGO = AlgoSection(kl_coef=0.0)


def olmo_folder(path):
    torch.manual_seed(0)
    cfg = transformers.OlmoConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path


def model_and_batch(path, lora):
    model = load_hf(path, "cpu")
    batch = make_batch(model)
    if lora:
        apply_lora(model, 4, 8.0, seed=1)
    return model, batch


def steps(model, batch, lora, group=None, rank=0):
    """Two training steps on rank `rank`'s rows of two (one process: on all rows), with LoRA between the
    reference's log-probs of those rows (one process: rank 0's) before and after; metrics and log-probs."""
    tr = Trainer(model, TrainSection(micro_batch_size=2, lr=1e-2), ALGO, temperature=1.0, total_steps=10,
                 group=group)
    mine = split_for_rank(batch, rank, 2)
    ref = [Reference(model, 1.0, 2, group=group).logprobs(mine)] if lora else []
    metrics = [tr.train_step(batch if group is None else mine) for _ in range(2)]
    return metrics, ref + ([Reference(model, 1.0, 2, group=group).logprobs(mine)] if lora else [])


def _worker(rank, world, tmp, lora):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        model, batch = model_and_batch(f"{tmp}/olmo", lora)
        shard_model(model)
        sharded = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
        metrics, ref = steps(model, batch, lora, dist.group.WORLD, rank)
        state = full_state_dict(model)
        if rank == 0:
            torch.save({"state": state, "metrics": metrics, "units": sharded, "ref": ref}, f"{tmp}/dp{world}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("lora", [False, True])
def test_dp2_fsdp_of_an_hf_model_equals_one_process(tmp_path, lora):
    olmo_folder(tmp_path / "olmo")
    spawn(_worker, (2, str(tmp_path), lora), nprocs=2, timeout=300)
    got = torch.load(tmp_path / "dp2.pt")
    assert got["units"] == 3  # the two OlmoDecoderLayers and the root
    model, batch = model_and_batch(tmp_path / "olmo", lora)
    want, ref = steps(model, batch, lora)
    for g, w in zip(got["metrics"], want, strict=True):
        for k, v in w.items():
            assert g[k] == pytest.approx(v, abs=1e-5), k
    for n, p in model.named_parameters():
        assert torch.allclose(got["state"][n], p.detach(), atol=1e-5), n
    for g, w in zip(got["ref"], ref, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    if lora:  # the frozen base bitwise, the adapters moved, the reference unmoved by them
        base = dict(load_hf(tmp_path / "olmo", "cpu").named_parameters())
        for n, t in got["state"].items():
            name = n.replace(".base_layer.", ".")
            assert torch.equal(t, base[name]) if name in base else t.abs().sum() > 0, n
        assert len(got["ref"]) == 2 and torch.equal(got["ref"][0], got["ref"][1])

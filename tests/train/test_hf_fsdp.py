"""FSDP2 over a model run with transformers' code (`model.impl=hf`): one unit per decoder layer found through
`_no_split_modules`, and two ranks take the one-process steps."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch, spawn

from twinplane.config import AlgoSection, TrainSection
from twinplane.model.hf import load_hf
from twinplane.train import Trainer
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


def _worker(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        model = load_hf(f"{tmp}/olmo", "cpu")
        batch = make_batch(model)
        shard_model(model)
        sharded = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
        tr = Trainer(model, TrainSection(micro_batch_size=2, lr=1e-2), ALGO, temperature=1.0, total_steps=10,
                     group=dist.group.WORLD)
        metrics = [tr.train_step(split_for_rank(batch, rank, world)) for _ in range(2)]
        state = full_state_dict(model)
        if rank == 0:
            torch.save({"state": state, "metrics": metrics, "units": sharded}, f"{tmp}/dp{world}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    os._exit(0)


def test_dp2_fsdp_of_an_hf_model_equals_one_process(tmp_path):
    olmo_folder(tmp_path / "olmo")
    spawn(_worker, (2, str(tmp_path)), nprocs=2, timeout=300)
    got = torch.load(tmp_path / "dp2.pt")
    assert got["units"] == 3  # the two OlmoDecoderLayers and the root
    model = load_hf(tmp_path / "olmo", "cpu")
    batch = make_batch(model)
    tr = Trainer(model, TrainSection(micro_batch_size=2, lr=1e-2), ALGO, temperature=1.0, total_steps=10)
    want = [tr.train_step(batch) for _ in range(2)]
    for g, w in zip(got["metrics"], want, strict=True):
        for k, v in w.items():
            assert g[k] == pytest.approx(v, abs=1e-5), k
    for n, p in model.named_parameters():
        assert torch.allclose(got["state"][n], p.detach(), atol=1e-5), n

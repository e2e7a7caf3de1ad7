"""Sharded checkpoints (torch.distributed.checkpoint): each rank writes its own shards, the state loads onto another
rank count exactly (1 -> 2, 2 -> 1, 2 -> 3 on gloo), training continues as from a full-tensor checkpoint, and rank 0
never holds the full state while saving."""

import datetime
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch, outcome, spawn, tiny_model, train
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from twinplane.cli import main
from twinplane.config import AlgoSection, TrainSection
from twinplane.model import load_weights
from twinplane.run import checkpoint
from twinplane.train import Trainer, sharded
from twinplane.train.fsdp import shard_model, split_for_rank
from twinplane.train.optim import load_named_optimizer_state, named_optimizer_state

TRAIN = TrainSection(micro_batch_size=2, lr=1e-2, warmup_steps=2, weight_decay=0.1)


def full(t):
    """A full tensor, gathered here by DTensor itself (not by the code under test)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(tr: Trainer) -> dict:
    """Weights, AdamW state and param groups of a trainer as full CPU tensors by parameter name."""
    opt = {n: {k: full(v).clone() for k, v in tr.opt.state[p].items()} for n, p in tr.model.named_parameters()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in tr.opt.param_groups]
    return {"weights": {n: full(p.detach()).clone() for n, p in tr.model.named_parameters()}, "opt": opt,
            "groups": groups}


def make_trainer(world: int) -> Trainer:
    model = tiny_model() if world == 1 else shard_model(tiny_model())
    return Trainer(model, TRAIN, AlgoSection(kl_coef=0.1), 1.0, total_steps=10,
                   group=None if world == 1 else dist.group.WORLD)


def step(tr: Trainer, seed: int, rank: int, world: int) -> None:
    tr.train_step(split_for_rank(make_batch(tiny_model(), seed=seed, n=6), rank, world))


def train_and_save(tmp, rank: int, world: int) -> None:
    """Two steps on `world` ranks, then the sharded checkpoint, a full-tensor one and the reference snapshot."""
    tr = make_trainer(world)
    for seed in (1, 2):
        step(tr, seed, rank, world)
    sharded.save(tmp / f"sharded{world}", tr.model, tr.opt, None if world == 1 else dist.group.WORLD)
    fullckpt = {"weights": {n: full(p.detach()).clone() for n, p in tr.model.named_parameters()},
                "optimizer": named_optimizer_state(tr.model, tr.opt), "scheduler": tr.sched.state_dict()}
    snap = snapshot(tr)
    if rank == 0:
        torch.save(fullckpt, tmp / f"full{world}.pt")
        torch.save(snap, tmp / f"saved{world}.pt")


def load_and_continue(tmp, rank: int, world: int, source: int) -> None:
    """The sharded checkpoint of `source` ranks loaded onto `world`, then a step; the full-tensor one, then the
    same step: snapshots of all four states."""
    fullckpt = torch.load(tmp / f"full{source}.pt")
    out = {}
    for how in ("sharded", "full"):
        tr = make_trainer(world)
        if how == "sharded":
            sharded.load(tmp / f"sharded{source}", tr.model, tr.opt, None if world == 1 else dist.group.WORLD)
        else:
            load_weights(tr.model, fullckpt["weights"].items())
            load_named_optimizer_state(tr.model, tr.opt, fullckpt["optimizer"])
        tr.sched.load_state_dict(fullckpt["scheduler"])
        out[f"{how}_loaded"] = snapshot(tr)
        step(tr, 3, rank, world)
        out[f"{how}_continued"] = snapshot(tr)
    if rank == 0:
        torch.save(out, tmp / f"loaded{source}to{world}.pt")


def _worker(rank, world, tmp, what, source=None):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv-{what}-{world}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        from pathlib import Path

        if what == "save":
            train_and_save(Path(tmp), rank, world)
        elif what == "load":
            load_and_continue(Path(tmp), rank, world, source)
        else:
            measure_save_memory(Path(tmp), rank, world)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    os._exit(0)  # skip interpreter teardown: gloo's threads there intermittently abort


def assert_same(got: dict, want: dict) -> None:
    assert got["weights"].keys() == want["weights"].keys() and got["opt"].keys() == want["opt"].keys()
    for n, t in want["weights"].items():
        assert torch.equal(got["weights"][n], t), n
    for n, st in want["opt"].items():
        assert st.keys() == got["opt"][n].keys(), n
        for k, v in st.items():
            assert torch.equal(got["opt"][n][k], v), (n, k)
    assert got["groups"] == want["groups"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of a 2-rank (FSDP2, gloo) and a 1-rank (plain model, this process) run of the same steps."""
    tmp = tmp_path_factory.mktemp("ckpt")
    spawn(_worker, (2, str(tmp), "save"), nprocs=2, timeout=180)
    train_and_save(tmp, 0, 1)
    return tmp


@pytest.mark.parametrize(("source", "world"), [(1, 2), (2, 1), (2, 3)])
def test_resharded_state_is_exact_and_trains_like_a_full_checkpoint(saved, source, world):
    """A sharded checkpoint of `source` ranks loaded onto `world` ranks holds the saved weights, AdamW state and
    param groups bitwise; a step from it equals a step from the full-tensor checkpoint on the same new layout."""
    if world == 1:
        load_and_continue(saved, 0, 1, source)
    else:
        spawn(_worker, (world, str(saved), "load", source), nprocs=world, timeout=180)
    got = torch.load(saved / f"loaded{source}to{world}.pt")
    want = torch.load(saved / f"saved{source}.pt")
    assert_same(got["sharded_loaded"], want)
    assert_same(got["full_loaded"], want)
    assert_same(got["sharded_continued"], got["full_continued"])
    moved = got["sharded_continued"]["weights"]
    assert any(not torch.equal(moved[n], t) for n, t in want["weights"].items())  # the step did train


def test_one_file_per_rank(saved):
    names = sorted(p.name for p in (saved / "sharded2").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "optimizer.json"]


def test_a_metadata_file_that_pickles_other_objects_is_refused(saved, tmp_path):
    import pickle

    bad = tmp_path / "bad"
    shutil.copytree(saved / "sharded1", bad)
    (bad / ".metadata").write_bytes(pickle.dumps(os.system))
    tr = make_trainer(1)
    with pytest.raises(pickle.UnpicklingError, match=re.escape("refused: posix.system")):
        sharded.load(bad, tr.model, tr.opt)
    other = Trainer(tiny_model(hidden_size=32), TRAIN, AlgoSection(), 1.0, total_steps=10)
    with pytest.raises(ValueError, match="Size mismatch between saved .* for model.model.embed_tokens.weight"):
        sharded.load(saved / "sharded1", other.model, other.opt)  # a plain error, not DCP's BaseException



def test_a_model_only_load_gives_each_parameter_its_saved_dtype(tmp_path):
    """Export's read: a model built from its config alone can hold a parameter in another dtype than the trained one
    did (transformers keeps some modules in fp32 only when it loads weights); what comes back is the saved tensor,
    dtype and bits, where DCP alone would cast it to the model's."""
    model = tiny_model().to(torch.bfloat16)
    norm = next(n for n, p in model.named_parameters() if p.ndim == 1)
    model.get_parameter(norm).data = torch.randn(model.get_parameter(norm).shape, dtype=torch.float32)
    sharded.save(tmp_path, model, torch.optim.AdamW(model.parameters()))
    fresh = tiny_model(seed=1).to(torch.bfloat16)
    sharded.load_model_only(tmp_path, fresh)
    assert fresh.get_parameter(norm).dtype == torch.float32
    for n, p in model.named_parameters():
        assert torch.equal(fresh.get_parameter(n), p), n

BIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2,
           head_dim=64)


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read())[1]) << 10


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set size (VmHWM) to the current
        f.write("5")


def measure_save_memory(tmp, rank: int, world: int) -> None:
    model = shard_model(tiny_model(**BIG))
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # AdamW state: 2 tensors per parameter
    full_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + exp_avg + exp_avg_sq
    ratios = {}
    for how in ("sharded", "full"):
        dist.barrier()
        _reset_peak_rss()
        before = _peak_rss()
        if how == "sharded":
            sharded.save(tmp / "big", model, opt, dist.group.WORLD)
        else:
            state = ({n: full(p.detach()).clone() for n, p in model.named_parameters()},
                     named_optimizer_state(model, opt))
            del state
        ratios[how] = (_peak_rss() - before) / full_bytes
    if rank == 0:
        torch.save(ratios | {"full_bytes": full_bytes}, tmp / "memory.pt")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_rank0_memory_while_saving_is_a_fraction_of_the_full_state(tmp_path):
    """Rank 0 of 2 saves its shards of a 5M-parameter model and its AdamW state (60 MB in all). Measured: the
    growth of rank 0's peak resident set (VmHWM, reset through /proc/self/clear_refs just before) during the save,
    over the full state's bytes. The sharded save stays at or under 0.6 (its own half of the state is already
    resident: what it adds is DCP's per-tensor staging); gathering the full tensors, as the full format does,
    needs at least the whole state (the check that the measure sees tensor memory at all)."""
    spawn(_worker, (2, str(tmp_path), "memory"), nprocs=2, timeout=180)
    m = torch.load(tmp_path / "memory.pt")
    print(f"rank 0 peak memory while saving / full state ({m['full_bytes'] / 1e6:.0f} MB): "
          f"sharded {m['sharded']:.3f}, full-tensor gather {m['full']:.3f}")
    assert m["sharded"] <= 0.6
    assert m["full"] >= 0.9


# --- whole runs: resume, export, damaged checkpoints ----------------------------------------------------------------

RUN = ["train.steps=4", "checkpoint.every=2", "eval.every=0", "eval.after=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run uninterrupted with full-tensor checkpoints, and with sharded ones preempted at step 3 and
    resumed."""
    tmp = tmp_path_factory.mktemp("runs")
    assert train(tmp / "full", *RUN, "checkpoint.format=full") == 0
    assert train(tmp / "sharded", *RUN, "checkpoint.format=sharded", fault="train@3") == 75
    assert train(tmp / "sharded", *RUN, "checkpoint.format=sharded", "--resume", "auto") == 0
    return tmp


def test_sharded_run_preempted_and_resumed_is_bitwise_the_uninterrupted_one(runs):
    ckpt = runs / "sharded" / "checkpoints" / "step_00000004"
    assert sharded.is_sharded(ckpt / "policy") and not (ckpt / "optimizer.pt").exists()
    assert outcome(runs / "sharded") == outcome(runs / "full")


def test_export_of_a_sharded_checkpoint_equals_the_full_one(runs, tmp_path, capsys):
    for name in ("full", "sharded"):
        assert main(["export", str(runs / name / "checkpoints" / "step_00000004"), "--out", str(tmp_path / name)]) == 0
    a, b = load_file(tmp_path / "sharded" / "model.safetensors"), load_file(tmp_path / "full" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in b)
    files = {name: sorted(p.name for p in (tmp_path / name).iterdir()) for name in ("full", "sharded")}
    assert files["sharded"] == files["full"]


def test_incomplete_sharded_checkpoint_is_skipped_and_a_damaged_one_named_is_exit_2(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs / "sharded", run)
    newest, older = checkpoint.list_checkpoints(run)[-1], checkpoint.list_checkpoints(run)[-2]
    (newest / checkpoint.MANIFEST).unlink()  # as a kill before the manifest leaves it
    assert checkpoint.resolve(run, "auto", log=lambda m: None) == older
    shard = older / "policy" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert train(run, *RUN, "train.steps=6", "checkpoint.format=sharded", "--resume", str(older)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "policy/__0_0.distcp fails its checksum" in err, err
    assert main(["export", str(older), "--out", str(tmp_path / "hf")]) == 2


@pytest.mark.parametrize("extra", [
    pytest.param(["train.lora.rank=4", "train.lr=2e-2"], id="lora"),
    pytest.param(["algo.name=ppo", "critic.warmup_steps=1", "critic.lr=1e-3"], id="ppo")])
def test_lora_and_critic_state_resume_bitwise_from_shards(tmp_path, extra):
    """LoRA (the adapters and their AdamW state; the base is not copied) and PPO's critic, sharded: preempted and
    resumed equals uninterrupted; a LoRA checkpoint exports (merged, and the adapters alone) as the full one does."""
    assert train(tmp_path / "full", *RUN, *extra, "checkpoint.format=full") == 0
    assert train(tmp_path / "sharded", *RUN, *extra, "checkpoint.format=sharded", fault="train@3") == 75
    assert train(tmp_path / "sharded", *RUN, *extra, "checkpoint.format=sharded", "--resume", "auto") == 0
    assert outcome(tmp_path / "sharded") == outcome(tmp_path / "full")
    ckpt = {name: tmp_path / name / "checkpoints" / "step_00000004" for name in ("full", "sharded")}
    if "algo.name=ppo" in extra:
        assert sharded.is_sharded(ckpt["sharded"] / "critic")
        return
    saved = sharded.SafeReader(ckpt["sharded"] / "policy").read_metadata().state_dict_metadata
    params = [k for k in saved if k.startswith("model.")]
    assert params and all(k.endswith((".lora_A", ".lora_B")) for k in params)  # the frozen base is not copied
    for fmt, weights_file in (("merged", "model.safetensors"), ("peft", "adapter_model.safetensors")):
        out = {name: tmp_path / f"{name}-{fmt}" for name in ckpt}
        for name in ckpt:
            assert main(["export", str(ckpt[name]), "--out", str(out[name]), "--format", fmt]) == 0
        a, b = load_file(out["sharded"] / weights_file), load_file(out["full"] / weights_file)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in b)

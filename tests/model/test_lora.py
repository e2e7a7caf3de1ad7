"""LoRA: adapters on the shared model, the reference from the disabled adapters, adapter-only weight sync,
PEFT export, DP=2 with adapters, and bitwise kill/resume."""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from conftest import QWEN25_7B, make_batch, ray_init, spawn, tiny_model
from conftest import train as run_train
from safetensors.torch import load_file

from twinplane.cli import main
from twinplane.cluster.sync import sync_in_process
from twinplane.config import AlgoSection, ConfigError, TrainSection, load_config
from twinplane.model import save_pretrained
from twinplane.model.lora import (
    LoraLinear,
    adapter_numel,
    adapters_disabled,
    apply_lora,
    cast_base,
    is_adapter,
    merge_lora,
)
from twinplane.model.lora_io import apply_adapter, save_adapter
from twinplane.platform import devices
from twinplane.rollout import RolloutEngine
from twinplane.run import checkpoint
from twinplane.train import Reference, Trainer
from twinplane.train.fsdp import full_state_dict, shard_model, split_for_rank

ALGO = AlgoSection(kl_coef=0.1, entropy_coef=0.01)


def lora_model(seed=0, rank=4, targets="all"):
    model = tiny_model(seed)
    apply_lora(model, rank, alpha=8.0, targets=targets, seed=1)
    return model


def trained(steps=3, lr=2e-2, **kw):
    """A LoRA model after `steps` optimizer steps (adapters no longer zero), its trainer and the batch."""
    model = lora_model(**kw)
    batch = make_batch(tiny_model())
    trainer = Trainer(model, TrainSection(micro_batch_size=4, lr=lr), ALGO, temperature=1.0, total_steps=10)
    for _ in range(steps):
        trainer.train_step(batch)
    return model.eval(), trainer, batch


def test_step0_logits_equal_the_base_and_only_adapters_train():
    base, model = tiny_model(), lora_model()
    ids = torch.randint(0, 50, (3, 9))
    assert torch.equal(model(ids), base(ids))  # B = 0: exactly the base, not just close
    wrapped = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(wrapped) == 2 * 7  # every attention and MLP linear of 2 layers; never the LM head
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if is_adapter(n)}
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if is_adapter(n))
    names = {n for n, _ in model.named_parameters() if not is_adapter(n)}
    assert names == {n for n, _ in base.named_parameters()}  # HF names unchanged: loading/saving just work
    narrow = lora_model(targets="q_proj,v_proj")
    assert sorted({n.split(".")[-2] for n, _ in narrow.named_parameters() if is_adapter(n)}) == ["q_proj", "v_proj"]


def test_bf16_base_keeps_fp32_adapters():
    model = cast_base(lora_model(), torch.bfloat16)
    assert {p.dtype for n, p in model.named_parameters() if not is_adapter(n)} == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if is_adapter(n)} == {torch.float32}
    assert model(torch.randint(0, 50, (2, 5))).dtype == torch.bfloat16


def test_training_changes_only_adapters_and_merge_equals_adapted():
    before = tiny_model()
    model, trainer, batch = trained()
    params = dict(model.named_parameters())
    for n, p in before.named_parameters():
        assert torch.equal(params[n], p), n  # the base is bitwise unchanged
    assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in params.items() if n.endswith("lora_B"))
    assert set(trainer.opt.state) == {p for n, p in params.items() if is_adapter(n)}  # optimizer: adapters only
    ids = torch.randint(0, 50, (3, 9))
    adapted = model(ids)
    assert not torch.allclose(adapted, before(ids), atol=1e-3)  # training moved the policy
    merged = merge_lora(copy.deepcopy(model))
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert torch.allclose(merged(ids), adapted, atol=1e-5)
    # export_weights(merged=True) is the same fold, done without touching the trainer's model
    folded = dict(trainer.named_weights(merged=True))
    assert set(folded) == {n for n, _ in before.named_parameters()}
    for n, p in merged.named_parameters():
        assert torch.equal(folded[n], p), n


def test_reference_from_disabled_adapters_equals_a_separate_base_copy():
    model, _, batch = trained()
    shared = Reference(model, 1.0, micro_batch_size=4).logprobs(batch)
    separate = Reference(tiny_model(), 1.0, micro_batch_size=4).logprobs(batch)
    assert torch.equal(shared, separate)
    assert model.model.layers[0].self_attn.q_proj.enabled  # switched back on afterwards
    assert all(p.requires_grad for n, p in model.named_parameters() if is_adapter(n))  # still trainable
    with adapters_disabled(model):
        assert not model.model.layers[0].mlp.down_proj.enabled


@pytest.mark.parametrize("merge", [False, True])
def test_sync_adapter_only_or_merged_checksums_and_bytes(merge):
    model, trainer, _ = trained()
    engine_model = copy.deepcopy(tiny_model()) if merge else copy.deepcopy(lora_model())  # step-0 weights
    engine = RolloutEngine(engine_model, eos_token_id=None)
    report = sync_in_process(engine, trainer, version=1)
    assert report.mismatched() == []
    full_bytes = sum(p.numel() * 4 for _, p in tiny_model().named_parameters())
    assert report.bytes == (full_bytes if merge else adapter_numel(model) * 4)
    assert report.bytes < full_bytes or merge
    ids = torch.randint(0, 50, (2, 7))
    assert torch.allclose(engine.model(ids), model(ids), atol=1e-5)  # the engine now runs the trained policy
    if not merge:  # the checksum covers the base the engines already held: a damaged base is caught
        with torch.no_grad():
            engine.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
        assert sync_in_process(engine, trainer, version=2).mismatched() == ["engine 0"]


def test_peft_loads_the_exported_adapter_with_equal_logits(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model, _, _ = trained()
    save_pretrained(tiny_model(), tmp_path / "base")
    save_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        got = peft_model(input_ids=ids).logits
    assert torch.allclose(got, model(ids), atol=1e-5)
    # and the folder loads back into twinplane's model
    again = apply_adapter(tiny_model(), tmp_path / "adapter")
    assert torch.equal(again(ids), model(ids))


def _dp_worker(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        batch = make_batch(tiny_model())
        model = shard_model(lora_model())
        tr = Trainer(model, TrainSection(micro_batch_size=2, lr=1e-2), ALGO, temperature=1.0, total_steps=10,
                     group=dist.group.WORLD)
        metrics = [tr.train_step(split_for_rank(batch, rank, world)) for _ in range(2)]
        ref = Reference(model, 1.0, 2, group=dist.group.WORLD).logprobs(split_for_rank(batch, rank, world))
        state = full_state_dict(model)
        if rank == 0:
            torch.save({"state": state, "metrics": metrics, "ref": ref}, f"{tmp}/dp{world}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    os._exit(0)


def test_dp2_fsdp_with_lora_equals_dp1(tmp_path):
    spawn(_dp_worker, (2, str(tmp_path)), nprocs=2, timeout=300)
    got = torch.load(tmp_path / "dp2.pt")
    batch = make_batch(tiny_model())
    model = lora_model()
    tr = Trainer(model, TrainSection(micro_batch_size=2, lr=1e-2), ALGO, temperature=1.0, total_steps=10)
    want = [tr.train_step(batch) for _ in range(2)]
    for g, w in zip(got["metrics"], want, strict=True):
        for k, v in w.items():
            assert g[k] == pytest.approx(v, abs=1e-5), k
    for n, p in model.named_parameters():
        assert torch.allclose(got["state"][n], p.detach(), atol=1e-5), n
    base = tiny_model()
    for n, p in base.named_parameters():
        assert torch.equal(got["state"][n], p), n  # frozen under FSDP too
    want_ref = Reference(model, 1.0, 2).logprobs(split_for_rank(batch, 0, 2))
    assert torch.allclose(got["ref"], want_ref, atol=1e-6)


ARGS = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=5",
        "train.steps=6", "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=12", "train.mini_batches=2",
        "train.micro_batch_size=6", "algo.kl_coef=0.05", "log.progress=false", "checkpoint.every=2",
        "checkpoint.keep=2", "eval.every=3", "eval.n=2", "train.lora.rank=4", "train.lr=2e-2",
        "algo.entropy_coef=0.01"]  # a gradient even when the tiny warm start leaves every reward at 0


def train(run_dir, *extra, fault=None):
    return run_train(run_dir, *extra, fault=fault, args=ARGS)


def outcome(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "mem/", "sync/gb_per_s"))} for r in rows]
    return (run_dir / "final_adapter" / "adapter_model.safetensors").read_bytes(), rows


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora")
    assert train(run) == 0
    return run


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_only_and_syncs_adapter_bytes(lora_run):
    rows = outcome(lora_run)[1]
    adapters = load_file(lora_run / "final_adapter" / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * 4 for t in adapters.values())
    assert all(r["sync/bytes"] == adapter_bytes for r in rows if r["step"] > 0)
    assert any(r["actor/kl"] > 0 for r in rows if r["step"] > 0)  # the reference (base) differs from the policy
    ckpt = checkpoint.list_checkpoints(lora_run)[-1]
    assert not (ckpt / "model").exists() and (ckpt / "adapter" / "adapter_model.safetensors").exists()
    state = json.loads((ckpt / "state.json").read_text())
    assert state["lora_base"]["path"] == str((lora_run / "base").resolve()) and len(state["lora_base"]["sha256"]) == 64
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert all(is_adapter(n) for n in opt["state"])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["weight_sync@3"])
def test_lora_kill_resume_is_bitwise(fault, tmp_path, lora_run):
    assert train(tmp_path, fault=fault) == 75
    assert train(tmp_path, "--resume", "auto") == 0
    got, want = outcome(tmp_path), outcome(lora_run)
    assert got[0] == want[0]
    assert [r["step"] for r in got[1]] == [0, 1, 2, 3, 4, 5, 6]
    assert got[1] == want[1]
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == \
        (lora_run / "final" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_resume_refuses_a_changed_base(tmp_path, lora_run, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    ckpt = checkpoint.list_checkpoints(run)[-1]
    state = json.loads((ckpt / "state.json").read_text())
    state["lora_base"]["path"] = str(run / "base")  # the copy's own base, then damaged
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt / "manifest.json").read_text())  # re-seal: the checkpoint itself stays intact
    manifest["files"]["state.json"] = {"size": (ckpt / "state.json").stat().st_size,
                                       "sha256": checkpoint._sha256(ckpt / "state.json")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    weights = run / "base" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert train(run, "train.steps=8", "--resume", str(ckpt)) == 2
    assert "changed since the checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_export_peft_and_merged(lora_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    assert main(["export", str(lora_run), "--out", str(tmp_path / "merged")]) == 0  # merged is the default
    assert main(["export", str(lora_run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json",
                                                                      "adapter_model.safetensors"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(lora_run / "base")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    ids = torch.randint(0, 10, (2, 6))
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").exists() or any((tmp_path / "merged").glob("tokenizer*"))


def test_export_peft_of_a_full_run_is_an_error(tmp_path, capsys):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert main(["export", str(tmp_path), "--format", "peft", "--out", str(tmp_path / "o")]) == 2
    assert "no LoRA adapters" in capsys.readouterr().err


@pytest.mark.parametrize(("override", "key"), [
    ("train.lora.targets=q_proj,lm_head", "train.lora.targets"),
    ("train.lora.rank=-1", "train.lora.rank"),
    ("rollout.lora_merge=true", "rollout.lora_merge"),
])
def test_bad_lora_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_planner_counts_adapters_and_fits_qwen7b_on_one_gpu():

    from twinplane.model import ModelConfig
    from twinplane.model.memory import Dtypes, Workload, lora_params, training_memory
    from twinplane.tools.plan import Cluster, layouts, recommend

    small = tiny_model()
    assert lora_params(small.config, 4) == adapter_numel(lora_model(rank=4))  # against the real adapters
    cfg = ModelConfig.from_hf(QWEN25_7B)
    w, full = Workload(32, 8, 512, 1024, 4, lora_rank=16), Workload(32, 8, 512, 1024, 4)
    lp, p = lora_params(cfg, 16), cfg.num_params
    assert 0.004 < lp / p < 0.006
    tm = training_memory(cfg, Dtypes.for_device(devices.BY_KEY["h100"]), w)
    assert tm.resident == pytest.approx(2 * p + 16 * lp)  # bf16 base; fp32 adapters, grads and AdamW moments
    assert not layouts(cfg, Cluster(devices.BY_KEY["h100"], 1, 1, 2.0), full)  # full fine-tuning: not on one H100
    for gpu in ("h100", "mi300x"):
        one = Cluster(devices.BY_KEY[gpu], 1, 1, 2.0)
        best, _ = recommend(cfg, one, w)
        assert best is not None and best.colocated and best.resharding_bytes == lp * 4
    assert main(["plan", "--model", "x", "--gpu", "h100", "--lora", "-1"]) == 2  # (twinplane.cli's main)


@pytest.mark.slow
def test_lora_on_ray_disaggregated_equals_local(tmp_path):
    """The adapters cross processes by the bucketed broadcast (1 trainer actor + 1 engine actor): the same run as
    one process, every engine checksum matching, sync bytes = the adapters'."""
    ray = pytest.importorskip("ray")
    args = [*ARGS[:4], "train.steps=2", "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=8",
            "eval.before=false", "log.progress=false", "checkpoint.every=2", "threads=1", "train.micro_batch_size=6",
            "algo.kl_coef=0.05", "cluster.sync_bucket_mb=1", "cluster.timeout_s=120", "train.lora.rank=4"]
    threads = torch.get_num_threads()
    assert main(["train", "--run-dir", str(tmp_path / "local"), *args]) == 0
    ray_init(num_cpus=2)
    try:
        assert main(["train", "--run-dir", str(tmp_path / "ray"), *args, "cluster.backend=ray"]) == 0
    finally:
        ray.shutdown()
        torch.set_num_threads(threads)
    local, remote = (outcome(tmp_path / d) for d in ("local", "ray"))
    assert [r["step"] for r in remote[1]] == [1, 2]
    for g, w in zip(remote[1], local[1], strict=True):
        assert g["sync/bytes"] == w["sync/bytes"] < 100_000  # the adapters only
        for k, v in w.items():  # engine occupancy/KV metrics included: the Ray engine reports the same counters
            if not k.startswith("rollout/engine_busy"):
                assert g[k] == pytest.approx(v, abs=1e-5), k

"""The shipped example configs: every one loads and validates (no model, data, hub or GPU needed), and the two
8-GPU configs have the cluster layout docs/scale-out.md describes."""

from pathlib import Path

import pytest

from twinplane.config import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
YAMLS = sorted(EXAMPLES.glob("*.yaml"))
EIGHT_GPU = ["nvidia_8gpu.yaml", "mi300x_8gpu.yaml"]
MEMORY_KEYS = ("max_tokens_per_micro_batch", "activation_checkpointing", "optimizer_offload")


def test_examples_exist():
    names = {p.name for p in YAMLS}
    assert {"gsm8k_instruct.yaml", *EIGHT_GPU} <= names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_example_loads(path):
    cfg = load_config(path)  # unknown keys, wrong types and invalid combinations raise ConfigError
    assert cfg.data.train_file


@pytest.mark.parametrize("name", EIGHT_GPU)
def test_8gpu_layout(name):
    cfg = load_config(EXAMPLES / name)
    c = cfg.cluster
    assert (c.backend, c.train_devices, c.rollout_devices, c.colocate) == ("ray", 8, 8, True)
    assert cfg.rollout.tp == 1
    assert cfg.model.path and Path(cfg.model.path).is_absolute()  # a local folder: nothing is downloaded
    assert (cfg.model.dtype, cfg.model.rollout_dtype) == ("float32", "bfloat16")  # fp32 master, bf16 engines
    assert cfg.train.max_tokens_per_micro_batch > 0
    assert cfg.reward.name == "gsm8k"


def test_8gpu_configs_differ_only_in_memory_switches():
    nv, mi = (load_config(EXAMPLES / n) for n in EIGHT_GPU)
    assert nv.train.activation_checkpointing and not nv.train.optimizer_offload  # 80 GB H100
    assert not mi.train.optimizer_offload and not mi.train.activation_checkpointing  # 192 GB MI300X
    a, b = nv.to_dict(), mi.to_dict()
    for d in (a, b):
        for k in MEMORY_KEYS:
            del d["train"][k]
    assert a == b

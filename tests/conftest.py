import device_only
import pytest
import torch

from twinplane.model import ModelConfig, Transformer, load_model, save_pretrained

# Collectives here, in the spawned multi-rank workers (they import this module by name) and in Ray's workers
# (`ray_init`) refuse host tensors where NCCL/RCCL would.
device_only.install()


def ray_init(num_cpus: int) -> None:
    """A local Ray cluster whose workers' collectives are device-only too."""
    import ray

    ray.cloudpickle.register_pickle_by_value(device_only)  # Ray's workers do not see tests/
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"worker_process_setup_hook": device_only.install})


def tiny_model(seed: int = 0, **over) -> Transformer:
    cfg = dict(vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**cfg, **over}))
    with torch.no_grad():  # larger-than-default weights so distributions are peaked and sampling is varied
        for p in model.parameters():
            if p.ndim >= 2:  # (MoE experts are stacked 3-D weights)
                p.normal_(0, 0.15)
    return model.eval()


MOE = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True, mlp_only_layers=[1], num_layers=3)


def tiny_moe(seed: int = 0, **over) -> Transformer:
    """A Qwen3-MoE-shaped tiny model (layers 0 and 2 sparse, layer 1 dense)."""
    return tiny_model(seed, **{**MOE, **over})


@pytest.fixture
def model():
    return tiny_model()


def saved_and_reloaded(src, tmp_path, max_shard_bytes: int):
    """`src` (a transformers model) loaded by twinplane, every weight perturbed, saved sharded; returns (ours,
    transformers' load of what we saved, twinplane's reload of it)."""
    import transformers

    src.save_pretrained(tmp_path / "src")
    ours = load_model(tmp_path / "src")
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(ours, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    return ours, back, load_model(tmp_path / "out")

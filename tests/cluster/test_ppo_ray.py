"""PPO's critic on Ray: on the training ranks (cluster.critic_devices=0) or on ranks of its own (K > 0), equal to
one process; sharded critics equal an unsharded one; preemption and resume (onto another critic layout) bitwise."""

import pytest
import torch
from conftest import CLUSTER_RUN, RAY, cluster_train, computed, ray_init, rows, weights
from safetensors.torch import load_file

from twinplane.cli import main
from twinplane.config import ConfigError, load_config

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a local Ray cluster, whole runs on it

PPO = ["algo.name=ppo", "critic.warmup_steps=1", "critic.lr=1e-3", "algo.kl_in_reward=true", "algo.kl_ctrl=adaptive"]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    threads = torch.get_num_threads()
    # logical CPUs: a critic rank is a third 1-CPU worker (the runs are sequential, so 2 cores carry them)
    ray_init(num_cpus=3)
    yield
    ray.shutdown()
    torch.set_num_threads(threads)


def critic(run_dir, step=2):
    return load_file(run_dir / "checkpoints" / f"step_{step:08d}" / "critic.safetensors")


@pytest.fixture(scope="module")
def local_ppo(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppo_local")
    assert cluster_train(d, *PPO) == 0
    return d


@pytest.fixture(scope="module")
def ray_ppo(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppo_ray")
    assert cluster_train(d, *PPO, *RAY) == 0
    return d


def assert_same_run(got_dir, want_dir, exact=False):
    got, want = rows(got_dir), rows(want_dir)
    assert [r["step"] for r in got] == [1, 2]
    assert "actor/pg_loss" not in got[0] and "actor/pg_loss" in got[1]  # critic warmup: the actor waited
    for g, w in zip(got, want, strict=True):
        assert "critic/vf_loss" in g and "critic/values_mean" in g
        for k, v in computed(w).items():
            assert g[k] == (v if exact else pytest.approx(v, abs=1e-5, nan_ok=True)), k
    for a, b in ((weights(got_dir), weights(want_dir)), (critic(got_dir), critic(want_dir))):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) if exact else torch.allclose(a[n], b[n], atol=1e-5) for n in b)


def test_critic_on_the_training_rank_equals_local(local_ppo, ray_ppo):
    """critic_devices=0: the training actor builds the critic too; values and updates as in one process."""
    assert_same_run(ray_ppo, local_ppo)


def test_critic_on_its_own_rank_equals_local(local_ppo, tmp_path):
    """critic_devices=1: a critic actor of its own (trainer + engine + critic = 3 workers)."""
    assert cluster_train(tmp_path, *PPO, *RAY, "cluster.critic_devices=1") == 0
    assert_same_run(tmp_path, local_ppo)


def test_preempted_then_resumed_on_another_critic_layout_is_bitwise(ray_ppo, tmp_path, monkeypatch):
    """SIGTERM with a critic rank of its own; the checkpoint holds the critic's full state by name, so the resumed
    run puts it on the training rank instead and continues exactly as the uninterrupted run."""
    common = [*PPO, *RAY]
    assert cluster_train(tmp_path, *common, "cluster.critic_devices=1", fault="weight_sync@1",
                         monkeypatch=monkeypatch) == 75
    assert (tmp_path / "checkpoints" / "step_00000001" / "critic_optimizer.pt").exists()
    monkeypatch.delenv("TWINPLANE_FAULT")
    assert main(["train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *common, "--resume", "auto"]) == 0
    a, b = weights(tmp_path), weights(ray_ppo)
    assert all(torch.equal(a[n], b[n]) for n in b)
    assert [computed(r) for r in rows(tmp_path)] == [computed(r) for r in rows(ray_ppo)]
    assert all(torch.equal(x, critic(ray_ppo)[n]) for n, x in critic(tmp_path).items())


@pytest.mark.parametrize("layout", [
    ["cluster.colocate=true", "cluster.train_devices=2", "cluster.rollout_devices=2"],  # on 2 training ranks
    ["cluster.colocate=true", "cluster.critic_devices=2"],  # 2 critic ranks of its own
], ids=["training_ranks", "own_ranks"])
def test_sharded_critic_equals_one_process_and_loads_any_layout(layout, tmp_path):
    """FSDP2 over 2 ranks (gloo): values and updates equal an unsharded critic's on the same batch; the gathered
    state equals its state, and a full state loads into the shards exactly."""
    from twinplane.cluster import build_planes
    from twinplane.cluster.planes import build_critic, critic_weights
    from twinplane.rollout import SamplingParams
    from twinplane.run.prepare import prepare
    from twinplane.train import Batch

    cfg = load_config(None, [*CLUSTER_RUN, *PPO, *RAY, *layout, f"run_dir={tmp_path}", "algo.kl_coef=0"])
    setup = prepare(cfg)
    planes = build_planes(cfg, setup.model, None, setup.tokenizer, log=lambda *_: None)
    local = build_critic(cfg, setup.model.config, critic_weights(cfg, setup.model), torch.device("cpu"))
    try:
        samples = planes.rollout.generate([p.ids for p in setup.train_prompts[:5]], SamplingParams(n=2,
                                                                                                  max_new_tokens=4))
        batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0)
        batch.returns = torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask
        for _ in range(2):
            batch.old_values = local.values(batch)
            assert torch.allclose(planes.critic.values(batch), batch.old_values, atol=1e-5)
            got, want = planes.critic.train_step(batch), local.train_step(batch)
            for k, v in want.items():
                assert got[k] == pytest.approx(v, abs=1e-5), k
        assert batch.old_values.abs().sum() > 0  # the head has moved off zero: the values are compared for real
        got, want = planes.critic.state(), local.state()
        assert all(torch.allclose(got["weights"][n], w, atol=1e-5) for n, w in want["weights"].items())
        planes.critic.load_state(want)  # full tensors by name, into the shards
        got = planes.critic.state()
        assert all(torch.equal(got["weights"][n], w) for n, w in want["weights"].items())
        for name, st in want["optimizer"]["state"].items():
            assert all(torch.equal(got["optimizer"]["state"][name][k], v) for k, v in st.items()), name
    finally:
        planes.close()
        setup.scorer.close()


@pytest.mark.parametrize(("override", "message"), [
    (["cluster.critic_devices=-1"], "cluster.critic_devices: must be >= 0"),
    ([*PPO, "cluster.critic_devices=1"], "cluster.critic_devices: needs cluster.backend=ray"),
    ([*RAY, "cluster.critic_devices=1"], "cluster.critic_devices: must be 0 without a critic"),
    ([*PPO, *RAY, "cluster.critic_devices=99"], "cluster.critic_devices: must be <= the samples per mini-batch"),
])
def test_bad_critic_devices_is_a_one_line_config_error(override, message, tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(None, [*CLUSTER_RUN, *override])
    assert main(["train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_unplaceable_critic_ranks_are_counted(tmp_path, capsys):
    """The placement check counts critic ranks with the trainers and engines (3 + 2 workers > 3 CPUs)."""
    assert cluster_train(tmp_path, *PPO, *RAY, "cluster.critic_devices=3") == 2
    assert "5 workers of {'CPU': 1} need {'CPU': 5}" in capsys.readouterr().err

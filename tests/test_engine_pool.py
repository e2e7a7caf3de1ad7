"""Engines in worker processes (CPU): the samples are one in-process engine's, weights follow syncs, errors and dead
workers surface, and the local plane builds one per torch thread."""

import copy
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_model
from test_engine import EOS, PROMPTS

from twinplane import platform
from twinplane.config import Config
from twinplane.errors import WorkerError
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.pool import EnginePool

# 256 wide: the engines' GEMMs run from packed copies (twinplane.model.packed), which a sync must re-make
PACKED = dict(hidden_size=256, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture
def pool_and_engine():
    model = tiny_model(**PACKED)
    pool = EnginePool(copy.deepcopy(model), EOS, workers=2, seed=5, max_num_seqs=4)
    yield pool, RolloutEngine(copy.deepcopy(model), EOS, seed=5, max_num_seqs=4)
    pool.close()


def same(a, b, logprob_tol=1e-5):
    assert [(s.request_index, s.prompt_ids, s.token_ids, s.finish_reason) for s in a] == \
        [(s.request_index, s.prompt_ids, s.token_ids, s.finish_reason) for s in b]
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=logprob_tol, rtol=0)


def test_pool_samples_equal_one_engine_greedy_and_seeded(pool_and_engine):
    pool, engine = pool_and_engine
    for sp in (SamplingParams(temperature=0, max_new_tokens=9, n=2),
               SamplingParams(temperature=1.0, max_new_tokens=12, n=3, stop_token_ids=[7]),
               SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=6, min_new_tokens=3, n=2, seed=123)):
        out = pool.generate(PROMPTS, sp)
        same(out, engine.generate(PROMPTS, sp))
        assert len(out) == len(PROMPTS) * sp.n
    # the call seeds come from one generator, as in one engine: a second unseeded call draws the next one
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    same(pool.generate(PROMPTS[:3], sp), engine.generate(PROMPTS[:3], sp))
    m = pool.pop_metrics()  # both workers' counters, merged
    assert m["rollout/engine_steps"] > 0 and m["rollout/preemptions"] == 0 and pool.pop_metrics() == {}
    assert "time/engine_busy_min" in m


def test_pool_follows_weight_syncs(pool_and_engine):
    """The workers' packed GEMM copies are re-made from the shared weights, which their own version counters
    cannot see change."""
    pool, engine = pool_and_engine
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    before = pool.generate(PROMPTS, sp)
    new = {n: p + 0.05 * torch.randn_like(p) for n, p in engine.model.named_parameters()}
    pool.load_weights(new.items(), version=7)
    engine.load_weights(new.items(), version=7)
    after = pool.generate(PROMPTS, sp)
    same(after, engine.generate(PROMPTS, sp))
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    assert {s.weight_version for s in after} == {7} and pool.weight_version == 7
    assert pool.checksum() == engine.checksum()


def test_pool_raises_a_workers_error_and_survives_it(pool_and_engine):
    pool, _ = pool_and_engine
    with pytest.raises(ValueError, match=r"^request 1: empty prompt$"):
        pool.generate([[5, 6], []], SamplingParams(max_new_tokens=2))
    assert len(pool.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == len(PROMPTS)  # pipes still in step


def test_pool_workers_ignore_stop_signals_and_a_dead_worker_is_named(pool_and_engine):
    pool, _ = pool_and_engine
    os.kill(pool.procs[0].pid, signal.SIGTERM)  # the run decides what a stop request means, not a worker
    assert len(pool.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == len(PROMPTS)
    os.kill(pool.procs[1].pid, signal.SIGKILL)
    pool.procs[1].join()
    with pytest.raises(WorkerError, match=r"^rollout engine process 1 \(pid \d+\) died with exit code -9 during "
                                          r"generate$"):
        pool.generate(PROMPTS, SamplingParams(max_new_tokens=2))


def test_pool_that_cannot_build_its_engines_says_why_and_leaves_no_process():
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="must be >= 1"):
        EnginePool(tiny_model(), EOS, workers=2, max_num_seqs=0)
    assert set(multiprocessing.active_children()) == before
    with pytest.raises(ValueError, match="at least 2 workers"):
        EnginePool(tiny_model(), EOS, workers=1)


def test_local_plane_runs_one_engine_process_per_thread_on_cpu(monkeypatch):
    assert platform.engine_processes(torch.device("cpu"), 3) == 3
    assert platform.engine_processes(torch.device("cuda"), 3) == 1  # a GPU's engine is one process
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert platform.engine_processes(torch.device("cpu")) == 2
    from twinplane.cluster import local_engine
    from twinplane.tokenizer import build_char_tokenizer

    cfg = Config()
    cfg.rollout.cpu_engines = 1
    tok = build_char_tokenizer("abc")
    assert isinstance(local_engine(cfg, tiny_model(), tok), RolloutEngine)
    cfg.rollout.cpu_engines = 2
    pool = local_engine(cfg, tiny_model(), tok)
    procs = list(pool.procs)
    try:
        assert isinstance(pool, EnginePool) and pool.workers == 2 and all(p.is_alive() for p in procs)
    finally:
        pool.close()
    assert not any(p.is_alive() for p in procs)


def test_workers_exit_when_the_pool_process_dies_abruptly(tmp_path):
    """`os._exit` (a second stop request) runs no cleanup: the workers must still see EOF and go, else they keep
    the run's stdout open and whoever waits on it hangs."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, sys\nsys.path.insert(0, sys.argv[1])\nfrom conftest import tiny_model\n"
        "from twinplane.rollout.pool import EnginePool\n"
        "pool = EnginePool(tiny_model(), 1, workers=3)\nprint(*[p.pid for p in pool.procs], flush=True)\nos._exit(3)\n")
    out = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False

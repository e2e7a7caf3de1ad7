"""What several test files build on: tiny models, a training batch, the engine's reference decode and cases,
simulated GPUs, spawned ranks, and `twinplane train` runs on tiny settings (in this process, or on a Ray cluster).
The `gpu` marker skips a test where torch sees no CUDA/HIP device. Without one, Triton's kernels run in its CPU
interpreter (TRITON_INTERPRET=1, set here first: Triton reads it once, when it is imported)."""

import copy
import itertools
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import device_only
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from twinplane.cli import main
from twinplane.model import AttentionMetadata, ModelConfig, Transformer, load_model, save_pretrained
from twinplane.platform import hardware
from twinplane.rollout.paged_attention import PagedKV, paged_attention
from twinplane.train import Batch
from twinplane.train.logprobs import response_logprobs

# Collectives here, in the spawned multi-rank workers (they import this module by name) and in Ray's workers
# (`ray_init`) refuse host tensors where NCCL/RCCL would.
device_only.install()


def ray_init(num_cpus: int) -> None:
    """A local Ray cluster whose workers' collectives are device-only too."""
    import ray

    ray.cloudpickle.register_pickle_by_value(device_only)  # Ray's workers do not see tests/
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"worker_process_setup_hook": device_only.install})


def train_on_ray(run_dir, *extra, args) -> int:
    """`train(run_dir, "cluster.backend=ray", ...)` on a Ray cluster of 2 CPUs started for it (and shut after), one
    torch thread per actor (this process's thread count restored)."""
    import ray

    threads = torch.get_num_threads()
    ray_init(num_cpus=2)
    try:
        return train(run_dir, "cluster.backend=ray", "cluster.timeout_s=120", "threads=1", *extra, args=args)
    finally:
        ray.shutdown()
        torch.set_num_threads(threads)


SUM_AGENT = """
from openai import OpenAI

CLIENT = OpenAI(base_url="http://unused/v1", api_key="none")  # one connection pool for every episode

def run(base_url, task):
    out = CLIENT.with_options(base_url=base_url).completions.create(model="policy", prompt=task["prompt"],
                                                                    max_tokens=8)
    return float(out.choices[0].text.strip() == task["answer"])
"""


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@pytest.fixture(scope="module", autouse=True)
def threads_unchanged(request):
    """Seeded runs are bitwise reproducible only at one thread count: a test file that changes torch's, or the
    environment that subprocesses take theirs from, must put it back, or later files' references drift."""
    before = torch.get_num_threads(), {k: os.environ.get(k) for k in THREAD_ENV}
    yield
    after = torch.get_num_threads(), {k: os.environ.get(k) for k in THREAD_ENV}
    if after != before:
        torch.set_num_threads(before[0])
        for k, v in before[1].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pytest.fail(f"{request.module.__name__} left the thread settings at {after}, found at {before}")


def pytest_addoption(parser):
    parser.addoption("--data-dir", help="folder holding the real datasets (gsm8k/, humaneval/); else $TWINPLANE_DATA. "
                     "The tests on real data skip without either")


def pytest_configure(config):
    if config.getoption("--data-dir"):
        os.environ["TWINPLANE_DATA"] = str(config.getoption("--data-dir"))
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreter_numpy_check()


def interpreter_numpy_check() -> None:
    """Triton's CPU interpreter before 3.7 turns one-element arrays into ints, which numpy 2.4 refuses: every
    interpreted kernel would fail the same way. (torch 2.9's and 2.11's CUDA wheels pin such a Triton.)"""
    from packaging.version import Version
    try:
        import numpy
        import triton
    except ImportError:
        return
    if Version(triton.__version__) < Version("3.7") and Version(numpy.__version__) >= Version("2.4"):
        pytest.exit(f"Triton {triton.__version__}'s CPU interpreter needs numpy < 2.4 (found {numpy.__version__}): "
                    "pip install 'numpy<2.4'", returncode=2)


def data_path(relative: str) -> Path:
    """A file or folder of the real datasets, under --data-dir / $TWINPLANE_DATA (a path that does not exist
    without them, so `.is_file()` decides whether a test runs)."""
    root = os.environ.get("TWINPLANE_DATA")
    return Path(root).resolve() / relative if root else Path("/nonexistent/TWINPLANE_DATA") / relative


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (CUDA or ROCm)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- tiny models -----------------------------------------------------------------------------------------------------

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


def peaked_weights(model: torch.nn.Module, norm_offset: float = 0.0, special=()) -> torch.nn.Module:
    """A transformers model's weights made larger than their init, so greedy decoding has clear winners and every
    weight matters: matrices N(0, 0.15); biases and norm weights N(0, 0.2), plus `norm_offset` where a norm scales by
    its weight rather than by 1 + it. `special`: (name suffix, in-place init) pairs, tried first."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            init = next((f for suffix, f in special if n.endswith(suffix)), None)
            if init is not None:
                init(p)
            elif n.endswith("bias") or "norm" in n:
                p.normal_(0, 0.2).add_(norm_offset if "norm" in n else 0.0)
            elif p.ndim >= 2:
                p.normal_(0, 0.15)
    return model.eval()


def char_hf_folder(path, config, **sizes):
    """A random transformers model of `config(**sizes)` with the demo's character tokenizer's ids, its matrices
    N(0, 0.15), saved with that tokenizer in `path`."""
    import transformers

    from twinplane.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+=")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(
        vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **sizes))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    tok.save(path)
    return path


def hf_reference(path, **kwargs):
    """transformers' own model of a folder, fp32: the reference the native families are tested against."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def token_ids(t: int, batch: int = 3) -> torch.Tensor:
    return torch.randint(4, 64, (batch, t), generator=torch.Generator().manual_seed(1))


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


QWEN25_7B = {  # published Qwen/Qwen2.5-7B config.json shape
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}


# --- the training plane ----------------------------------------------------------------------------------------------

def make_batch(model, seed=0, n=6, tool_masks=False):
    """Random prompts and responses; `tool_masks`: responses are longer and have a middle stretch excluded from
    the loss (a multi-turn tool output the model attends to but is not trained on)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 50, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    hi = 12 if tool_masks else 6
    responses = [torch.randint(4, 50, (int(torch.randint(1, hi, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    loss_masks = None
    if tool_masks:
        loss_masks = [[0 if len(r) > 4 and 2 <= j < len(r) - 2 else 1 for j in range(len(r))] for r in responses]
    batch = Batch.collate(prompts, responses, 0, loss_masks=loss_masks)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch, 1.0)
    batch.rollout_logprobs = (lp + 0.1 * torch.randn(lp.shape, generator=g)) * batch.response_mask
    batch.advantages = torch.randn(n, 1, generator=g) * batch.response_mask
    batch.ref_logprobs = (lp - 0.2 * torch.rand(lp.shape, generator=g)) * batch.response_mask
    return batch


def spawn(fn, args, nprocs, timeout=90.0):
    """Run fn(rank, *args) on nprocs spawned processes; kill them and fail past `timeout` seconds."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"workers still running after {timeout} s")


# --- the rollout engine ----------------------------------------------------------------------------------------------

EOS = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]  # mixed lengths


def assert_multi_turn_logprobs_match_trainer(model, samples, pad_token_id, temperature):
    """The model's tokens of multi-turn samples (loss mask 1) score like the trainer's one forward over the whole
    sequence; tool tokens carry log-prob 0. Returns the batch."""
    from twinplane.train.batch import pad_rows

    batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], pad_token_id,
                          [s.logprobs for s in samples])
    batch.response_mask = pad_rows([s.loss_mask for s in samples], 0, torch.float32)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch, temperature=temperature)
    m = batch.response_mask.bool()
    torch.testing.assert_close(lp[m], batch.rollout_logprobs[m], atol=1e-5, rtol=0)
    return batch


def greedy_no_cache(model, prompt, max_new):
    """Reference decoding: recompute the whole sequence every token, no KV cache, no padding."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            tok = int(model(torch.tensor([ids], device=model.output_weight().device))[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == EOS:
                break
    return out


def assert_same(got, want, atol=1e-5):
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


def on_device(case, device):
    """A case from paged_case or static_case with its tensors on `device` (the device tests' GPU)."""
    q, k, v, paged, *rest = case
    paged = copy.copy(paged)
    for name in ("k_cache", "v_cache", "slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
        setattr(paged, name, getattr(paged, name).to(device))
    return q.to(device), k.to(device), v.to(device), paged, *rest


def paged_case(window=None, bs=8, lockstep=False):
    """Six sequences in a pool of `bs`-token blocks: two decodes (contexts bs - 3 and 2 bs + 3, or both 2 bs + 3
    with `lockstep`), a later prefill chunk of 4 tokens (context bs + 1), then three prompts prefilled whole (3, 3
    and bs + 2 tokens: the fresh run, which attends within the row)."""
    g = torch.Generator().manual_seed(0)
    L, N, Hkv, H, D = 1, 12, 2, 4, 16
    kc, vc = torch.randn(L, N, bs, Hkv, D, generator=g), torch.randn(L, N, bs, Hkv, D, generator=g)
    tables = [[3, 0, 11] if lockstep else [3, 0], [5, 1, 7], [2, 9], [4], [6], [8, 10]]
    ctx, qlens = [2 * bs + 3 if lockstep else bs - 3, 2 * bs + 3, bs + 1, 3, 3, bs + 2], [1, 1, 4, 3, 3, bs + 2]
    slots = []
    for t, c, q in zip(tables, ctx, qlens, strict=True):
        slots += [t[p // bs] * bs + p % bs for p in range(c - q, c)]
    T = sum(qlens)
    q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D,
                                                                                                      generator=g)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    paged = PagedKV(kc, vc, torch.tensor(slots), torch.tensor([t + [0] * (3 - len(t)) for t in tables],
                                                                dtype=torch.int32),
                    torch.tensor(ctx, dtype=torch.int32), cu, qlens, 2, max(ctx))
    assert paged.fresh_start == 3
    return q, k, v, paged, tables, ctx, qlens, window


# --- the platform ----------------------------------------------------------------------------------------------------

def run_paged(case, backend):
    """paged_attention of `case` (from paged_case or static_case) with `backend`, on its own copy of the pool."""
    q, k, v, paged, *_, window = case
    paged = copy.copy(paged)
    paged.k_cache, paged.v_cache = paged.k_cache.clone(), paged.v_cache.clone()
    meta = AttentionMetadata(torch.zeros(1, q.shape[2], dtype=torch.long, device=q.device), window=window,
                             backend=backend, paged=paged)
    return paged_attention(q, k, v, meta, 0), paged


def static_case(bs, window=None):
    """The static decode's inputs: 5 decodes (contexts 1, bs, bs + 3, 3 bs - 1, 2 bs + 1: a lone token, exactly
    full blocks, partly filled last blocks) and 2 padding rows, fixed-width tables padded with the reserved last
    block of the pool; each padding row reads and writes only that block."""
    g = torch.Generator().manual_seed(1)
    L, N, Hkv, H, D, width = 1, 14, 2, 4, 16, 4
    pad = N - 1
    kc, vc = torch.randn(L, N, bs, Hkv, D, generator=g), torch.randn(L, N, bs, Hkv, D, generator=g)
    tables = [[8], [2], [11, 0], [4, 9, 6], [1, 12, 3]] + [[]] * 2
    ctx = [1, bs, bs + 3, 3 * bs - 1, 2 * bs + 1] + [1] * 2
    slots = [(t[(c - 1) // bs] if t else pad) * bs + (c - 1) % bs for t, c in zip(tables, ctx, strict=True)]
    d = len(ctx)
    q, k, v = (torch.randn(1, h, d, D, generator=g) for h in (H, Hkv, Hkv))
    k[:, :, -2:], v[:, :, -2:] = k[:, :, -1:], v[:, :, -1:]  # padding rows write the same k/v to one slot
    paged = PagedKV(kc, vc, torch.tensor(slots), torch.tensor([t + [pad] * (width - len(t)) for t in tables],
                                                                dtype=torch.int32),
                    torch.tensor(ctx, dtype=torch.int32), torch.arange(d + 1, dtype=torch.int32), [1] * d, d,
                    width * bs, static=True)
    return q, k, v, paged, tables, ctx, [1] * d, window


def grouped_batch(model, n=4, seed=0):
    """GRPO-shaped: 3 prompts of different lengths x n samples (rows of a group not all adjacent), one row with
    no response token, and a prompt that is another's prefix (equal tokens, shorter: must not share)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [5, 6, 7]]
    rows = [p for p in prompts for _ in range(n)]
    rows.append(rows.pop(0))  # a group's rows need not be adjacent
    responses = [torch.randint(4, 50, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in rows]
    responses[3] = []
    batch = Batch.collate(rows, responses, 0)
    batch.advantages = torch.randn(len(rows), 1, generator=g) * batch.response_mask
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch, 1.0, share_prompts=False)
    batch.rollout_logprobs = (lp + 0.1 * torch.randn(lp.shape, generator=g)) * batch.response_mask
    batch.ref_logprobs = (lp - 0.2 * torch.rand(lp.shape, generator=g)) * batch.response_mask
    return batch


def simulate_gpu(monkeypatch, name, *, hip=None, count=2, memory=80 * 2**30, cc=(9, 0), arch=None, installed=()):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    props = SimpleNamespace(total_memory=memory, major=cc[0], minor=cc[1], name=name)
    if arch:
        props.gcnArchName = arch
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", None if hip else "12.4")
    monkeypatch.setattr(hardware, "has_module", lambda m: m in installed)


# --- `twinplane train` on tiny settings ------------------------------------------------------------------------------

TINY_RUN = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=5",
            "train.steps=6", "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=12",
            "train.mini_batches=2", "train.micro_batch_size=6", "algo.kl_coef=0.05", "log.progress=false",
            "checkpoint.every=2", "checkpoint.keep=2", "eval.every=3", "eval.n=2"]


def train(run_dir, *extra, fault=None, args=TINY_RUN):
    """`twinplane train` on `run_dir` with `args` then `extra`, optionally with a TWINPLANE_FAULT spec."""
    os.environ.pop("TWINPLANE_FAULT", None)
    if fault:
        os.environ["TWINPLANE_FAULT"] = fault
    try:
        return main(["train", "--run-dir", str(run_dir), *args, *extra])
    finally:
        os.environ.pop("TWINPLANE_FAULT", None)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


NATIVE_RUN = ["warmstart.steps=0", "train.steps=3", "rollout.prompts_per_step=4", "rollout.n=4",
              "rollout.max_new_tokens=4", "task.heldout_size=8", "eval.before=false", "eval.every=0",
              "log.progress=false", "checkpoint.every=0", "train.micro_batch_size=8", "algo.kl_coef=0.05"]


def three_step_run(tmp_path, build, *extra) -> Path:
    """`build(**token ids)` (a transformers model) saved with the demo's character tokenizer and trained 3 GRPO steps
    by `twinplane train`; checks the steps ran with engine and trainer agreeing, returns the run's `final/`."""
    from twinplane.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+=")
    folder = tmp_path / "model"
    build(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
          pad_token_id=tok.pad_token_id).save_pretrained(folder)
    tok.save(folder)
    assert train(tmp_path / "run", f"model.path={folder}", *extra, args=NATIVE_RUN) == 0
    steps = [r for r in rows(tmp_path / "run") if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["actor/logprob_gap"] < 1e-4 for r in steps)
    return tmp_path / "run" / "final"


def computed(row):
    """A metrics row without its measurements (timings, throughput, memory): what a rerun must give exactly."""
    return {k: v for k, v in row.items()
            if not k.startswith(("time/", "perf/", "mem/", "sync/gb_per_s", "rollout/engine_busy_s"))
            and not (k.startswith("async/") and k.endswith("_s"))}


def outcome(run_dir):
    """The final weights' bytes and the computed metrics of every step."""
    return (run_dir / "final" / "model.safetensors").read_bytes(), [computed(r) for r in rows(run_dir)]


def weights(run_dir):
    return load_file(run_dir / "final" / "model.safetensors")


CLUSTER_RUN = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=5",
               "train.steps=2", "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=8",
               "eval.before=false", "log.progress=false", "checkpoint.every=1", "threads=1",
               "train.micro_batch_size=6", "algo.kl_coef=0.05", "cluster.sync_bucket_mb=1", "cluster.timeout_s=300"]
RAY = ["cluster.backend=ray"]


def cluster_train(run_dir, *extra, fault=None, monkeypatch=None):
    """`twinplane train` with CLUSTER_RUN (one CPU thread, as in the 1-CPU Ray actors) then `extra`."""
    if fault:
        monkeypatch.setenv("TWINPLANE_FAULT", fault)
    return main(["train", "--run-dir", str(run_dir), *CLUSTER_RUN, *extra])

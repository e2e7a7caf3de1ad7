"""Platform decisions on simulated CUDA and ROCm builds (torch.cuda monkeypatched on this CPU machine), plus the
real CPU path and `twinplane doctor`."""

import json
import warnings

import pytest
import torch
from conftest import simulate_gpu, tiny_model

from twinplane.config import ConfigError, load_config
from twinplane.errors import InputError
from twinplane.model.layer import DecoderLayer
from twinplane.platform import backends, hardware, runtime
from twinplane.rollout import RolloutEngine, engine_options
from twinplane.tools import doctor


@pytest.fixture(autouse=True)
def fresh():
    hardware.reset()
    yield
    hardware.reset()


def test_rocm_build_mi300x(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    simulate_gpu(monkeypatch, "AMD Instinct MI300X", hip="6.2.41133", count=2, memory=192 * 2**30, cc=(9, 4),
                 arch="gfx942:sramecc+:xnack-", installed=("flash_attn", "flash_attn_interface"))
    info = hardware.detect()
    assert info.vendor == "amd" == hardware.vendor()
    assert (info.hip_version, info.cuda_version, info.device_type) == ("6.2.41133", None, "cuda")
    assert info.device_names == ("AMD Instinct MI300X",) * 2 and info.device_memory == (192 * 2**30,) * 2
    assert info.dist_backend == "nccl" == runtime.dist_backend(info.device)  # RCCL behind the "nccl" name
    assert info.visible_devices_env == ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    assert runtime.visible_devices_env([2, 3], info) == {
        "HIP_VISIBLE_DEVICES": "2,3", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1"}
    assert "CUDA_VISIBLE_DEVICES" not in runtime.visible_devices_env([0], info)
    a = info.attention
    assert a.backend == "sdpa" and "cudnn" not in a.sdpa_kernels
    assert a.flash_attn_eligible and a.fa3_installed and not a.fa3_eligible  # FA3 is Hopper-only, never ROCm
    assert info.peak_flops == pytest.approx(1307.4e12) and info.peak_source == "spec:mi300x"
    assert hardware.mfu(653.7e12, info) == pytest.approx(0.5)


def test_rocm_fa2_not_eligible_on_unsupported_arch(monkeypatch):
    simulate_gpu(monkeypatch, "AMD Instinct MI250X", hip="6.2", arch="gfx1100", installed=("flash_attn",))
    info = hardware.detect()
    assert not info.attention.flash_attn_eligible
    assert info.peak_flops == pytest.approx(383.0e12)


def test_cuda_build_h100(monkeypatch):
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", cc=(9, 0), installed=("flash_attn", "flash_attn_interface"))
    info = hardware.detect()
    assert info.vendor == "nvidia" and info.cuda_version == "12.4" and info.hip_version is None
    assert info.compute_capability == (9, 0) and info.bf16 and info.device_count == 2
    assert info.dist_backend == "nccl"
    assert runtime.visible_devices_env([0, 1], info) == {
        "CUDA_VISIBLE_DEVICES": "0,1", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert info.attention.backend == "sdpa"
    assert info.attention.flash_attn_eligible and info.attention.fa3_eligible
    assert info.peak_flops == pytest.approx(989.4e12)


@pytest.mark.parametrize("name,cc,fa2,tflops", [("NVIDIA A100-SXM4-80GB", (8, 0), True, 312.0),
                                                ("NVIDIA L40S", (8, 9), True, 362.05),
                                                ("NVIDIA H200", (9, 0), True, 989.4),
                                                ("NVIDIA B200", (10, 0), True, 2250.0),
                                                ("Tesla V100-SXM2-16GB", (7, 0), False, None)])
def test_cuda_devices(monkeypatch, name, cc, fa2, tflops):
    simulate_gpu(monkeypatch, name, cc=cc, installed=("flash_attn", "flash_attn_interface"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = hardware.detect()
    assert info.attention.flash_attn_eligible == fa2
    assert info.attention.fa3_eligible == (cc == (9, 0))
    assert info.peak_flops == (pytest.approx(tflops * 1e12) if tflops else None)


def test_unknown_gpu_has_no_peak_and_null_mfu(monkeypatch):
    simulate_gpu(monkeypatch, "AMD Radeon Graphics", hip="6.2")
    with pytest.warns(UserWarning, match="unknown amd device"):
        info = hardware.detect()
    assert info.vendor == "amd" and info.peak_flops is None and info.peak_source == "unknown"
    assert hardware.mfu(1e12, info) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hardware.detect() is info  # cached: warned once


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_cpu_machine():
    info = hardware.detect()
    assert info.vendor == "cpu" and info.device_type == "cpu" and info.device == torch.device("cpu")
    assert info.dist_backend == "gloo" == runtime.dist_backend(info.device)
    assert info.visible_devices_env == () and runtime.visible_devices_env([0], info) == {}
    assert info.attention.backend == "sdpa" and not info.attention.flash_attn_eligible
    assert info.peak_flops > 0 and info.peak_source == "measured:fp32-gemm"
    assert 0 < hardware.mfu(info.peak_flops / 2, info) < 1
    assert hardware.detect() is info


def test_automatic_kv_budget_is_the_same_for_every_call(monkeypatch):
    """A simulated 80 GB GPU with 10 GB of weights: the pool a first generate made and freed sits in torch's cache
    (reserved, not allocated, so not free to the driver); the second call's budget must still count it."""
    GB, mem = 2**30, {"allocated": 10 * 2**30, "reserved": 10 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GB - mem["reserved"], 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: mem["reserved"])
    gpu = torch.device("cuda", 0)
    first = runtime.kv_cache_budget(gpu, 0, 0.9)
    assert first == int(70 * GB * 0.9)
    mem["reserved"] += first  # the first call's pool, freed into the caching allocator
    assert runtime.kv_cache_budget(gpu, 0, 0.9) == first
    mem["allocated"] += first  # or kept by the engine, which counts it as its own
    assert runtime.kv_cache_budget(gpu, 0, 0.9, held=first) == first
    assert runtime.kv_cache_budget(gpu, 5 * GB, 0.9) == 5 * GB  # an explicit budget is taken as given


def test_other_accelerator_degrades_to_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    with pytest.warns(UserWarning, match="xpu"):
        info = hardware.detect()
    assert info.vendor == "unknown" and info.device_type == "cpu" and info.dist_backend == "gloo"


def test_doctor_on_this_machine(capsys):
    d = doctor.report()
    for key in ("torch", "torch_build", "devices", "collectives_version", "attention", "bf16", "ray_installed",
                "gemm_tflops", "copy_bandwidth_gb_s", "twinplane", "python", "peak_tflops", "gemm_mfu"):
        assert key in d
    assert d["attention"]["backend"] == "sdpa" and d["gemm_tflops"] > 0 and d["copy_bandwidth_gb_s"] > 0
    text = doctor.format_report(d)
    assert "sdpa" in text and len(text.splitlines()) < 25 and text.startswith("in short")
    r = d["rollout"]  # what the rollout engine runs here, and why
    if d["device_type"] == "cpu":
        assert (r["kernels"], r["paged_attention"], r["kv_block_size"], r["graphs"]) == ("torch", "sdpa", 16, "eager")
    assert r["kernels_why"] in text and r["paged_attention_why"] in text and r["graphs_why"] in text
    if d["device_type"] == "cpu":  # the training plane's auto choices here
        assert d["training"] == {"compile": False, "logprob_chunk_tokens": 512, "logprob_kernels": "torch",
                                 "packed_attention": "sdpa"}
        assert "training  decoder layers eager (train.compile=auto), log-prob chunks of 512 tokens" in text
    cpu = {**d, "visible_devices_env": [], "ray_noset_env": []}
    gpu = {**d, "visible_devices_env": ["CUDA_VISIBLE_DEVICES"],
           "ray_noset_env": ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]}
    assert "env       no device-selection variables: no GPU, so workers are not pinned to devices" in \
        doctor.format_report(cpu).splitlines()
    assert ("env       CUDA_VISIBLE_DEVICES select each worker's devices "
            "(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 keeps Ray from overwriting them)") in \
        doctor.format_report(gpu).splitlines()
    if d["device_type"] == "cpu":  # the peak is the best GEMM seen, this run's included: never above 100%
        assert 0 < d["gemm_mfu"] <= 1.0
    assert d["sandbox"]["backend"] in ("bwrap", None) and "sandbox" in text  # which backend can run code here
    if d["device_type"] == "cpu":  # fp32 weights + 2 fp32 moments, one training rank
        assert d["checkpoint"] == {"bytes_per_param": 12, "ranks": 1, "gb_per_billion_params_per_rank": 12.0}
        assert "checkpoint 12 bytes/param (weights + AdamW moments): 12.0 GB per 1B params per rank" in text
    assert doctor.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_type"] == hardware.detect().device_type


@pytest.mark.parametrize(("hip", "noset", "want"), [
    (None, {}, 0),  # NVIDIA, Ray restricted CUDA_VISIBLE_DEVICES to the actor's GPU: it is cuda:0
    (None, {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, 5),  # every GPU visible: Ray's id is the index
    ("6.2", {}, 0),  # AMD, Ray set ROCR/HIP visibility
    ("6.2", {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}, 5),
    ("6.2", {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, 0),  # the other vendor's switch changes nothing
])
def test_ray_worker_device_both_vendors(monkeypatch, hip, noset, want):
    simulate_gpu(monkeypatch, "AMD Instinct MI300X" if hip else "NVIDIA H100 80GB HBM3", hip=hip, count=8)
    for k in ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
              "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in noset.items():
        monkeypatch.setenv(k, v)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    dev = runtime.worker_device("auto", [5])
    assert dev == torch.device("cuda", want) and chosen == [dev]
    assert runtime.worker_device("cpu", [5]) == torch.device("cpu")


@pytest.mark.parametrize("hip", [None, "6.2.41133"])
def test_decode_graphs_on_cuda_and_rocm_builds(monkeypatch, hip):
    """HIP graphs answer to the same torch.cuda.CUDAGraph API, so both vendors capture; off when not requested."""
    simulate_gpu(monkeypatch, "AMD Instinct MI300X" if hip else "NVIDIA H100 80GB HBM3", hip=hip,
                 arch="gfx942:sramecc+:xnack-" if hip else None)
    assert backends.decode_graph_backend(torch.device("cuda")) == "cuda_graph"
    assert backends.decode_graph_backend(torch.device("cuda", 1), requested=True) == "cuda_graph"
    assert backends.decode_graph_backend(torch.device("cuda"), requested=False) == "eager"
    assert backends.decode_graph_backend(torch.device("cpu")) == "eager"  # an engine placed on the host


def test_decode_graphs_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.decode_graph_backend(torch.device("cpu")) == "eager"
    assert backends.decode_graph_backend(torch.device("cpu"), requested=True) == "eager"


# --- the rollout engine's paged attention backend ------------------------------------------------------------------

@pytest.fixture
def probe(monkeypatch):
    """The flex self-check, recorded and passing (its real run needs the GPU these tests simulate)."""
    monkeypatch.delenv("TWINPLANE_PAGED_BACKEND", raising=False)

    def check(dev, dtype, block_size):
        check.calls.append((dev, dtype, block_size))
        return True

    check.calls = []
    return check


@pytest.mark.parametrize("hip", [None, "6.2.41133"])
def test_paged_backend_is_flex_on_a_gpu_without_flash_attn(monkeypatch, probe, hip):
    simulate_gpu(monkeypatch, "AMD Instinct MI300X" if hip else "NVIDIA H100 80GB HBM3", hip=hip,
                 arch="gfx942:sramecc+:xnack-" if hip else None)  # flash_attn not installed
    gpu = torch.device("cuda")
    assert backends.paged_attention_backend(gpu, torch.bfloat16, flex_check=probe) == ("flex", 128)
    assert backends.FLEX_PAGE_SIZE == 128
    assert backends.paged_attention_backend(gpu, torch.bfloat16, flex_check=probe) == ("flex", 128)
    assert probe.calls == [(gpu, torch.bfloat16, 128)]  # checked once per device and dtype, at flex's block size
    assert backends.paged_attention_backend(torch.device("cpu"), flex_check=probe) == ("sdpa", 16)
    # compiled flex refuses head dims below 16 (seen on an H200): the portable path serves them, unchecked
    assert backends.paged_attention_backend(gpu, torch.bfloat16, head_dim=8, flex_check=probe) == ("sdpa", 16)
    assert probe.calls == [(gpu, torch.bfloat16, 128)]


def test_paged_backend_is_flash_where_flash_attn_is_eligible(monkeypatch, probe):
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", installed=("flash_attn",))
    assert backends.paged_attention_backend(torch.device("cuda"), torch.bfloat16, flex_check=probe) == ("flash", 256)
    assert probe.calls == []
    # flash-attn runs 16-bit only: an fp32 engine takes flex (after its check)
    assert backends.paged_attention_backend(torch.device("cuda"), torch.float32, flex_check=probe) == ("flex", 128)
    assert len(probe.calls) == 1


@pytest.mark.parametrize("failure", ["raises", "disagrees"])
def test_paged_backend_falls_back_to_sdpa_when_flex_fails_its_self_check(monkeypatch, probe, failure):
    simulate_gpu(monkeypatch, "NVIDIA L40S", cc=(8, 9))

    def failing(dev, dtype, block_size):
        if failure == "raises":
            raise RuntimeError("no valid triton config for this GPU\n(the rest of inductor's message)")
        return False

    why = "no valid triton config for this GPU" if failure == "raises" else "it disagreed with the portable path"
    with pytest.warns(UserWarning, match=f"FlexAttention failed its self-check on cuda \\({why}\\)"):
        assert backends.paged_attention_backend(torch.device("cuda"), torch.float16, flex_check=failing) == ("sdpa", 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; the answer is kept per device and dtype
        assert backends.paged_attention_backend(torch.device("cuda"), torch.float16, flex_check=probe) == ("sdpa", 16)
    assert probe.calls == []


def test_flex_self_check_runs_here_and_catches_a_wrong_kernel(monkeypatch):
    """The real self-check, on CPU (eager flex): it passes, and fails when flex's output is off."""
    from twinplane.rollout import paged_attention

    cpu = torch.device("cpu")
    assert paged_attention.flex_decode_agrees(cpu, torch.float32, 16)
    real = paged_attention._flex_decodes
    monkeypatch.setattr(paged_attention, "_flex_decodes", lambda *a: real(*a) + 1e-2)
    assert not paged_attention.flex_decode_agrees(cpu, torch.float32, 16)
    with pytest.warns(UserWarning, match="disagreed"):
        assert not backends.flex_paged_ok(cpu, torch.float32, paged_attention.flex_decode_agrees)


def test_paged_backend_environment_override(monkeypatch, probe):
    monkeypatch.setenv("TWINPLANE_PAGED_BACKEND", "flex")
    assert backends.paged_attention_backend(torch.device("cpu"), flex_check=probe) == ("flex", 128)
    monkeypatch.setenv("TWINPLANE_PAGED_BACKEND", "triton")
    assert backends.paged_attention_backend(torch.device("cpu"), flex_check=probe) == ("triton", 16)
    monkeypatch.setenv("TWINPLANE_PAGED_BACKEND", "flex")
    monkeypatch.setenv("TWINPLANE_PAGED_BACKEND", "sdpa")
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", installed=("flash_attn",))
    assert backends.paged_attention_backend(torch.device("cuda"), flex_check=probe) == ("sdpa", 16)
    monkeypatch.setenv("TWINPLANE_PAGED_BACKEND", "fast")
    with pytest.raises(ValueError, match="TWINPLANE_PAGED_BACKEND"):
        backends.paged_attention_backend(torch.device("cpu"), flex_check=probe)
    assert probe.calls == []  # forced: unchecked (flex on CPU runs torch's eager reference)


def test_rollout_dtype_is_bf16_on_gpus_unless_set():
    from types import SimpleNamespace as NS

    assert runtime.rollout_dtype(NS(dtype="float32", rollout_dtype=None), "cuda") == torch.bfloat16
    assert runtime.rollout_dtype(NS(dtype="float32", rollout_dtype=None), "cpu") == torch.float32
    assert runtime.rollout_dtype(NS(dtype="float16", rollout_dtype=None), "cuda") == torch.float16
    assert runtime.rollout_dtype(NS(dtype="float32", rollout_dtype="float32"), "cuda") == torch.float32
    assert runtime.rollout_dtype(NS(dtype="bfloat16", rollout_dtype="float16"), "cpu") == torch.float16


# --- the rollout engine's kernels (twinplane.rollout.kernels) -------------------------------------------------------

@pytest.fixture
def kernel_checks():
    """The Triton self-check, recorded; it passes unless a test sets `check.result`."""

    def check(dev, dtype):
        check.calls.append((dev, dtype))
        if isinstance(check.result, Exception):
            raise check.result
        return check.result

    check.calls, check.result = [], None
    return check


def test_kernels_on_cpu_are_torch_unless_triton_is_asked_for_and_interpreted(monkeypatch, kernel_checks):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert backends.rollout_kernels(cpu, check=kernel_checks)[0] == "torch"  # auto: the model's own code
    assert backends.rollout_kernels(cpu, requested="torch", check=kernel_checks) == ("torch", "rollout.kernels=torch")
    with pytest.raises(InputError, match="rollout.kernels=triton: the engine runs on cpu, and Triton kernels need"):
        backends.rollout_kernels(cpu, requested="triton", check=kernel_checks)
    with pytest.raises(InputError, match="rollout.kernels must be one of auto, triton, torch, got 'cuda'"):
        backends.rollout_kernels(cpu, requested="cuda", check=kernel_checks)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.rollout_kernels(cpu, check=kernel_checks)[0] == "torch"  # auto never picks the interpreter
    if hardware.has_module("triton"):
        assert backends.rollout_kernels(cpu, requested="triton", check=kernel_checks)[0] == "triton"
    assert kernel_checks.calls == []
    engine = RolloutEngine(tiny_model(), 3)
    assert engine.kernels == "torch" and type(engine.model.model.layers[0]) is DecoderLayer  # nothing swapped


@pytest.mark.parametrize("hip", [None, "6.2.41133"])
def test_auto_kernels_on_a_gpu_are_triton_once_their_self_check_passed(monkeypatch, probe, kernel_checks, hip):
    simulate_gpu(monkeypatch, "AMD Instinct MI300X" if hip else "NVIDIA H200", hip=hip,
                 arch="gfx942:sramecc+:xnack-" if hip else None, installed=("triton",))
    gpu = torch.device("cuda")
    kernels_, why = backends.rollout_kernels(gpu, torch.bfloat16, check=kernel_checks)
    assert kernels_ == "triton" and "passed its self-check" in why
    assert backends.rollout_kernels(gpu, torch.bfloat16, check=kernel_checks)[0] == "triton"
    assert kernel_checks.calls == [(gpu, torch.bfloat16)]  # once per device and dtype
    assert backends.paged_attention_backend(gpu, torch.bfloat16, kernels="triton", flex_check=probe) == ("triton", 16)
    assert probe.calls == []  # flex is not checked where Triton serves the decodes
    assert backends.paged_attention_backend(gpu, torch.bfloat16, flex_check=probe) == ("flex", 128)  # torch kernels


def test_auto_kernels_on_a_gpu_fall_back_to_torch(monkeypatch, probe, kernel_checks):
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", installed=("flash_attn",))  # no triton package
    gpu = torch.device("cuda")
    assert backends.rollout_kernels(gpu, torch.bfloat16, check=kernel_checks) == \
        ("torch", "auto: the triton package is not installed")
    simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", installed=("flash_attn", "triton"))
    assert backends.paged_attention_backend(gpu, torch.bfloat16, kernels="triton", flex_check=probe) == \
        ("flash", 256)  # flash first
    for result, why in ((RuntimeError("PassManager::run failed\n(the rest)"), "PassManager::run failed"),
                        ("SiLU * up", "SiLU \\* up")):
        hardware.reset()
        kernel_checks.result = result
        with pytest.warns(UserWarning, match=f"Triton kernels failed their self-check on cuda \\({why}\\)"):
            assert backends.rollout_kernels(gpu, torch.float16, check=kernel_checks)[0] == "torch"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert backends.rollout_kernels(gpu, torch.float16, check=kernel_checks)[0] == "torch"  # warned once


def test_kernels_config_key_and_engine_option(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert engine_options(load_config(None, ["rollout.kernels=torch"]).rollout)["kernels"] == "torch"
    assert load_config(None, []).rollout.kernels == "auto"
    with pytest.raises(ConfigError, match="rollout.kernels: must be auto, triton or torch"):
        load_config(None, ["rollout.kernels=cuda"])
    with pytest.raises(InputError, match="rollout.kernels=triton"):
        RolloutEngine(tiny_model(), 3, kernels="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_to_device_copies_a_host_tensor_asynchronously_and_keeps_its_values():
    """`to_device` goes through pinned memory with an asynchronous copy: the device tensor holds the host tensor's
    values even when the host tensor changes right after the call (the pinned buffer is a copy of its own)."""
    for x in (torch.arange(1 << 20), torch.arange(1 << 20).pin_memory()):  # (a pinned one is copied too)
        y = runtime.to_device(x, torch.device("cuda"))
        x.zero_()
        assert y.device.type == "cuda" and torch.equal(y.cpu(), torch.arange(1 << 20))
        assert runtime.to_device(x, torch.device("cpu")) is x


def test_measuring_the_gemm_rate_leaves_the_seeded_stream_alone():
    """The CPU's FLOP/s is measured once per process, whenever first asked for: a run seeded before it must
    draw as one seeded after it (dropout, sampling), or two runs in one process would differ."""
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    assert hardware.measure_gemm_flops("cpu", torch.float32, 64, 1) > 0
    assert torch.equal(torch.rand(4), want)

"""One prepared probe of the rollout engine and the training plane on a GPU (or, with --smoke, a tiny CPU run).

    python benchmarks/gpu_probe.py OUT_DIR                  # on a GPU: ~8 minutes, stops new sections at --deadline
    python benchmarks/gpu_probe.py OUT_DIR --smoke          # tiny shapes on CPU (the test suite runs this)

Each section is written to OUT_DIR/probe.json as soon as it ends (and its lines to OUT_DIR/probe.log), so a run cut
off by a time limit still reports what it measured; a section that raises records its error and the next one runs.
Sections, in order: what the goals are judged by first (the engine's calls and a full-batch decode step against the
memory roofline, the compiled training step's MFU), then what explains them, and last HF `generate`, whose rate on
this work is known already (a section starts only while the time it needs is left before --deadline):

- env: torch / Triton / CUDA or HIP versions, the device, and what `twinplane.platform` chose (rollout kernels,
  paged attention backend and block size, decode graph mode, training precision, compile, log-prob kernels,
  distributed backend).
- copy: device-to-device copy bandwidth (bytes read + written per second) and one tiny kernel's cost, launched
  eagerly and replayed from a graph: the floor under a step of a thousand small kernels.
- engine: one RL-shaped `generate` (64 prompts x 8 samples, 256-token prompts, up to 1,024 new tokens, 1/256 of
  the vocabulary as stop ids): tokens/s, graph captures, Dynamo frames compiled during the call, and where the
  step time went; later calls of the same shape (the engine's graphs kept), alternately running ahead (the
  default) and reading every step back before launching the next (`run_ahead` off), each with its steps against
  the roofline and the host's time blocked on the device; the engine's own graphs of 256+ rows replayed back to
  back over filled rows (its pool and table width, without its host loop); where a smaller call's host waits for
  the device (call sites, from CUDA's sync debug mode).
- decode: one static decode step (the engine's `DecodeGraphs`: forward, its sampler, row update) per batch size at a
  fixed context, Qwen2.5-0.5B shape in bf16: capture seconds, replay ms, and the memory roofline (every weight and
  every context token's k/v read once, at the measured copy bandwidth); kernels per step from the profiler.
- train_compiled: `Trainer.train_step` on a Qwen2.5-1.5B shape (random weights, fp32 master, bf16 compute) over
  packed micro-batches of an RL-like length mix, decoder layers compiled (`train.compile=on`), in a child process
  cut after --child-limit seconds, with a fresh Inductor cache: tokens/s, MFU against the device's dense bf16
  peak, peak memory, the caching allocator's device allocations, the profiler's per-category time, device-busy
  time and top operators, where a step's host waits for the device, and the CPU over the timed steps (this
  process's CPU seconds per second, the machine's busy fraction, child processes alive: compile workers
  competing with a host-bound launch loop would show); train_compiled_warm: the same in a new
  process that finds the cache filled (a restarted run); train_compiled_warm_no_aot_cache: that with
  AOTAutograd's cache off; train_compiled_warm_no_graph_cache: with Inductor's graph cache off too (graphs compiled
  anew, their Triton binaries found in the cache); train_compiled_triton_launcher and
  train_compiled_warm_triton_launcher: the cold and the warm run with Triton's kernel launcher instead of Inductor's
  static one.
- train_ranks (right after the first compiled run; 2+ GPUs, or gloo ranks on CPU with --smoke): that step under
  FSDP2 on 1 and on 2 ranks, one process per GPU, each rank its rows of the same batch: tokens/s, MFU per device,
  the scaling, and the first step's metrics on 2 ranks against 1.
- profile: the profiler's top kernels and per-category device time of one decode step at batch 128, and the
  operators (with their input shapes) that launched them.
- kernels: each Triton kernel against its torch reference at the decode shapes (batches 8, 128 and 512 at the
  decode context; the sampler over the vocabulary): device microseconds per call from a CUDA graph of 20 calls,
  the paged decode's KV read rate and its time per split count and per tile (tokens per tile x warps), the
  sampler's per load width x warps, and one layer's paged attention (pool write included) per backend.
- host: the engine's host work per decode step (reading back, stop checks, scheduling, staging) at batches 64, 256
  and 512 on this machine's CPU (`benchmarks/engine_host.py`), against which running ahead must hide it.
- train_fit: the largest packed micro-batch one step fits, with chunked log-probs and with the whole logits.
- train: the compiled training section's step eager (`train.compile=off`).
- attention: one layer's packed attention at the training shape, forward and forward + backward, per varlen
  backend (portable SDPA, FlexAttention, torch's varlen_attn, flash-attn where installed), over a micro-batch of
  RL-like rows with and without shared prompts: ms and TFLOP/s, and the backend the platform picks.
- sampling: the engine's sampler alone (policy log-probs, inverse-CDF choice, chosen log-prob, one readback) on
  [B, V] logits.
- decode_sdpa, decode_torch, decode_triton: the decode section at every other batch size with the portable paged
  attention and torch kernels, with torch kernels and the platform's attention (flex on GPUs without flash-attn),
  and with the Triton kernels (`rollout.kernels=triton`, twinplane.rollout.kernels) and their paged attention.
- engine_hf: Hugging Face `generate` on the engine section's work and weights, and the engine's rate over it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # + the checkout

import torch  # noqa: E402
from probe.decode import decode_other_backend, decode_section, profile_section, sampling_section  # noqa: E402
from probe.engine import engine_hf_section, engine_section, host_section  # noqa: E402
from probe.kernels import kernels_section  # noqa: E402
from probe.machine import copy_section, env  # noqa: E402
from probe.ranks import train_ranks_section  # noqa: E402
from probe.report import Probe  # noqa: E402
from probe.train import attention_section, train_fit_section, train_section  # noqa: E402

# The compiled training step, each in a child process with Inductor's caches in --inductor-cache: the first run
# (a fresh folder: everything compiled), then runs that find what it left (as a restarted run does), with
# Inductor's defaults, with AOTAutograd's cache off (graphs from Inductor's cache, AOTAutograd's wrappers built
# anew), and with both graph caches off (graphs compiled anew, their Triton binaries found in Triton's cache); then
# the same pair, compiled and found, with Triton's own kernel launcher instead of Inductor's static one (a setting
# in the cache key: the first of them compiles).
COMPILED = {"train_compiled": {}, "train_compiled_warm": {},
            "train_compiled_warm_no_aot_cache": {"TORCHINDUCTOR_AUTOGRAD_CACHE": "0"},
            "train_compiled_warm_no_graph_cache": {"TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
                                                   "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"},
            "train_compiled_triton_launcher": {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "0"},
            "train_compiled_warm_triton_launcher": {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "0"}}


def isolated(a, name: str) -> dict:
    """Section `name` (one of COMPILED) in a child process that is killed after `--child-limit` seconds, or
    `--grace` seconds past the deadline if that comes first (a compile can run for minutes in native code, where
    nothing in this process could interrupt it; the sections after it still get their time)."""
    out = a.out / name
    cmd = [sys.executable, __file__, str(out), "--sections", name, "--deadline", "1e9", "--in-child",
           *(["--smoke"] if a.smoke else [])]
    state = {"env": COMPILED[name]}
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(a.inductor_cache)} | COMPILED[name]
    cut = False
    try:
        subprocess.run(cmd, timeout=max(min(a.until - time.perf_counter(), a.child_limit), 1.0), check=False,
                       env=env)
    except subprocess.TimeoutExpired:  # (the section may have ended, the child still exiting: compile workers)
        cut = True
    done = json.loads((out / "probe.json").read_text()) if (out / "probe.json").exists() else {}
    if name in done:
        return state | cache_state(done[name])
    log = (out / "probe.log").read_text()[-2000:] if (out / "probe.log").exists() else ""
    return state | {"error": "cut at its time limit" if cut else "ended without a result", "log_tail": log}


def cache_state(res: dict) -> dict:
    """`res` with "inductor_cache": what its first step found in Inductor's graph cache, by the counters: "warm"
    (hits only), "cold" (misses only), "mixed", or "unused" (neither: the cache was off)."""
    counts = res.get("compile_counters_first_step", {})
    hits, misses = counts.get("inductor/fxgraph_cache_hit", 0), counts.get("inductor/fxgraph_cache_miss", 0)
    found = "mixed" if hits and misses else "warm" if hits else "cold" if misses else "unused"
    return {"inductor_cache": found} | res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="folder for probe.json and probe.log")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU test)")
    p.add_argument("--deadline", type=float, default=400.0, help="seconds after which no new section starts")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds past the deadline before the compiled training section is cut")
    p.add_argument("--child-limit", type=float, default=240.0,
                   help="seconds the compiled training section (a child process) may take at most")
    p.add_argument("--inductor-cache", default="",
                   help="Inductor's cache folder for the compiled training sections (default: a fresh one, removed "
                   "at the end; name one to keep it for a later call's warm sections)")
    p.add_argument("--sections", default="", help="comma-separated section names (default: all, in the order above)")
    p.add_argument("--commit", default="", help="the commit measured (recorded in env)")
    p.add_argument("--in-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    gpu = torch.cuda.is_available() and not a.smoke
    if not gpu:  # the Triton sections on CPU: Triton's interpreter (set before any kernel is defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device, dtype = torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32
    a.decode_shape, a.train_shape = ("qwen2.5-0.5b", "qwen2.5-1.5b") if gpu else ("tiny", "tiny")
    a.batches = [1, 8, 32, 128, 256, 512] if gpu else [1, 3, 8]
    a.context, a.reps, a.engine_pairs = (640, 20, 2) if gpu else (40, 2, 1)
    a.host_batches, a.host_tokens = ([64, 256, 512], 128) if gpu else ([8], 8)
    a.kernel_batches, a.split_sweep = ([8, 128, 512], [1, 2, 4, 8, 16]) if gpu else ([3], [1, 2])
    a.tile_sweep = list(itertools.product((16, 32, 64, 128), (2, 4, 8))) if gpu else [(16, 4), (32, 4)]
    a.sampler_sweep = list(itertools.product((1024, 2048, 4096), (4, 8, 16))) if gpu else [(256, 4)]
    a.fit_cap = 262144 if gpu else 64  # the largest micro-batch train_fit tries
    a.train_rows, a.train_prompt, a.train_response, a.train_tokens, a.train_steps = \
        (64, 512, 400, 16384, 3) if gpu else (4, 16, 8, 64, 1)
    probe = Probe(a.out, a.deadline)
    a.partial = probe.partial
    a.until = probe.t0 + a.deadline + a.grace
    probe.say(f"gpu_probe: device {device}, dtype {dtype}, deadline {a.deadline:.0f} s, "
              f"sections {a.sections or 'all'}")
    want = set(a.sections.split(",")) if a.sections else None

    def wanted(name: str) -> bool:
        return want is None or name in want

    bw = 1e12
    if wanted("env"):
        probe.section("env", env, device, dtype)
        probe.result["env"]["commit"] = a.commit
    if wanted("copy") or gpu:  # (0.1 s; the rooflines need the measured bandwidth)
        res = probe.section("copy", copy_section, device)
        bw = (res or {}).get("copy_bandwidth_bytes_per_s", bw)
    # the goals' measurements first (the engine's calls and a full-batch step against the roofline, the compiled
    # training step's MFU), then what explains them; HF generate, whose rate is known, last
    fresh = None if a.inductor_cache or a.in_child else tempfile.TemporaryDirectory(prefix="probe-inductor-",
                                                                                    ignore_cleanup_errors=True)
    a.inductor_cache = a.inductor_cache or (fresh.name if fresh else "")
    compiled = [(name, *((train_section, (a, device, True)) if a.in_child else (isolated, (a, name))),
                 45 if "warm" in name else 90) for name in COMPILED]
    for name, fn, args, need in (("engine", engine_section, (a, device, dtype, bw), 40),
                                 ("decode", decode_section, (a, device, dtype, bw), 30),
                                 *compiled[:1],
                                 ("train_ranks", train_ranks_section, (a, device), 90),
                                 *compiled[1:],
                                 ("profile", profile_section, (a, device, dtype), 20),
                                 ("kernels", kernels_section, (a, device, dtype), 30),
                                 ("host", host_section, (a,), 20),
                                 ("train_fit", train_fit_section, (a, device), 60),
                                 ("train", train_section, (a, device, False), 40),
                                 ("attention", attention_section, (a, device), 30),
                                 ("sampling", sampling_section, (a, device, dtype), 10),
                                 ("decode_sdpa", decode_other_backend, (a, device, dtype, bw, "sdpa", "torch"), 20),
                                 ("decode_torch", decode_other_backend, (a, device, dtype, bw, None, "torch"), 40),
                                 ("decode_triton", decode_other_backend, (a, device, dtype, bw, "triton", "triton"),
                                  20),
                                 ("engine_hf", engine_hf_section, (a, device, dtype), 90)):
        if wanted(name):
            probe.section(name, fn, *args, need=0 if a.smoke else need)
            if gpu:  # what the section held goes back before the next one
                torch.cuda.empty_cache()
    if fresh:
        fresh.cleanup()
    probe.say(f"gpu_probe: done in {time.perf_counter() - probe.t0:.0f} s")


if __name__ == "__main__":
    main()

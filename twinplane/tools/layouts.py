"""The planner's estimate: how long a step takes on a layout (colocated or split, FSDP degree, engines and
their TP), what it costs, which layouts fit in memory, and which one to recommend. Every layout is also put to
`train`'s own config validation (`TrainCheck`), so that only layouts `train` accepts are ranked.

Everything here is an estimate from the model's shape and the datasheet numbers in `twinplane.platform.devices`;
memory comes from `twinplane.model.memory`, the model `train`'s memory gate reads too:
- dtypes: on a GPU, bf16 params/grads/compute with fp32 master weights and fp32 AdamW moments (16 bytes per
  parameter before sharding); on the CPU, fp32 everything and no master copy (16 bytes per parameter too:
  weights 4 + grads 4 + two moments 8);
- training: parameters, grads and optimizer states are divided by the FSDP degree (fully sharded, ZeRO-3);
  activations are those of one micro-batch (see `activation_bytes_per_token_layer`); gradient-accumulation
  micro-batches run one after another, so grads are live while a micro-batch's activations are;
- rollout: weights / TP + KV cache (and a hybrid's recurrent states) of the sequences in flight / TP + a workspace
  (logits and the prefill's transient activations); no paging, fragmentation or CUDA-graph memory beyond the headroom;
- throughput: decode is memory-bandwidth bound, training runs at an assumed MFU; collectives inside FSDP are
  assumed overlapped with compute; the reference / old-log-prob forward passes are ignored.
- LoRA (`--lora RANK`, adapters on every attention and MLP linear): the base is frozen in bf16 (2 bytes per
  parameter, no grads, master copy or moments), the adapters carry the 16 bytes per parameter of fp32 weights,
  grads and moments; activations add the fp32 copy of each adapted layer's input; the backward skips the base's
  weight gradients (training FLOPs x 2/3); the sync moves only the fp32 adapters; there is no reference copy
  (the reference is the base with the adapters off). Without LoRA, a KL term's reference copy counts when the
  run's config (--config, --run-dir) has one.
Ignored everywhere: framework/runtime context (CUDA context, NCCL buffers, ~1-3 GB per GPU, covered by the
headroom), allocator fragmentation, pipeline parallelism. Sequences are packed (`train.packing`, the default), so
a micro-batch holds micro_batch_size x seq_len real tokens and no padding; the LM head's log-probs run in chunks of
`logprob_chunk_tokens` (`twinplane.train.chunked_logprobs`), so the logits term is bounded by chunk x vocab.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, replace

from twinplane.config import ConfigError, load_config
from twinplane.model import ModelConfig
from twinplane.model.flops import (
    decode_read_params,
    forward_flops_per_token,
    matmul_params,
    train_flops,
)
from twinplane.model.memory import (
    Dtypes,
    Workload,
    kv_bytes_per_token,
    lora_params,
    rollout_memory,
    state_bytes_per_sequence,
    training_memory,
)
from twinplane.platform import devices

GB = 1e9
HEADROOM = 0.10  # fraction of device memory left free by every layout
# model-FLOPs utilisation of the training plane on one H200 (Qwen2.5-1.5B shape, 16k-token packed micro-batches; the
# LM head counted for the response tokens only, as `train_seconds` counts it; benchmarks/RESULTS.md): 51% with the
# decoder layers compiled in a fresh process, 34-35% eager and compiled in a process that found Inductor's cache
# warm (a restarted run); the planner assumes the latter
MFU = 0.34
DECODE_EFFICIENCY = 0.6  # fraction of peak HBM bandwidth a decode step achieves
PREFILL_MFU = 0.4
LINK_GB_S = 50.0  # per-GPU bandwidth of weight sync (trainer -> engines), GB/s; intra-node xGMI/NVLink is higher
HOST_LINK_GB_S = 25.0  # PCIe, for optimizer offload
ALLREDUCE_LATENCY_S = 25e-6  # per TP all-reduce in a decode step (2 per layer)
TP_EFFICIENCY = 0.8  # bandwidth efficiency lost to TP communication, per TP>1 engine
TP_SIZES = (1, 2, 4, 8)
CPU = devices.DeviceSpec("cpu", "cpu", 1.0, 24, 0.05, ())  # the CPU check: memory numbers only


def human_bytes(nbytes: float) -> str:
    """Bytes in a unit that fits: MB below a GB, else GB."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes < GB else f"{nbytes / GB:.1f} GB"


@dataclass(frozen=True)
class Cluster:
    device: devices.DeviceSpec
    gpus: int  # per node
    nodes: int = 1
    price_per_gpu_hour: float = 0.0
    overlap: bool = False  # disaggregated planes overlap one step off-policy (cluster.max_staleness=1), or alternate

    @property
    def total(self) -> int:
        return self.gpus * self.nodes


@dataclass(frozen=True)
class Layout:
    colocated: bool
    train_gpus: int  # = FSDP degree
    rollout_gpus: int
    tp: int
    checkpointing: bool
    offload: bool
    train_mem: float  # bytes per device, peak of the training phase
    rollout_mem: float  # bytes per device, peak of the rollout phase
    seqs_in_flight: int  # per engine, as many as memory allows up to the step's share
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    resharding_bytes: float
    cost_per_m_tokens: float
    refused: str = ""  # why `train` cannot run this layout ("" = it can)

    @property
    def dp(self) -> int:
        return self.rollout_gpus // self.tp

    def settings(self) -> dict[str, str | int | bool]:
        """The config keys this layout sets; one device runs best in one process (cluster.backend=local: Ray
        would only add calls and copies)."""
        memory = {"train.activation_checkpointing": self.checkpointing, "train.optimizer_offload": self.offload}
        if self.colocated and self.train_gpus == 1:
            return {"cluster.backend": "local", **memory}
        return {"cluster.backend": "ray", "cluster.train_devices": self.train_gpus,
                "cluster.rollout_devices": self.rollout_gpus, "cluster.colocate": self.colocated, **memory}

    def overrides(self) -> str:
        """`settings` as `twinplane train` overrides."""
        return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings().items())


@dataclass(frozen=True)
class TrainCheck:
    """What `twinplane train` says to a layout: its settings on top of a run's config file (or the defaults) and
    `overrides` (the step's shape), through the trainer's own config validation."""

    config: str | None = None
    overrides: tuple[str, ...] = ()
    saved: bool = False  # `config` is a run's own config.yaml

    def refusal(self, layout: Layout) -> str:
        """`train`'s one-line error for this layout, or "" when it accepts it (TP > 1: no engine of `train`'s
        splits the model, so no setting of it runs one)."""
        base = _base_config(self.config, self.overrides, self.saved)
        if isinstance(base, str):
            return base
        if layout.tp > 1:
            return f"{NO_TP}, got TP={layout.tp}"
        cfg = copy.deepcopy(base)
        for key, value in layout.settings().items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)
        try:
            cfg.validate()
        except ConfigError as e:
            return str(e)
        return ""

    @classmethod
    def for_workload(cls, w: Workload, config: str | None = None, extra: tuple[str, ...] = (),
                     saved: bool = False) -> TrainCheck:
        shape = (f"rollout.prompts_per_step={w.prompts_per_step}", f"rollout.n={w.n}",
                 f"rollout.max_new_tokens={w.response_len}", f"train.micro_batch_size={w.micro_batch_size}",
                 f"train.logprob_chunk_tokens={w.logprob_chunk_tokens}", f"train.lora.rank={w.lora_rank}")
        return cls(config, (*extra, *shape), saved)


NO_TP = "TP>1: tensor-parallel engines are not in this version (each engine holds the whole model)"


@functools.lru_cache(maxsize=64)  # (parsing overrides is slow; every layout of a plan starts from the same base)
def _base_config(config: str | None, overrides: tuple[str, ...], saved: bool = False):
    """The run's config with the step's shape, or `train`'s error for it (then every layout is refused with it)."""
    try:
        return load_config(config, overrides, saved=saved)
    except ConfigError as e:
        return str(e)


# ---- throughput and cost ------------------------------------------------------------------------------------


def tp_sizes(cfg: ModelConfig, gpus_per_node: int) -> list[int]:
    """TP degrees that split the attention heads evenly (KV heads split or replicate) within one node."""
    return [t for t in TP_SIZES if t <= gpus_per_node and cfg.num_heads % t == 0
            and (cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0)]


def rollout_seconds(cfg: ModelConfig, device: devices.DeviceSpec, w: Workload, engines: int, tp: int,
                    in_flight: int) -> float:
    """Time to generate the step's samples on `engines` engines of TP `tp`, each decoding `in_flight` sequences
    at a time. A decode step reads the weights once and the KV of every sequence in flight (mean context =
    prompt + response/2; a hybrid's recurrent states, read and written), at DECODE_EFFICIENCY of HBM bandwidth
    (x TP_EFFICIENCY and two all-reduces per layer when tp > 1), and is never faster than the matmul FLOPs at
    PREFILL_MFU. Prefill is compute bound. MoE: the step reads the experts the batch's tokens pick
    (`flops.decode_read_params`), FLOPs count active ones. Assumes every sample runs to response_len (no early
    stop) and static batches."""
    dt = Dtypes.for_device(device)
    bw = device.hbm_tb_s * 1e12 * DECODE_EFFICIENCY * (TP_EFFICIENCY if tp > 1 else 1.0)
    flops = device.bf16_tflops * 1e12
    per_engine = math.ceil(w.sequences / engines)
    passes = math.ceil(per_engine / in_flight)
    batch = math.ceil(per_engine / passes)
    ctx = w.prompt_len + w.response_len / 2
    kv = ctx * kv_bytes_per_token(cfg, dt.engine) + 2 * state_bytes_per_sequence(cfg, dt.engine)  # (read, written)
    read = (decode_read_params(cfg, batch) * dt.engine + batch * kv) / tp
    step = max(read / bw, batch * 2 * matmul_params(cfg) / tp / (flops * PREFILL_MFU))
    if tp > 1:
        step += 2 * cfg.num_layers * ALLREDUCE_LATENCY_S
    prompts = math.ceil(per_engine / w.n)
    prefill = (prompts * w.prompt_len * forward_flops_per_token(cfg, w.prompt_len / 2, lm_head=False)
               / tp / (flops * PREFILL_MFU))
    return passes * w.response_len * step + prefill


def train_seconds(cfg: ModelConfig, device: devices.DeviceSpec, w: Workload, gpus: int, checkpointing: bool,
                  offload: bool) -> float:
    """Training FLOPs of the step (all prompt + response tokens; logits for the responses) at MFU; checkpointing
    recomputes the forward (x4/3); offload adds moving this device's share of the moments over PCIe, in before the
    update and out after."""
    f = train_flops(cfg, w.sequences * w.seq_len, w.seq_len, w.sequences * w.response_len)
    f *= 4 / 3 if checkpointing else 1.0
    if w.lora_rank:  # no weight gradients for the frozen base: forward + input gradients only
        f *= 2 / 3
    s = f / (gpus * device.bf16_tflops * 1e12 * MFU)
    if offload:
        p = lora_params(cfg, w.lora_rank, w.lora_targets) if w.lora_rank else cfg.num_params
        s += 2 * p * Dtypes.for_device(device).moments / gpus / (HOST_LINK_GB_S * GB)
    return s


def sync_payload(cfg: ModelConfig, device: devices.DeviceSpec, lora_rank: int = 0) -> float:
    """Bytes one engine receives per sync: the weights in the rollout dtype, or only the fp32 LoRA adapters."""
    return float(lora_params(cfg, lora_rank) * 4 if lora_rank else cfg.num_params * Dtypes.for_device(device).engine)


def resharding_bytes(cfg: ModelConfig, device: devices.DeviceSpec, dp: int, lora_rank: int = 0) -> float:
    """Bytes moved trainer -> engines per step: the payload, gathered once from the FSDP shards and sent to each
    of the `dp` engines (each TP rank of an engine receives 1/TP of it)."""
    return sync_payload(cfg, device, lora_rank) * dp


def sync_seconds(cfg: ModelConfig, device: devices.DeviceSpec, tp: int, colocated: bool, lora_rank: int = 0) -> float:
    """All-gather the FSDP shards then broadcast (pipelined, so each rank receives its 1/TP share once at
    LINK_GB_S); colocated engines on the same devices still gather, so the cost is the same order."""
    w = sync_payload(cfg, device, lora_rank)
    return (w + w / tp) / (LINK_GB_S * GB)


def cost_per_million(cluster: Cluster, step_s: float, w: Workload) -> float:
    """(gpus * price / 3600) * seconds per step / (trained tokens per step / 1e6)."""
    return cluster.total * cluster.price_per_gpu_hour / 3600 * step_s / (w.trained_tokens / 1e6)


# ---- layouts ------------------------------------------------------------------------------------------------


def max_in_flight(cfg: ModelConfig, device: devices.DeviceSpec, w: Workload, tp: int, budget: float) -> int:
    """Most sequences one engine rank can hold within `budget` bytes (weights, KV and workspace): a search over
    `rollout_memory` itself, which grows with the count but not in proportion (the prefill workspace counts whole
    prompts)."""
    dt = Dtypes.for_device(device)

    def fits(seqs: int) -> bool:
        return rollout_memory(cfg, dt, w, tp, seqs=seqs).total <= budget

    lo, hi = 0, 1
    while fits(hi):  # (the KV cache alone bounds it: this ends)
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _layout(cfg: ModelConfig, cluster: Cluster, w: Workload, colocated: bool, train_gpus: int, rollout_gpus: int,
            tp: int, ckpt: bool, offload: bool) -> Layout | None:
    dev = cluster.device
    budget = dev.memory_gb * GB * (1 - HEADROOM)
    dt = Dtypes.for_device(dev)
    tm = training_memory(cfg, dt, w, train_gpus, ckpt, offload)
    engine_weights = rollout_memory(cfg, dt, w, tp, seqs=0).weights
    # Colocated: the engine keeps its weights through training (its KV cache is freed), and the trainer's
    # sharded states stay resident through rollout (activations are freed).
    train_peak = tm.total + (engine_weights if colocated else 0.0)
    rollout_budget = budget - (tm.resident if colocated else 0.0)
    dp = rollout_gpus // tp
    share = math.ceil(w.sequences / dp)
    in_flight = min(share, w.max_num_seqs or share, max_in_flight(cfg, dev, w, tp, rollout_budget))
    if train_peak > budget or in_flight < 1:
        return None
    rollout_peak = rollout_memory(cfg, dt, w, tp, in_flight).total + (tm.resident if colocated else 0.0)
    r = rollout_seconds(cfg, dev, w, dp, tp, in_flight)
    t = train_seconds(cfg, dev, w, train_gpus, ckpt, offload)
    s = sync_seconds(cfg, dev, tp, colocated, w.lora_rank)
    # Phases alternate (the controller is synchronous, on-policy), so a disaggregated plane idles while the other
    # works; with `overlap` the rollout of step k+1 runs during training of step k and the slower plane sets the pace.
    step = max(r, t) + s if cluster.overlap and not colocated else r + t + s
    return Layout(colocated, train_gpus, rollout_gpus, tp, ckpt, offload, train_peak, rollout_peak, in_flight, r, t,
                  s, step, resharding_bytes(cfg, dev, dp, w.lora_rank), cost_per_million(cluster, step, w))


def layouts(cfg: ModelConfig, cluster: Cluster, w: Workload, check: TrainCheck | None = None) -> list[Layout]:
    """Every feasible layout, fastest (= cheapest) first: colocated on all GPUs, or disaggregated splits (training
    on T GPUs, rollout on the rest, whole nodes or whole TP groups); TP from `tp_sizes`; activation checkpointing
    and optimizer offload on or off. Feasible = both phases' peaks within (1 - HEADROOM) of device memory and at
    least one sequence in flight per engine. Each carries `refused`: `check`'s (default: `train` with its defaults
    and this step's shape) reason to refuse it, "" when `train` accepts it."""
    check = check or TrainCheck.for_workload(w)
    g = cluster.total
    out = []
    for tp in tp_sizes(cfg, cluster.gpus):
        splits = [(True, g, g)] + [(False, t, g - t) for t in range(1, g) if (g - t) % tp == 0]
        for colocated, tg, rg in splits:
            if rg % tp:
                continue
            for ckpt in (False, True):
                for offload in (False, True):
                    lay = _layout(cfg, cluster, w, colocated, tg, rg, tp, ckpt, offload)
                    if lay is not None:
                        out.append(replace(lay, refused=check.refusal(lay)))
    return sorted(out, key=lambda x: (x.step_s, x.tp, x.offload, x.checkpointing))


def refusal_reason(refusal: str) -> str:
    """`train`'s error without the value it got (`TP>1: ... (...), got TP=4` -> `TP>1: ... (...)`), to say once
    for every layout it applies to."""
    return refusal.rsplit(", got ", 1)[0]


def recommend(cfg: ModelConfig, cluster: Cluster, w: Workload,
              options: list[Layout] | None = None) -> tuple[Layout | None, str]:
    """The fastest (= cheapest: the price is per GPU and every layout uses them all) feasible layout that `train`
    accepts (`layouts`), and the reasons, in words. A faster layout that `train` refuses (TP>1: the bandwidth model
    gives it a shorter decode step by splitting the weight reads) is named, not recommended."""
    options = layouts(cfg, cluster, w) if options is None else options
    dev = cluster.device
    if not options:
        return None, (f"nothing fits: even fully sharded with checkpointing and offload, {cluster.total} x "
                      f"{dev.key} ({dev.memory_gb:g} GB) is too small; add GPUs or shrink "
                      "--micro-batch-size / --response-len")
    accepted = [x for x in options if not x.refused]
    if not accepted:
        return None, (f"only layouts that `train` refuses fit (the fastest: {refusal_reason(options[0].refused)}); "
                      "add GPUs or shrink --micro-batch-size / --response-len")
    best = accepted[0]
    b = Dtypes.for_device(dev).engine
    weights = cfg.num_params * b
    unit = "device" if dev.key == "cpu" else "GPU"
    faster = [x for x in options if x.refused and x.step_s < best.step_s]
    alt = (f" (the model prices TP={faster[0].tp} at {faster[0].step_s:.1f} s/step vs {best.step_s:.1f} s by "
           f"splitting weight reads, before TP's communication and coupling costs; not yet supported: "
           f"{refusal_reason(faster[0].refused)})") if faster else ""
    if best.tp == 1:
        reasons = [f"TP=1: the {human_bytes(weights)} of {'bf16' if b == 2 else 'fp32'} weights fit on one "
                   f"{dev.memory_gb:g} GB {dev.key} holding the KV cache of {best.seqs_in_flight} sequences per "
                   f"engine, so every {unit} runs an independent engine (no per-layer all-reduces){alt}"]
    else:
        reasons = [f"TP={best.tp}: at TP=1 the weights ({human_bytes(weights)}) leave too little of the "
                   f"{dev.memory_gb:g} GB for KV cache (or training state); splitting them buys "
                   f"{best.seqs_in_flight} sequences in flight per engine"]
    if best.colocated:
        reasons.append(f"colocated: both planes fit on every {unit} together, so none idles while the other "
                       "plane works")
    else:
        how = "overlapping one step off-policy" if cluster.overlap else "alternating"
        reasons.append(f"disaggregated {best.train_gpus}+{best.rollout_gpus} ({how}): the training state and the "
                       "engine don't fit on the same GPUs, or splitting is faster")
    reasons.append(f"peaks {human_bytes(best.train_mem)} training / {human_bytes(best.rollout_mem)} rollout of "
                   f"{dev.memory_gb * (1 - HEADROOM):.0f} GB usable ({HEADROOM:.0%} headroom)")
    if best.checkpointing:
        reasons.append("activation checkpointing: the micro-batch's activations don't fit otherwise (+33% "
                       "training FLOPs)")
    if best.offload:
        reasons.append("optimizer offload: the AdamW moments live in host memory between updates, as the "
                       "training state, the micro-batch's activations and the engine's weights don't fit together "
                       "on the device otherwise")
    share = math.ceil(w.sequences / best.dp)
    if best.seqs_in_flight < min(share, w.max_num_seqs or share):
        reasons.append(f"memory-limited: each engine decodes {best.seqs_in_flight} of its {share} sequences at a "
                       f"time ({math.ceil(share / best.seqs_in_flight)} passes)")
    return best, "; ".join(reasons)


# ---- output -------------------------------------------------------------------------------------------------

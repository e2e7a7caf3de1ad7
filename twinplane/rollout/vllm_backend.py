"""vLLM as the rollout plane's engine (`rollout.backend=vllm`), behind `RolloutEngine`'s interface.

The controller, the trainer and the multi-turn driver see the same calls as with the own engine: `generate` /
`submit` (token ids in, `Sample`s out: token ids, the sampled tokens' log-probs as vLLM computed them, finish
reasons), `load_weights` (by name, into the running engine), `checksum`, `pop_stats`, and `generator` (the call seeds,
saved in checkpoints). vLLM's engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weights
reach it by reference and `collective_rpc` calls its worker directly; in a process that is already a rank of a
torch.distributed world (a Ray training rank or engine actor) it runs in a process of its own (`foreign_world`), and
weights reach it as one serialized buffer (`to_bytes`).

Sampling, mapped exactly:
- every sample is a vLLM request of its own (n=1) seeded with the own engine's per-sample seed (`sample_seed`), so
  a sample depends on its stream only, not on batching; the prompt is computed once (prefix caching);
- the EOS, `stop_token_ids` and one-token stop sequences are vLLM stop tokens, suppressed before `min_new_tokens`
  (vLLM's `min_tokens`); a longer stop sequence (vLLM stops on strings, not token sequences) ends the sample at its
  first match at index >= min_new_tokens, as the own engine does, the tokens vLLM generated past it dropped;
- per-request caps (multi-turn continuations) are each request's `max_tokens`.
Log-probs are the distribution the trainer scores, log softmax(logits / T) without top-k/top-p, which vLLM
reports as `raw_logprobs` at T = 1 and greedy (0) and as `processed_logprobs` at another T without top-k/top-p
(`logprobs_mode`, one per engine: chosen from the run's rollout temperature; the config refuses T != 1 with
top-k/top-p).

Weight sync: the trainer's tensors by checkpoint name through vLLM's in-place reload (`Worker.reload_weights`,
called from `WeightReload`, a method mixed into vLLM's worker: its weight loaders fuse q/k/v and gate/up, then each
layer is processed again, e.g. re-packed for CPU GEMMs). The checksum is computed inside the engine from what its
loaders wrote into each parameter, before that processing (the CPU GEMMs keep only a packed copy), split back into
checkpoint names: the same `model.checksum` the sender computes over what it sent.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from twinplane.model import Transformer, save_pretrained
from twinplane.model.checksum import combine_checksums, tensor_checksum
from twinplane.model.config import ModelConfig
from twinplane.model.hf import HFCausalLM
from twinplane.model.weights import naming
from twinplane.rollout.engine import call_seed, request_caps
from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.sequence import Sample, sample_seed
from twinplane.rollout.stats import Done, EngineStats

# vLLM's fused parameters: the checkpoint tensors stacked in them along dim 0, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def vllm_environment(own_process: bool = False) -> None:
    """Before vLLM is imported: its engine core in this process (no spawned process, no copy of the weights) or,
    with `own_process`, in a process of its own (which makes a torch.distributed world of its own); its log at
    warnings, no thread pinning, and the CPU build as the target when no GPU is there."""
    # (set either way: the engine's own `own_process` decides how weights travel, so vLLM must agree with it, also
    # after an earlier engine of the process chose the other way)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # (its INFO lines would bury the run's progress)
    # its CPU worker would pin the process's OpenMP threads to cores of its choosing: the trainer shares this process,
    # so `threads` (torch's setting) governs both planes
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def foreign_world() -> bool:
    """Whether this process is a rank of a torch.distributed world that vLLM did not make (a Ray worker's). vLLM's
    engine core takes the process's world as its own (a world of one it makes itself, when there is none), so
    there it runs in a process of its own."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    state = sys.modules.get("vllm.distributed.parallel_state")  # (vLLM's record of the world it made)
    return state is None or getattr(state, "_WORLD", None) is None


def logprobs_mode(temperature: float) -> str:
    """vLLM's log-prob mode that reports log softmax(logits / temperature) (see the module docstring)."""
    return "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"


def stop_at(tokens: Sequence[int], sampling: SamplingParams) -> int | None:
    """Length of the sample that the first stop sequence ending at index >= min_new_tokens leaves, or None."""
    for end in range(sampling.min_new_tokens + 1, len(tokens) + 1):
        if any(len(s) <= end and list(tokens[end - len(s):end]) == s for s in sampling.stop_sequences):
            return end
    return None


def request_params(sampling: SamplingParams, seed: int, cap: int, stop_ids: Iterable[int]):
    """vLLM's SamplingParams for one sample: `cap` new tokens at most, stopping at `stop_ids` (and the one-token
    stop sequences), seeded with `seed`."""
    from vllm import SamplingParams as VllmParams

    stops = set(stop_ids) | set(sampling.stop_token_ids) | {s[0] for s in sampling.stop_sequences if len(s) == 1}
    return VllmParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1,
                      min_tokens=min(sampling.min_new_tokens, cap), max_tokens=cap, stop_token_ids=sorted(stops),
                      seed=seed % 2**63, logprobs=0, detokenize=False, skip_special_tokens=False)


def to_sample(index: int, prompt: list[int], out, sampling: SamplingParams, version: int) -> Sample:
    """One vLLM completion as the project's Sample."""
    tokens = list(out.token_ids)
    logprobs = [float(entry[t].logprob) for entry, t in zip(out.logprobs, tokens, strict=True)]
    reason = "stop" if out.finish_reason == "stop" else "length"
    if sampling.stop_sequences and (end := stop_at(tokens, sampling)) is not None:
        tokens, logprobs, reason = tokens[:end], logprobs[:end], "stop"
    return Sample(index, prompt, tokens, logprobs, reason, version)


def checkpoint_named(published: Callable, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The parameters by their checkpoint names (`published`: the model's `weights.naming`; a native family's MoE
    experts one tensor each, a transformers model's names as they are), what vLLM's loaders take."""
    return [pair for n, t in named for pair in published(n, t)]


def sync_layout(config: ModelConfig) -> dict:
    """What the engine's side of a sync needs of the model's shape (plain values: they may cross processes)."""
    return {"q": config.num_heads * config.head_dim, "kv": config.num_kv_heads * config.head_dim,
            "ffn": config.intermediate_size, "vocab": config.vocab_size, "tied": config.tie_word_embeddings}


def split_fused(dims: dict, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A vLLM parameter as the checkpoint tensors it holds: fused ones split, vocabulary padding cut off (`dims`:
    `layout`)."""
    module = name.split(".")[-2]
    if module in FUSED:
        sizes = [dims["q"], dims["kv"], dims["kv"]] if module == "qkv_proj" else [dims["ffn"], dims["ffn"]]
        parts = t.split(sizes, dim=0)
        return [(name.replace(module, part), x) for part, x in zip(FUSED[module], parts, strict=True)]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return [(name, t[:dims["vocab"]])]
    return [(name, t)]


def to_bytes(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """Named tensors as one buffer (for an engine core in another process: vLLM's messages carry bytes as they
    are, but would decode tensors nested in call arguments as plain lists)."""
    buffer = io.BytesIO()
    torch.save([(n, t.detach().cpu()) for n, t in named], buffer)
    return buffer.getvalue()


class WeightReload:
    """Mixed into vLLM's worker class (`worker_extension_cls`), wherever that worker runs: the sync's entry point,
    called by name through `LLM.collective_rpc`."""

    def twinplane_reload(self, weights: list[tuple[str, torch.Tensor]] | bytes, dims: dict) -> int:
        if isinstance(weights, bytes):
            weights = [tuple(x) for x in torch.load(io.BytesIO(weights), weights_only=True)]
        return reload_and_checksum(self, weights, dims)


def reload_and_checksum(worker, named: list[tuple[str, torch.Tensor]], dims: dict) -> int:
    """Runs inside vLLM's worker: load `named` in place, and the checksum of what the loaders wrote, each layer's
    parameters read just before the layer is processed for its kernels (and the rest after loading)."""
    model = worker.model_runner.get_model()
    prefix = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    seen: dict[str, int] = {}
    patched, processed = [], set()

    def record(layer: torch.nn.Module) -> None:
        processed.add(id(layer))
        for pname, p in layer.named_parameters(recurse=False):
            for n, x in split_fused(dims, f"{prefix[id(layer)]}.{pname}", p.detach()):
                seen[n] = tensor_checksum(x)

    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading") and \
                "process_weights_after_loading" not in vars(method):
            original = method.process_weights_after_loading

            def hooked(layer, _original=original):
                record(layer)
                return _original(layer)

            method.process_weights_after_loading = hooked
            patched.append(method)
    try:
        worker.reload_weights(weights_iterator=named, is_checkpoint_format=True)
    finally:
        for method in patched:
            del method.process_weights_after_loading
    # A layer that loads nothing of its own but shares a weight (a tied LM head) still holds kernels made from the
    # old values (the CPU GEMMs' packed copy): made again from the new ones.
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if id(layer) not in processed and hasattr(layer, "quant_method") and weight is not None and weight.numel():
            layer.quant_method.process_weights_after_loading(layer)
    for name, p in model.named_parameters():
        if p.numel():  # (a layer whose kernels keep only a packed copy has an empty parameter)
            seen |= {n: tensor_checksum(x) for n, x in split_fused(dims, name, p.detach()) if n not in seen}
    if dims["tied"]:
        seen.pop("lm_head.weight", None)
    return combine_checksums(seen)


class VllmEngine:
    """A vLLM engine over a copy of `model`'s weights (written to a temporary folder for vLLM to start from),
    with the own engine's interface. `sleep`: colocated on a GPU, release weights and KV cache after each call
    (vLLM's sleep mode; a no-op in vLLM's CPU build)."""

    model = None  # the weights live in vLLM, not in this process's modules: syncs are verified by checksum

    def __init__(self, model: Transformer | HFCausalLM, eos_token_id: int | None, seed: int = 0,
                 max_num_seqs: int = 512,
                 max_num_batched_tokens: int = 4096, kv_cache_bytes: int = 0, gpu_memory_utilization: float = 0.9,
                 temperature: float = 1.0, sleep: bool = False):
        # vLLM serves many architectures through its Transformers backend, which changes transformers' model classes
        # in the process that loads them: a trainer running those classes (model.impl=hf) keeps vLLM out of its process
        self.own_process = foreign_world() or isinstance(model, HFCausalLM)
        vllm_environment(self.own_process)
        from vllm import LLM

        self.config, self.dtype = model.config, model.output_weight().dtype
        self.published = naming(model)[1]
        self.device = model.output_weight().device
        self.eos_token_id = eos_token_id
        self.generator = torch.Generator().manual_seed(seed)  # one draw per call: that call's seed
        self.weight_version, self.stats, self._checksum = 0, EngineStats(), None
        cpu = self.device.type == "cpu"
        self.sleeps = sleep and not cpu
        folder = tempfile.mkdtemp(prefix="twinplane-vllm-")  # read once: later weights come by reference
        model.save_pretrained(folder) if isinstance(model, HFCausalLM) else save_pretrained(model, folder)
        # vLLM's CPU build cannot rewind a seeded request's generator after a prefill chunk (a CPU torch.Generator has
        # no offset): on CPU every prompt is prefilled in one step, so the budget holds the longest sequence
        chunks = {} if not cpu else {"enable_chunked_prefill": False, "max_num_batched_tokens": max(
            max_num_batched_tokens, model.config.max_position_embeddings)}
        set_threads = torch.set_num_threads  # vLLM's CPU worker turns it into a no-op: the trainer still sets it
        threads = os.environ.get("OMP_NUM_THREADS")
        if self.own_process:  # the engine core's process: as many threads as this one
            os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        try:
            self.llm = LLM(model=folder, skip_tokenizer_init=True, dtype=str(self.dtype).removeprefix("torch."),
                           seed=seed, max_num_seqs=max_num_seqs, enable_prefix_caching=True, enforce_eager=cpu,
                           **({"max_num_batched_tokens": max_num_batched_tokens} | chunks),
                           logprobs_mode=logprobs_mode(temperature),
                           kv_cache_memory_bytes=kv_cache_bytes or (2**30 if cpu else None),
                           gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleeps,
                           worker_extension_cls=f"{__name__}.WeightReload")
        finally:
            torch.set_num_threads = set_threads
            if threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = threads
            shutil.rmtree(folder, ignore_errors=True)
        if self.sleeps:
            self.llm.sleep(level=1)

    # --- weights -----------------------------------------------------------------------------------------------
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     strict: bool = True) -> int:
        """Every weight by name into the running engine; returns (and keeps, for `checksum`) the engine's checksum
        of what it loaded."""
        if not strict:
            raise ValueError("the vllm backend loads full (or LoRA-merged) weights only")
        named = checkpoint_named(self.published, named)
        payload = to_bytes(named) if self.own_process else named
        with self._awake():
            self._checksum = self.llm.collective_rpc("twinplane_reload", args=(payload, sync_layout(self.config)))[0]
        self.weights_loaded(self.weight_version + 1 if version is None else version)
        return self._checksum

    def weights_loaded(self, version: int) -> None:
        self.weight_version = version

    def checksum(self) -> int | None:
        """The engine's checksum of the weights of the last `load_weights` (None before the first)."""
        return self._checksum

    def sleep(self) -> None:
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    # --- requests in, samples out ------------------------------------------------------------------------------
    def generate(self, requests: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Sample]:
        """As `RolloutEngine.generate`: samples ordered request by request, `sampling.n` per request."""
        seed = call_seed(self.generator, sampling)
        caps = [c or sampling.max_new_tokens for c in request_caps(len(requests), sampling, max_new_tokens)]
        stops = [] if self.eos_token_id is None else [self.eos_token_id]
        prompts, params, index = [], [], []
        for i, (p, cap) in enumerate(zip(requests, caps, strict=True)):
            if len(p) == 0:
                raise ValueError(f"request {i}: empty prompt")
            for j in range(sampling.n):
                prompts.append({"prompt_token_ids": list(p)})
                params.append(request_params(sampling, sample_seed(seed, i, j), cap, stops))
                index.append(i)
        if not prompts:
            return []
        t0 = time.perf_counter()
        with self._awake():
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = [to_sample(i, list(requests[i]), o.outputs[0], sampling, self.weight_version)
                   for i, o in zip(index, outs, strict=True)]
        # vLLM's steps are its own: a call counts as one step, its samples as the running sequences
        self.stats += EngineStats(steps=1, running_sum=len(samples), prefill_tokens=sum(map(len, requests)),
                                  decode_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                                  seconds=time.perf_counter() - t0)
        return samples

    def submit(self, requests: Sequence[Sequence[int]], sampling: SamplingParams,
               max_new_tokens: Sequence[int] | None = None) -> Done:
        return Done(self.generate(requests, sampling, max_new_tokens))

    def pop_stats(self) -> EngineStats:
        s, self.stats = self.stats, EngineStats()
        return s

    def pop_metrics(self) -> dict[str, float]:
        return self.pop_stats().metrics()

    @contextlib.contextmanager
    def _awake(self):
        """A sleeping engine woken for the call and put back to sleep after (nothing without sleep mode)."""
        if self.sleeps:
            self.llm.wake_up()
        try:
            yield
        finally:
            if self.sleeps:
                self.llm.sleep(level=1)

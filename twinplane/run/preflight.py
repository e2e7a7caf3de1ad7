"""Checks that need more than the config: the model folder, the machine's memory, the tokenizer's alphabet.

All run before any weights are loaded or any step is taken, and each failure is an `InputError` whose one-line
message names the file (and the tensor or line) at fault, so a bad input costs seconds and exit code 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from twinplane.cluster.planes import build_algorithm
from twinplane.config import Config, ConfigError
from twinplane.errors import InputError, first_line
from twinplane.model import ModelConfig, Transformer, load_model
from twinplane.model.hf import HFCausalLM, load_hf
from twinplane.model.hf_config import HFConfig
from twinplane.model.impl import choose
from twinplane.model.lora import TARGETS, parse_targets, targets_problem
from twinplane.model.memory import Dtypes, Workload, rollout_memory, state_bytes_per_sequence, training_memory
from twinplane.model.weights import checkpoint_files
from twinplane.platform import backends, runtime
from twinplane.rollout.kernels import self_check as kernel_self_check
from twinplane.rollout.kv_cache import pool_blocks
from twinplane.rollout.paged_attention import flex_decode_agrees
from twinplane.tokenizer import Tokenizer, load_tokenizer


def model_config(path: str, impl: str = "auto") -> ModelConfig | HFConfig:
    """`path/config.json` as a ModelConfig, or as an `HFConfig` when transformers' code runs it (`model.impl`,
    `twinplane.model.impl`); a missing folder, bad JSON or a mistyped value names the file."""
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"model.path {path}: no such folder")
    if not (folder / "config.json").is_file():
        final = folder / "final" / "config.json"
        hint = f" (a run dir: its model is {final.parent})" if final.is_file() else ""
        raise InputError(f"{folder / 'config.json'}: no config.json{hint}")
    if choose(folder, impl).impl == "hf":
        try:
            return HFConfig.from_folder(folder)
        except Exception as e:  # transformers' own errors for values its model code refuses
            raise InputError(f"model.path {path}: transformers cannot build it ({first_line(e)})") from None
    try:
        mc = ModelConfig.from_file(folder)
    except FileNotFoundError as e:
        raise InputError(str(e)) from None
    except ValueError as e:  # (from_file names the file)
        raise InputError(first_line(e)) from None
    return mc


def check_hf_run(cfg: Config, mc: HFConfig) -> None:
    """What a run on transformers' modeling code (`model.impl=hf`) cannot do yet, refused before any work."""
    c, r, arch = cfg.cluster, cfg.rollout, mc.architecture  # (vLLM serves what it knows: its own refusal)
    refused = [
        (c.max_staleness > 0, "cluster.max_staleness", "must be 0 (the asynchronous producer drives the native "
         "engine step by step)"),
        (cfg.agent.entrypoint is not None, "agent.entrypoint", "needs the native engine's sessions"),
        (r.record_routing or cfg.algo.routing_replay or cfg.train.router_aux_loss_coef > 0,
         "rollout.record_routing", "algo.routing_replay and train.router_aux_loss_coef need native MoE layers"),
        (build_algorithm(cfg).needs_critic or cfg.critic.model_path is not None, "algo.name",
         "PPO's critic is built on the native decoder"),
        (r.batch_invariant, "rollout.batch_invariant", "is a property of the native engine's GEMMs"),
    ]
    for bad, key, why in refused:
        if bad:
            raise ConfigError(f"{key}: {why}; model.impl=hf runs {arch} with transformers' code")


def check_rope_limits(cfg: Config, mc: ModelConfig | HFConfig) -> None:
    """A longrope model's sequences may pass its pretraining length only where both planes re-encode them there
    with the long factors, as transformers' `generate` does: the native engine and trainer (see
    `ModelConfig.longrope_limit`). A dynamic NTK model's may not pass its limit (`ModelConfig.dynamic_rope_limit`)."""
    limit, longest = mc.longrope_limit, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    dynamic = mc.dynamic_rope_limit
    if dynamic is not None and longest > dynamic:
        raise ConfigError(f"data.max_prompt_tokens + rollout.max_new_tokens = {longest} pass {mc.model_type}'s "
                          f"dynamic rope limit, max_position_embeddings={dynamic}, past which transformers rescales "
                          "its rope per batch")
    if dynamic is not None and cfg.rollout.backend == "vllm":
        raise ConfigError("rollout.backend=vllm: vLLM's dynamic rope takes the scaled frequencies at every length, "
                          f"transformers' and the trainer's only past max_position_embeddings={dynamic}")
    if limit is None or longest <= limit:
        return
    refused = [(cfg.rollout.backend == "vllm", "rollout.backend=vllm", "vLLM picks one factor set per engine"),
               (isinstance(mc, HFConfig), "model.impl=hf", "transformers' forward picks one set per batch"),
               (cfg.rollout.record_routing, "rollout.record_routing", "the routing record holds one set's experts")]
    for bad, key, why in refused:
        if bad:
            raise ConfigError(f"{key}: {why}, so sequences of {mc.model_type} must stay within its longrope "
                              f"original_max_position_embeddings={limit}; data.max_prompt_tokens + "
                              f"rollout.max_new_tokens = {longest}")


def check_lora(cfg: Config, mc: ModelConfig | HFConfig) -> None:
    """`train.lora.targets` against the model: the native decoder's projection names, or (transformers' code) what
    PEFT adapts in the model built on the meta device (`twinplane.model.hf_lora`)."""
    lora = cfg.train.lora
    if not lora.rank:
        return
    if not isinstance(mc, HFConfig):
        problem = targets_problem(lora.targets, native=True)
        if problem is not None:
            raise ConfigError(f"train.lora.targets: {problem}")
        return
    from twinplane.model.hf_config import build_meta
    from twinplane.model.hf_lora import adapted_names

    try:
        adapted_names(build_meta(cfg.model.path), lora.targets)
    except ValueError as e:  # (one line naming train.lora.targets, or train.lora.rank when PEFT is missing)
        raise ConfigError(str(e)) from None


def check_vllm_serves(architecture: str) -> None:
    """rollout.backend=vllm for a model without a native family: vLLM must have the architecture in its registry."""
    from vllm import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        raise ConfigError(f"rollout.backend=vllm: this vLLM does not serve {architecture}; use rollout.backend="
                          "twinplane (the own engine runs it through transformers' code)")


def check_weight_files(path: str) -> None:
    """Every safetensors file opens and its data is complete (a truncated download fails here, named)."""
    try:
        files = checkpoint_files(Path(path))
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: {first_line(e)}") from None
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                st.keys()
        except Exception as e:  # safetensors raises its own error type for every malformed header
            raise InputError(f"{f}: not a readable safetensors file ({first_line(e)})") from None


def open_tokenizer(path: str) -> Tokenizer:
    try:
        tok = load_tokenizer(path)
    except FileNotFoundError as e:
        raise InputError(str(e)) from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}/tokenizer_config.json: invalid JSON ({e})") from None
    except Exception as e:  # the `tokenizers` library raises a bare Exception for a malformed tokenizer.json
        raise InputError(f"{Path(path) / 'tokenizer.json'}: not a valid tokenizer ({first_line(e)})") from None
    for name in ("eos_token", "bos_token", "pad_token"):  # a named token the vocabulary lacks would be dropped
        text = getattr(tok, name)
        if text is not None and tok.token_id(text) is None:
            raise InputError(f"{Path(path) / 'tokenizer_config.json'}: {name} {text!r} is not in the vocabulary of "
                             "tokenizer.json")
    return tok


def open_model(path: str, device: torch.device, dtype: torch.dtype, hf: bool = False) -> Transformer | HFCausalLM:
    """The model folder's weights: native, or through transformers (`hf`)."""
    try:
        return load_hf(path, device, dtype) if hf else load_model(path, device=device, dtype=dtype)
    except (KeyError, ValueError, RuntimeError) as e:  # a tensor missing, extra or of the wrong shape
        msg = e.args[0] if isinstance(e, KeyError) and e.args else first_line(e)
        raise InputError(f"model.path {path}: {msg}") from None


def prompt_tokens(cfg: Config) -> int:
    """The longest prompt a run keeps: data.max_prompt_tokens, or the demo task's ("a+b=", task.digits each)."""
    return cfg.data.max_prompt_tokens if cfg.model.path else 2 * cfg.task.digits + 2


def memory_inputs(cfg: Config, device: torch.device | str = "cpu") -> tuple[Dtypes, Workload]:
    """What the memory model (`twinplane.model.memory`) needs of a run on `device`: the bytes per element its
    settings give (AdamW's moments take the weights' dtype, which is the master copy) and the step's shape."""
    precision = runtime.train_precision(torch.device(device), cfg.model.dtype, cfg.train.compute_dtype)
    b = precision.param.itemsize
    dt = Dtypes(param=b, grad=b, master=0, moments=2 * b, act=precision.compute.itemsize,
                engine=runtime.rollout_dtype(cfg.model, device).itemsize)
    r, lora = cfg.rollout, cfg.train.lora
    chunk = backends.logprob_chunk_tokens(device, cfg.train.logprob_chunk_tokens)
    w = Workload(r.prompts_per_step, r.n, prompt_tokens(cfg), r.max_new_tokens,  # (a response's every turn)
                 min(cfg.train.micro_batch_size, r.samples), chunk, lora.rank, lora_counted(lora.targets),
                 build_algorithm(cfg).needs_reference, r.max_num_seqs)
    return dt, w


def lora_counted(targets: str) -> tuple[str, ...]:
    """The projection names the memory model counts adapters on: those named, else (PEFT's all-linear, a regex,
    other module names) every attention and MLP linear, as for `all`."""
    return tuple(t for t in parse_targets(targets) if t in TARGETS) or TARGETS


def estimate_bytes(cfg: Config, mc: ModelConfig, device: torch.device | str = "cpu") -> dict[str, float]:
    """What the run must hold at once on one device, by part, from the memory model: the training plane's
    weights, grads and AdamW moments (with LoRA: the frozen base and the adapters' states), the reference model,
    the engine's own copy of the weights, and the KV cache (and a hybrid's recurrent states) of the sequences in
    flight. Activations and logits are left out: micro-batching, chunking and checkpointing can shrink them."""
    dt, w = memory_inputs(cfg, device)
    tm = training_memory(mc, dt, w, offload=cfg.train.optimizer_offload)
    rm = rollout_memory(mc, dt, w)
    parts = {"weights, grads and AdamW": tm.params + tm.grads + tm.master + tm.moments, "KV cache": rm.kv_cache,
             "recurrent states": rm.states, "engine weights": rm.weights, "reference": tm.reference}
    return {k: v for k, v in parts.items() if v}


def check_memory(cfg: Config, mc: ModelConfig, memory_bytes: int, where: str, device: torch.device | str = "cpu"
                 ) -> None:
    """Refuse a run whose model and KV cache alone exceed the memory of `device`, which it runs on."""
    parts = estimate_bytes(cfg, mc, device)
    total = sum(parts.values())
    if memory_bytes and total > memory_bytes:
        detail = ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in parts.items())
        raise InputError(f"the run needs at least {total / 1e9:.3g} GB ({detail}: model {mc.num_params / 1e6:.4g}M "
                         f"params, {prompt_tokens(cfg)}+{cfg.rollout.max_new_tokens} tokens x "
                         f"{memory_inputs(cfg, device)[1].in_flight} sequences) but {where} has "
                         f"{memory_bytes / 1e9:.3g} GB; reduce the model, rollout.max_new_tokens or "
                         "rollout.max_num_seqs")


def check_ray_layout(cfg: Config) -> None:
    """A Ray layout that the local Ray twinplane starts (no cluster.address: this machine, all its CPUs and GPUs)
    cannot hold is refused before any work. A joined cluster's resources, or those of a Ray this process already
    runs, are known once Ray is up: the Ray planes check them then."""
    c = cfg.cluster
    if c.backend != "ray" or c.address:
        return
    import ray  # (only with cluster.backend=ray, which needs it)

    if ray.is_initialized():
        return
    n = c.train_devices + (0 if c.colocate else c.rollout_devices) + c.critic_devices
    what = (f"cluster: {n} workers (cluster.train_devices + rollout_devices{'' if not c.colocate else ', colocated'}"
            " + critic_devices)")
    cpus = os.cpu_count() or 1
    if n * c.cpus_per_worker > cpus:
        raise InputError(f"{what} of cluster.cpus_per_worker={c.cpus_per_worker} need {n * c.cpus_per_worker} CPUs; "
                         f"this machine has {cpus}")
    gpus = torch.cuda.device_count()
    if cfg.device != "cpu" and (cfg.device != "auto" or gpus > 0) and n > gpus:  # (where the Ray planes take GPUs)
        raise InputError(f"{what} need {n} GPUs, one each; this machine has {gpus}")


def check_kv_budget(cfg: Config, mc: ModelConfig, prompt_tokens: int, device: torch.device) -> None:
    """The rollout engine's KV pool must hold one whole sequence (the longest prompt and max_new_tokens, which a
    multi-turn response fills with its tool tokens too), or the first such prompt would stop the run. The block
    size and the reserved padding block are the platform's choices for the engine (which checks each call's own
    sequences again); on GPUs with an automatic budget the memory free now is more than the engine will find, so
    this only refuses what can never fit."""
    r = cfg.rollout
    dtype = runtime.rollout_dtype(cfg.model, device)
    kernels, _ = backends.rollout_kernels(device, dtype, r.kernels, check=kernel_self_check)
    _, block_size = backends.paged_attention_backend(device, dtype, mc.head_dim, kernels, flex_check=flex_decode_agrees,
                                                     latent=getattr(mc, "kv_lora_rank", 0) > 0)
    reserved = int(backends.decode_graph_backend(device, r.graphs) != "eager" and not r.record_routing)
    states = state_bytes_per_sequence(mc, dtype.itemsize) * min(r.samples, r.max_num_seqs)  # (as the engine's)
    pool_blocks(mc, device, dtype, block_size, reserved, int(r.kv_cache_gb * 2**30), r.gpu_memory_utilization,
                prompt_tokens + r.max_new_tokens, states=int(states))


def check_vocab(tokenizer: Tokenizer, mc: ModelConfig, path: str) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding and LM head."""
    why = tokenizer.vocab_mismatch(mc.vocab_size)
    if why:
        raise InputError(f"model.path {path}: {why}")


# What makes two decoders' weights interchangeable: the critic is built with the policy's config.
ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "num_experts",
                "moe_intermediate_size", "shared_expert_intermediate_size")


def check_critic(path: str, mc: ModelConfig) -> None:
    """`critic.model_path` (PPO's value model's starting weights): a readable model folder whose decoder has the
    policy's shape, since the critic is the policy's architecture with a value head."""
    if not Path(path).is_dir():
        raise InputError(f"critic.model_path {path}: no such folder")
    critic = model_config(path)
    check_weight_files(path)
    for name in ARCHITECTURE:
        if getattr(critic, name) != getattr(mc, name):
            raise InputError(f"critic.model_path {path}: {name} {getattr(critic, name)!r} differs from the policy's "
                             f"{getattr(mc, name)!r} (the critic is the policy's architecture with a value head)")


def check_tools(tools: list[str], tokenizer: Tokenizer, path: str) -> None:
    """Tool calls must survive the tokenizer: the markup the engine looks for has to come back out of decode."""
    sample = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>' \
             '<tool_response>5</tool_response>'
    if not tools:
        return
    try:
        back = tokenizer.decode(tokenizer.encode(sample), skip_special_tokens=False)
    except Exception as e:  # a vocabulary without these characters raises inside `tokenizers`
        raise InputError(f"rollout.tools: the tokenizer of {path} cannot encode a tool call ({first_line(e)})") \
            from None
    if back.replace(" ", "") != sample.replace(" ", ""):
        raise InputError(f"rollout.tools: the tokenizer of {path} cannot spell a tool call (it decodes "
                         f"{back[:60]!r})")


def unencodable(text: str, tokenizer: Tokenizer) -> str | None:
    """The first character the tokenizer cannot encode (tokenizers without an unknown token raise on it)."""
    for ch in dict.fromkeys(text):
        try:
            tokenizer.encode(ch)
        except Exception:
            return ch
    return None


def locate(path: str, ch: str) -> str:
    """`file:line` of the first line holding `ch` (JSON Lines and other text files), else the file."""
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if ch in line:
                    return f"{path}:{i}"
    except (OSError, UnicodeDecodeError):
        pass
    return path

"""The memory model: what a run's training plane and rollout engine hold on a device, by part.

One model for every reader: the run's gate (`run.preflight`) refuses a run whose floor does not fit, the planner
(`tools.plan`) sizes layouts with it, and the engine sizes its KV block pool with `kv_bytes_per_token`.

- training: weights, grads, an fp32 master copy where the weights are not fp32, AdamW's two moments, all divided
  by the FSDP degree; with LoRA the base is frozen (weights only) and the fp32 adapters carry the grads and
  moments; a reference copy for a KL term (none with LoRA: the reference is the base with the adapters off);
  activations of one micro-batch (`activation_bytes_per_token_layer`; a hybrid's linear-attention layers
  `linear_attention_bytes_per_token_layer`) and the LM head's chunked logits;
- rollout: the engine's weights (its own copy, in its dtype; LoRA adapters stay fp32) / TP, the KV cache of the
  sequences in flight / TP (attention layers only: a hybrid's linear-attention layers hold no KV), their recurrent
  states (those linear layers' fixed-size state per sequence) / TP, and a workspace (logits and the prefill's
  transient activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from twinplane.model.config import ModelConfig
from twinplane.model.flops import DELTANET_CHUNK, attention_layer_count, mlp_width
from twinplane.model.lora import TARGETS
from twinplane.platform import devices


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each thing held."""

    param: int = 2  # training weights (the frozen base's, with LoRA)
    grad: int = 2
    master: int = 4  # fp32 master copy; 0 when the weights themselves are fp32
    moments: int = 8  # AdamW exp_avg + exp_avg_sq
    act: int = 2  # activations (the compute dtype)
    engine: int = 2  # the rollout engine's weights and KV cache

    @classmethod
    def for_device(cls, device: devices.DeviceSpec) -> Dtypes:
        """bf16 mixed precision on GPUs; fp32 everything (no master copy) on the CPU."""
        return cls(4, 4, 0, 8, 4, 4) if device.key == "cpu" else cls()


@dataclass(frozen=True)
class Workload:
    """The shape of one RL step."""

    prompts_per_step: int = 32
    n: int = 8
    prompt_len: int = 512
    response_len: int = 1024
    micro_batch_size: int = 4  # sequences per forward/backward
    logprob_chunk_tokens: int = 512  # train.logprob_chunk_tokens
    lora_rank: int = 0  # train.lora.rank (0 = full fine-tuning)
    lora_targets: tuple[str, ...] = TARGETS
    reference: bool = False  # a reference model for a KL term (a copy of the policy unless LoRA)
    max_num_seqs: int = 0  # rollout.max_num_seqs: the engine's cap on sequences in flight (0 = none)

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.n

    @property
    def in_flight(self) -> int:
        """Sequences one engine holds at once when memory allows them all."""
        return min(self.sequences, self.max_num_seqs or self.sequences)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def trained_tokens(self) -> int:
        """Response tokens per step (the tokens in the loss)."""
        return self.sequences * self.response_len


@dataclass(frozen=True)
class TrainMemory:
    params: float
    grads: float
    master: float
    moments: float
    reference: float
    activations: float
    logits: float

    @property
    def resident(self) -> float:
        """What stays on the device between steps (weights, grads buffer, optimizer states, the reference)."""
        return self.params + self.grads + self.master + self.moments + self.reference

    @property
    def total(self) -> float:
        return self.resident + self.activations + self.logits


@dataclass(frozen=True)
class RolloutMemory:
    weights: float
    kv_cache: float
    workspace: float
    states: float = 0.0  # linear-attention layers' recurrent states (`state_bytes_per_sequence`)

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.states + self.workspace


def kv_bytes_per_token(cfg: ModelConfig, nbytes: int, tp: int = 1) -> float:
    """2 (K and V) * attention layers * kv_heads * head_dim * bytes per element, per token, on one TP rank (KV heads
    replicate when tp > kv_heads); latent attention: layers * (kv_lora_rank + rope dims), one copy on every rank
    (`ModelConfig.kv_layout`). A hybrid's linear-attention layers hold none (`state_bytes_per_sequence`)."""
    pools, heads, dim = cfg.kv_layout
    return float(pools) * attention_layer_count(cfg) * max(heads / tp, 1) * dim * nbytes


def state_bytes_per_sequence(cfg: ModelConfig, nbytes: int, tp: int = 1) -> float:
    """One sequence's recurrent state in the engine's pool (twinplane.rollout.recurrent_state), summed over the
    linear-attention (Gated DeltaNet) layers: the convolution's history, (taps - 1) x (2 H_k d_k + H_v d_v) values
    in the engine's dtype (`nbytes`), and the delta rule's state, H_v x d_k x d_v in fp32; its heads split over TP
    ranks. 0 for a model without such layers."""
    layers = len(getattr(cfg, "linear_layers", ()))
    if not layers:
        return 0.0
    channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (cfg.linear_conv_kernel_dim - 1) * channels * nbytes
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return float(layers) * (conv + state) / tp


def activation_bytes_per_token_layer(cfg: ModelConfig, act_bytes: int) -> float:
    """Saved-for-backward activations of one decoder layer, per token (fused/flash attention, no T^2 term).

    Korthikanti et al. (2022) count 34*h*b bytes per token for a GPT layer (fp16, no dropout here); adapted to
    RMSNorm + GQA attention + rotary + SwiGLU MLP, counting the tensors autograd keeps, in elements:
      2 RMSNorms: input and normalised output, 2 x 2d
      q, k, v projections: a + 2k          (a = heads*head_dim, k = kv_heads*head_dim)
      rotary: q, k and rotate_half(q, k):  2(a + k)
      attention output (input of o_proj): a, plus the kernel's own rotated q/k/v copies: a + 2k
      SwiGLU: gate, up, silu(gate), silu(gate)*up (input of down_proj): 4f
    = 4d + 5a + 6k + 4f elements. Residual adds keep nothing; the attention's log-sum-exp is ignored.
    MoE: f is the per-token width over the top-k experts (`flops.mlp_width`); router logits are ignored.
    """
    d, f = cfg.hidden_size, mlp_width(cfg)
    a, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return float(4 * d + 5 * a + 6 * k + 4 * f) * act_bytes


def linear_attention_bytes_per_token_layer(cfg: ModelConfig, act_bytes: int, chunk: int = DELTANET_CHUNK) -> float:
    """Saved-for-backward activations of one Gated DeltaNet layer (`gated_deltanet.py`), per token. In elements:
      5d + 4f + 2c  (norms, projections' inputs, the MLP; c = the convolution's channels, 2 H_k d_k + H d_v)
      + 13 H d_k + 9 H d_v + 5 H C + H d_k d_v / C  (the chunked delta rule, in fp32 whatever the dtype: its q/k/v
        copies, the [C, C] decay and solve matrices of each chunk, and the state each chunk passes on; C = `chunk`)
    H value heads of d_v, H_k key heads of d_k. The coefficients are fitted to what autograd saves on CPU in fp32
    (saved-tensor hooks, 14 shapes of Qwen3.5's layer, 512 tokens): within 1.3% of each (tested)."""
    d, f = cfg.hidden_size, mlp_width(cfg)
    H, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    c = 2 * cfg.linear_num_key_heads * dk + H * dv
    delta_rule = 13 * H * dk + 9 * H * dv + 5 * H * chunk + H * dk * dv / chunk
    return float(5 * d + 4 * f + 2 * c) * act_bytes + delta_rule * 4


def layers_activation_bytes_per_token(cfg: ModelConfig, act_bytes: int) -> tuple[float, float]:
    """(every layer's saved activations per token, summed; the largest one layer's): attention layers as
    `activation_bytes_per_token_layer`, a hybrid's linear-attention ones as `linear_attention_bytes_per_token_layer`."""
    attending = attention_layer_count(cfg)
    attn = activation_bytes_per_token_layer(cfg, act_bytes)
    lin = linear_attention_bytes_per_token_layer(cfg, act_bytes) if attending < cfg.num_layers else 0.0
    return attn * attending + lin * (cfg.num_layers - attending), max(attn, lin)


def lora_params(cfg: ModelConfig, rank: int, targets: tuple[str, ...] = TARGETS) -> int:
    """Adapter parameters, rank r on each targeted linear: r (in + out) each, per layer; on all of them
    r (7d + 2a + 2k + 3f) with a = heads * head_dim, k = kv_heads * head_dim."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    a, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sides = {"q_proj": d + a, "k_proj": d + k, "v_proj": d + k, "o_proj": a + d, "gate_proj": d + f,
             "up_proj": d + f, "down_proj": f + d, "qkv_proj": d + a + 2 * k, "gate_up_proj": d + 2 * f}
    absent = unfused_names(cfg)
    return rank * cfg.num_layers * sum(sides[t] for t in targets if t not in absent)


def unfused_names(cfg: ModelConfig) -> set[str]:
    """The projection names a family's layers do not have: the fused ones (`qkv_proj`, `gate_up_proj`) where it
    keeps them apart, the separate ones where it publishes them fused (GLM's MLP, Phi-3)."""
    import torch

    from twinplane.model.families import FAMILIES

    if cfg.model_type not in FAMILIES or not isinstance(cfg, ModelConfig):  # (transformers' model: as Llama's)
        return {"qkv_proj", "gate_up_proj"}
    index = next((i for i in range(cfg.num_layers) if i not in cfg.linear_layers), 0)  # an attention layer
    with torch.device("meta"):
        layer = FAMILIES[cfg.model_type].layer(cfg, index)
    qkv, gate_up = hasattr(getattr(layer, "self_attn", None), "qkv_proj"), hasattr(layer.mlp, "gate_up_proj")
    return ({"q_proj", "k_proj", "v_proj"} if qkv else {"qkv_proj"}) | (
        {"gate_proj", "up_proj"} if gate_up else {"gate_up_proj"})


def logits_bytes(cfg: ModelConfig, response_tokens: int, act_bytes: int, chunk: int = 512) -> float:
    """The LM head's transient buffers, one chunk of min(tokens, chunk) rows x vocab at a time (forward and the
    backward's recompute): the chunk's logits in the compute dtype, then fp32 log-probs (normalised in place),
    their exp and the log-sum-exp's temporary, and the logits' gradient cast back to the compute dtype:
    3 fp32 copies + 1 compute-dtype copy."""
    return float(min(response_tokens, chunk)) * cfg.vocab_size * (act_bytes + 3 * 4)


def training_memory(cfg: ModelConfig, dt: Dtypes, w: Workload, fsdp: int = 1, checkpointing: bool = False,
                    offload: bool = False) -> TrainMemory:
    """Peak bytes per device of the training plane.

    Params, grads, master weights, moments and the reference are divided by `fsdp` (plus one gathered layer of
    weights per device while it computes, ignored). `offload` (`train.optimizer_offload`) keeps the AdamW moments
    in host memory between updates. Activations: one micro-batch of `micro_batch_size` x seq_len tokens (packed,
    no padding); with `checkpointing`, each layer keeps only its input (d elements per token) and one layer's
    activations are live during recompute. With `w.lora_rank`, the base's weights are frozen and the fp32
    adapters take grads and moments; each adapted layer keeps its input cast to fp32 and the r-wide intermediate.
    """
    p, d = cfg.num_params, cfg.hidden_size
    tokens = w.micro_batch_size * w.seq_len
    all_layers, one_layer = layers_activation_bytes_per_token(cfg, dt.act)
    if w.lora_rank:
        a = cfg.num_heads * cfg.head_dim
        adapters = ((5 * d + a + cfg.intermediate_size) * 4 if dt.act != 4 else 0) + 7 * w.lora_rank * 4
        all_layers, one_layer = all_layers + adapters * cfg.num_layers, one_layer + adapters
    layers = d * dt.act * cfg.num_layers + one_layer if checkpointing else all_layers
    act = tokens * (layers + 3 * d * dt.act)  # + embeddings out, final norm in/out
    logits = logits_bytes(cfg, w.micro_batch_size * w.response_len, dt.act, w.logprob_chunk_tokens)
    if w.lora_rank:
        lp = lora_params(cfg, w.lora_rank, w.lora_targets)
        return TrainMemory(params=(p * dt.param + lp * 4) / fsdp, grads=lp * 4 / fsdp, master=0.0,
                           moments=0.0 if offload else lp * 8 / fsdp, reference=0.0, activations=float(act),
                           logits=logits)
    return TrainMemory(params=p * dt.param / fsdp, grads=p * dt.grad / fsdp, master=p * dt.master / fsdp,
                       moments=0.0 if offload else p * dt.moments / fsdp,
                       reference=p * dt.param / fsdp if w.reference else 0.0, activations=float(act), logits=logits)


def checkpoint_bytes(cfg: ModelConfig, dt: Dtypes, w: Workload) -> float:
    """Bytes of a checkpoint's training state: the trainable weights as the ranks store them (the fp32 master copy
    where there is one) and their AdamW moments; with LoRA the fp32 adapters only (the base is referred to). A
    sharded checkpoint (`checkpoint.format=sharded`) writes 1/N of it from each of N training ranks."""
    if w.lora_rank:
        return lora_params(cfg, w.lora_rank, w.lora_targets) * (4 + 8)
    return cfg.num_params * ((dt.master or dt.param) + dt.moments)


def rollout_workspace(cfg: ModelConfig, dt: Dtypes, seqs: int, prompt_tokens: int, tp: int = 1) -> float:
    """Transient engine memory: fp32 logits of the sequences in flight (logits, log-probs and the sampler's
    temporaries, 3 copies of [seqs, vocab]) plus one layer of prefill activations over the prompt tokens
    (q/k/v/o + MLP intermediates: 2d + a + 2k + 3f per token, divided by TP)."""
    logits = 3.0 * seqs * cfg.vocab_size * 4
    a, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    prefill = prompt_tokens * (2 * cfg.hidden_size + (a + 2 * k + 3 * mlp_width(cfg)) / tp) * dt.engine
    return logits + prefill


def rollout_memory(cfg: ModelConfig, dt: Dtypes, w: Workload, tp: int = 1, seqs: int | None = None) -> RolloutMemory:
    """Peak bytes per device of one engine rank holding `seqs` sequences (default `w.in_flight`) of
    prompt_len + response_len tokens: weights / TP + KV cache / TP + recurrent states / TP + workspace. The engine
    prefills each prompt once and expands the cache to n rows, so `seqs` counts samples."""
    seqs = w.in_flight if seqs is None else seqs
    kv = kv_bytes_per_token(cfg, dt.engine, tp) * seqs * w.seq_len
    prompts = max(1, math.ceil(seqs / w.n))
    lora = lora_params(cfg, w.lora_rank, w.lora_targets) * 4 / tp  # unmerged fp32 adapters beside the base
    return RolloutMemory(weights=cfg.num_params * dt.engine / tp + lora, kv_cache=kv,
                         workspace=rollout_workspace(cfg, dt, seqs, prompts * w.prompt_len, tp),
                         states=state_bytes_per_sequence(cfg, dt.engine, tp) * seqs)

"""GPT-OSS: attention with q/k/v/o biases and sinks (a learned logit per head that joins the softmax's denominator
and takes no value), sliding-window and full layers alternating (`layer_types`, else every other layer from the
first slides), a YaRN rope by default; every layer's MLP is a mixture of experts: a router with a bias (top-k of
its logits, softmax over those k) and experts with biases and a clamped SwiGLU (gate clamped above at
`swiglu_limit`, up on both sides, `(up + 1) * gate * sigmoid(swiglu_alpha * gate)`), held as transformers holds them
(`gate_up_proj` [E, D, 2F] with gate and up interleaved, `down_proj` [E, F, D]), so checkpoints keep their names.

The sinks reach attention through `AttentionMetadata.with_sinks`: sink layers take the portable explicit-scores
path on both planes, except the engine's Triton paged decode, which adds them itself. transformers' reference is
its eager attention. MXFP4 checkpoints (the experts' weights as `*_blocks` / `*_scales`) are dequantized on load."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.attention import attention
from twinplane.model.blocks import Attention, RMSNorm
from twinplane.model.family import DROPOUT, Family
from twinplane.model.layer import DecoderLayer
from twinplane.model.moe import RoutingState

DEFAULT_THETA = 150000.0  # transformers' GptOssConfig.default_theta
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


class GptOssRMSNorm(RMSNorm):
    """Scales in fp32 before casting back (Llama's casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class SinkAttention(Attention):
    def __init__(self, cfg, layer: int):
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))

    def forward(self, x, cos, sin, meta):
        B, T, _ = x.shape
        y = attention(*self.qkv(x, cos, sin), meta.with_sinks(self.sinks), self.layer)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class GptOssExperts(nn.Module):
    """E experts as stacked weights in transformers' layout (x @ W, not nn.Linear's W^T)."""

    def __init__(self, cfg):
        super().__init__()
        E, D, Fh = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, D, 2 * Fh))  # gate and up interleaved on the last axis
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * Fh))
        self.down_proj = nn.Parameter(torch.empty(E, Fh, D))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, D))
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)
        self.alpha = float(cfg.extra.get("swiglu_alpha", 1.702))
        self.limit = float(cfg.extra.get("swiglu_limit", 7.0))

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N, D], idx [N, k], weight [N, k] -> [N, D]: the (token, expert) pairs sorted by expert, one matmul
        chain per expert over its slice."""
        N, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        xs = x[token]
        out = []
        for e, chunk in enumerate(xs.split(counts.tolist())):
            if len(chunk):
                h = self.glu(chunk @ self.gate_up_proj[e] + self.gate_up_proj_bias[e])
                out.append(h @ self.down_proj[e] + self.down_proj_bias[e])
        ys = torch.cat(out) * weight.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)


class GptOssMoE(nn.Module):
    """Router + experts. Routing replay as `moe.SparseMoE`: replayed experts replace the router's top-k, their
    weights are the softmax of the router's logits there (so the router keeps its gradient)."""

    def __init__(self, cfg, moe_index: int):
        super().__init__()
        self.moe_index, self.top_k = moe_index, cfg.num_experts_per_tok
        self.router = Router(cfg)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor, routing: RoutingState | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)  # [N, E]
        top, own = logits.topk(self.top_k, dim=-1)
        idx = own if routing is None else routing.experts(self.moe_index, own, logits)
        if idx is not own:  # replayed: the router's logits at the replayed experts
            top = logits.gather(1, idx)
        w = torch.softmax(top, dim=-1, dtype=top.dtype)
        return self.experts(x, idx, w).reshape(shape)


def mlp(cfg, layer: int) -> nn.Module:
    return GptOssMoE(cfg, cfg.moe_layers.index(layer))


class GptOssLayer(DecoderLayer):
    attention = SinkAttention

    def __init__(self, cfg, layer: int, mlp=mlp):
        super().__init__(cfg, layer, mlp)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# the 4-bit codes of MXFP4 (e2m1): sign bit, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, R, G, 16] uint8 (two codes a byte, low nibble first) and scales [E, R, G] uint8 (a power of two
    per 32 values, biased by 127) -> the weight [E, G * 32, R] in fp32, as transformers' `convert_moe_packed_tensors`
    (the checkpoint holds rows of R; the parameter is its transpose)."""
    b = blocks.to(torch.uint8).long()
    vals = torch.stack((FP4[b & 0x0F], FP4[b >> 4]), dim=-1).flatten(-2)  # [E, R, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None])
    return vals.flatten(-2).transpose(1, 2).contiguous()


def dequantize_mxfp4(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each `X_blocks` / `X_scales` pair (in any order, any shards) replaced by the
    plain `X`; everything else passes through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        part = next((p for p in ("_blocks", "_scales") if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        pair = pending.setdefault(name.removesuffix(part), {})
        pair[part] = tensor
        if len(pair) == 2:
            yield name.removesuffix(part), mxfp4_weight(pair["_blocks"], pair["_scales"])
            del pending[name.removesuffix(part)]
    if pending:
        raise ValueError(f"mxfp4 checkpoint: {sorted(pending)[0]} has _blocks or _scales but not both")


def read(hf: dict) -> dict:
    from twinplane.model.rope import read_rope

    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    window = hf.get("sliding_window", 128)
    if "sliding_attention" in types and not window:
        raise ValueError(f"gpt_oss: layer_types has sliding_attention layers but sliding_window is {window!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or DEFAULT_ROPE
    theta, scaling = read_rope(hf | dict(rope_parameters=rope, rope_scaling=None,
                                         rope_theta=hf.get("rope_theta", DEFAULT_THETA)))
    bias = bool(hf.get("attention_bias", True))
    experts = hf.get("num_local_experts", hf.get("num_experts", 128))
    return dict(
        qkv_bias=bias, o_bias=bias, head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=float(theta), rope_scaling=scaling, sliding_window=window or None, layer_types=list(types),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), max_position_embeddings=hf.get("max_position_embeddings", 131072),
        num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 4),
        moe_intermediate_size=hf["intermediate_size"])


def write(cfg) -> dict:
    return dict(attention_bias=cfg.qkv_bias, layer_types=cfg.layer_types, sliding_window=cfg.sliding_window,
                num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                rope_parameters={"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})})


FAMILY = Family("gpt_oss", "GptOssForCausalLM", read, write, mlp=mlp, decoder_layer=GptOssLayer,
                unsupported=DROPOUT, activation_key=None, norm=GptOssRMSNorm, dequantize={"mxfp4": dequantize_mxfp4},
                portable=("attention sinks: no flash/flex kernel adds them to the softmax (the Triton paged decode "
                          "does)",))

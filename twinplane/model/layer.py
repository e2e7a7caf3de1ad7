"""A decoder layer: the pre-norm residual block (Llama's, which most families keep), with the activation
checkpointing and per-layer compiling that the training plane asks of every layer. A family whose block differs
(norm placement, extra norms) subclasses it and overrides `block`; `forward` and `run` stay as they are, so the
recompute and compile arrangement holds for it too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch import nn

from twinplane.model.blocks import Attention, RMSNorm, dense_mlp

if TYPE_CHECKING:
    from twinplane.model.config import ModelConfig
    from twinplane.model.moe import RoutingState


class DecoderLayer(nn.Module):
    attention: type[nn.Module] = Attention  # a family whose q/k/v differ (fused, normed, roped) subclasses it

    def __init__(self, cfg: ModelConfig, layer: int, mlp: Callable[[ModelConfig, int], nn.Module] = dense_mlp):
        super().__init__()
        self.self_attn = self.attention(cfg, layer)
        self.mlp = mlp(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, recompute: bool = False, routing: RoutingState | None = None,
                compiled: bool = False):
        """`recompute`: activation checkpointing; `compiled`: run through `torch.compile`, one region per layer.
        Both sit inside the block's forward so that FSDP2's unshard hooks (on this module's call) stay outside the
        recomputed and the compiled region, the arrangement torchtitan uses; the compiled region holds the
        checkpoint (torchtitan's order: compile wraps the checkpointed block)."""
        run = compiled_layer() if compiled else DecoderLayer.run
        return run(self, x, cos, sin, meta, recompute, routing)

    def run(self, x, cos, sin, meta, recompute: bool, routing: RoutingState | None):
        if recompute:  # no dropout anywhere, so there is no RNG state to replay
            return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, meta, routing, use_reentrant=False,
                                                     preserve_rng_state=False)
        return self.block(x, cos, sin, meta, routing)

    def block(self, x, cos, sin, meta, routing=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x), routing)


@functools.cache
def compiled_layer() -> Callable:
    """`DecoderLayer.run` compiled once for every layer (they share the code and its graphs). Dynamic shapes:
    packed micro-batches change length every call, and a graph per length would recompile all the time.

    Dynamo's guards on FSDP-managed modules are kept (`skip_fsdp_guards=False`, set for the process when compiling
    is first asked for; these layers are the only FSDP modules twinplane compiles): skipping them, as Dynamo does
    by default, also stops it from holding those modules' int attributes static, so under FSDP2 and dynamic
    shapes the head counts and head size became symbols, which broke the graph at SDPA's `enable_gqa` and left
    the kernels generic over sizes that never change. With the guards the sharded layers compile to the graphs
    of unsharded ones."""
    torch._dynamo.config.skip_fsdp_guards = False  # (read while tracing; set once, not on every layer call)
    return torch.compile(DecoderLayer.run, dynamic=True)

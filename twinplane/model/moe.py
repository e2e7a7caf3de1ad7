"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a top-k router, experts as stacked weights, and the
routing record/replay state that both planes thread through the forward.

The block works on tokens [N, D] and never looks at attention or batch layout: callers flatten [B, T, D] (or
a packed stream) to tokens, and a `RoutingState` is indexed in that same token order.

Expert compute: the N*k (token, expert) pairs are sorted by expert, so each expert runs one matmul over a
contiguous slice. `torch._grouped_mm` does all experts in one call where `platform.backends.grouped_mm_ok` says it
works; the per-expert loop is the portable fallback, and tests check that they agree.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.blocks import MLP, dense_mlp
from twinplane.platform import backends

if TYPE_CHECKING:
    from twinplane.model.config import ModelConfig


class RoutingState:
    """Routing of one forward, per MoE layer, in the forward's flat token order (row-major over [B, T]).

    - record: every sparse layer stores its router's own top-k in `chosen[m]` ([N, k] long; m = MoE-layer index,
      `ModelConfig.moe_layers[m]` is the decoder layer).
    - replay: `replay` [N, M, k] gives the experts to run instead of the router's top-k; a row of -1 (padding,
      or a token the engine never ran, like the last sampled one) falls back to the router's own choice.
      The gate weights are still the router's softmax at the replayed experts, so the router keeps its gradient.
    - `keep_logits`: keep each layer's router logits [N, E] (with grad) for the load-balancing loss.
    Entries are keyed by layer, so activation checkpointing's recompute overwrites rather than appends.
    Not a dataclass: FSDP2's input casting rebuilds dataclasses it finds in a forward's arguments, and the layers
    would then record into a copy that the caller never sees.
    """

    def __init__(self, replay: torch.Tensor | None = None, keep_logits: bool = False):
        self.replay = replay  # [N, M, k] expert ids, -1 = use the router's own
        self.keep_logits = keep_logits
        self.chosen: dict[int, torch.Tensor] = {}  # m -> [N, k] router's own top-k
        self.used: dict[int, torch.Tensor] = {}  # m -> [N, k] experts that ran (replayed or own)
        self.logits: dict[int, torch.Tensor] = {}  # m -> [N, E] router logits

    def experts(self, m: int, own: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The experts MoE layer `m` runs [N, k]: the replayed ones where a row has them, else the router's `own`;
        records both (and `logits`, with `keep_logits`)."""
        idx = own
        if self.replay is not None:
            replay = self.replay[:, m].to(own.device, torch.long)  # [N, k]
            idx = torch.where((replay >= 0).all(-1, keepdim=True), replay, own)
        self.chosen[m], self.used[m] = own, idx
        if self.keep_logits:
            self.logits[m] = logits
        return idx

    def indices(self) -> torch.Tensor:
        """The router's own choices [N, M, k] (long)."""
        return torch.stack([self.chosen[m] for m in sorted(self.chosen)], 1)


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights (FSDP2 shards them on the expert axis like any other parameter)."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))  # [E, F, D], nn.Linear layout
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))  # [E, D, F]
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N, D], idx [N, k] expert ids, weight [N, k] gate weights -> [N, D] = sum_j weight_j * expert_j(x)."""
        N, k = idx.shape
        E = self.gate_proj.shape[0]
        flat = idx.reshape(-1)  # [N*k]
        order = flat.argsort(stable=True)  # pairs sorted by expert
        token = order // k  # [N*k] which token each sorted pair belongs to
        # [E]; not torch.bincount, whose CUDA kernel reads the largest id on the host (graph capture forbids it)
        counts = torch.zeros(E, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        xs = x[token]  # [N*k, D]
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.gate_proj.requires_grad)
        if backends.grouped_mm_ok(x.device, x.dtype, self.gate_proj.shape[1:], needs_grad):
            ys = self.grouped(xs, counts)
        else:
            ys = self.loop(xs, counts)
        ys = ys * weight.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def loop(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Portable path: one matmul chain per expert over its slice of the sorted pairs."""
        out = []
        for e, chunk in enumerate(xs.split(counts.tolist())):
            h = F.silu(F.linear(chunk, self.gate_proj[e])) * F.linear(chunk, self.up_proj[e])
            out.append(F.linear(h, self.down_proj[e]))
        return torch.cat(out)

    def grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Fast path: three grouped GEMMs over all experts, no host sync on the expert counts."""
        offs = counts.cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(xs, self.gate_proj.transpose(1, 2), offs=offs)  # [N*k, F]
        up = torch._grouped_mm(xs, self.up_proj.transpose(1, 2), offs=offs)
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)  # [N*k, D]


class SparseMoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert behind a sigmoid gate). `moe_index`: this layer's position
    among the sparse layers (the routing state's layer axis)."""

    def __init__(self, cfg: ModelConfig, moe_index: int, shared_mlp: nn.Module | None = None):
        super().__init__()
        self.moe_index, self.top_k, self.norm_topk = moe_index, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if shared_mlp is not None:
            self.shared_expert = shared_mlp
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, routing: RoutingState | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        logits = self.gate(x)  # [N, E]
        probs = logits.float().softmax(-1)  # fp32 as in HF
        own = probs.topk(self.top_k, dim=-1).indices  # [N, k]
        idx = own if routing is None else routing.experts(self.moe_index, own, logits)
        w = probs.gather(-1, idx)  # [N, k]
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        y = self.experts(x, idx, w.to(x.dtype))
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(shape)


def sparse_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """A layer's MLP in an MoE family: routed experts on the sparse layers, the dense MLP on the others."""
    if not cfg.is_moe_layer(layer):
        return dense_mlp(cfg, layer)
    return SparseMoE(cfg, cfg.moe_layers.index(layer))


def sparse_mlp_shared(cfg: ModelConfig, layer: int) -> nn.Module:
    """Qwen2-MoE: the routed experts plus one always-on shared expert behind a sigmoid gate."""
    if not cfg.is_moe_layer(layer):
        return dense_mlp(cfg, layer)
    shared = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
    return SparseMoE(cfg, cfg.moe_layers.index(layer), shared)


def read_moe(hf: dict) -> dict:
    """The MoE fields of ModelConfig from config.json (Qwen-MoE names; Mixtral's family overrides two)."""
    return dict(num_experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
                num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                moe_intermediate_size=hf.get("moe_intermediate_size", 0),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
                mlp_only_layers=list(hf.get("mlp_only_layers") or []))


def write_moe(cfg: ModelConfig) -> dict:
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=cfg.mlp_only_layers)


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer auxiliary loss as transformers' `load_balancing_loss_func`: E * sum_e f_e * P_e, where
    f_e is the fraction of (token, slot) assignments to expert e and P_e its mean router probability, both pooled
    over all sparse layers' real tokens. logits: per layer [N, E]; valid: [N] bool (padding excluded)."""
    E = logits[0].shape[-1]
    w = torch.ones(logits[0].shape[0], device=logits[0].device) if valid is None else valid.float()  # [N]
    counts = torch.zeros(E, device=w.device)
    prob_sum = torch.zeros(E, device=w.device)
    for lg in logits:
        p = lg.float().softmax(-1)  # [N, E]
        sel = p.topk(top_k, dim=-1).indices  # [N, k]
        counts = counts.scatter_add(0, sel.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (p * w[:, None]).sum(0)
    rows = w.sum() * len(logits)
    return E * ((counts / rows) * (prob_sum / rows)).sum()


def expert_loads(used: dict[int, torch.Tensor], num_experts: int, valid: torch.Tensor) -> torch.Tensor:
    """Tokens routed to each expert [M, E] (float), over the real tokens (valid [N] bool)."""
    rows = [torch.bincount(used[m][valid].reshape(-1), minlength=num_experts) for m in sorted(used)]
    return torch.stack(rows).float()


def routing_agreement(own: torch.Tensor, recorded: torch.Tensor) -> tuple[int, int]:
    """(agreeing, counted) (token, layer) pairs whose top-k *sets* match; recorded rows of -1 are not counted.
    own, recorded: [N, M, k]."""
    has = (recorded >= 0).all(-1)  # [N, M]
    same = (own.sort(-1).values == recorded.to(own.device, own.dtype).sort(-1).values).all(-1)
    return int((same & has).sum()), int(has.sum())


# Checkpoint names of the published per-expert layout -> (our parameter, expert index): `experts.E.` inside the
# block (Qwen-MoE: `mlp`; Mixtral: `block_sparse_moe` with w1/w3/w2 for gate/up/down, `names`).
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight$")


def expert_from_checkpoint(name: str, block: str = "mlp", names: dict[str, str] | None = None
                           ) -> tuple[str, int | None]:
    """A checkpoint tensor's parameter name here, and its expert index when it is one slice of stacked experts."""
    m = _EXPERT.match(name)
    if m and m.group(2) == block:
        layer, _, e, proj = m.groups()
        return f"{layer}.mlp.experts.{(names or {}).get(proj, proj)}", int(e)
    if block != "mlp":
        name = name.replace(f".{block}.gate.", ".mlp.gate.")
    return name, None


def expert_to_checkpoint(name: str, tensor: torch.Tensor, block: str = "mlp", names: dict[str, str] | None = None
                         ) -> list[tuple[str, torch.Tensor]]:
    """The published names for one of our parameters: stacked experts split into one tensor per expert."""
    if ".mlp.experts." in name:
        layer, proj = name.split(".mlp.experts.")
        ours = {v: k for k, v in (names or {}).items()}.get(proj, proj)
        return [(f"{layer}.{block}.experts.{e}.{ours}.weight", tensor[e]) for e in range(tensor.shape[0])]
    if block != "mlp" and ".mlp.gate." in name:
        return [(name.replace(".mlp.gate.", f".{block}.gate."), tensor)]
    return [(name, tensor)]

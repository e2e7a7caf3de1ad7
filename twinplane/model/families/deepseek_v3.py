"""DeepSeek-V3 (and models on its layout: Kimi K2, ...): multi-head latent attention (twinplane.model.mla) with an
optional YaRN rope, and DeepSeek's MoE: sigmoid scores, the top-k chosen among the best `topk_group` of `n_group`
expert groups after adding a score-correction bias (for choosing only: the weights are the scores), optionally
renormalised, times `routed_scaling_factor`; `n_shared_experts` always-on experts without a gate; the first
`first_k_dense_replace` layers dense. transformers' DeepseekV3 is the reference: options it ignores (DeepSeek's
`moe_layer_freq`, `topk_method`, `scoring_func`) are accepted at the values its code implies only. The
multi-token-prediction layers DeepSeek-V3's checkpoints carry after the decoder layers (`model.layers.{L + i}.*`,
i < `num_nextn_predict_layers`) are not part of this model: skipped on load as transformers skips them, not trained,
and not saved (a saved config says `num_nextn_predict_layers: 0`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.blocks import MLP, dense_mlp
from twinplane.model.family import DROPOUT, Family, Ignored, Option
from twinplane.model.mla import latent_layer
from twinplane.model.moe import Experts, RoutingState, expert_from_checkpoint, expert_to_checkpoint
from twinplane.model.precision import Fp32Params


class GroupRouter(Fp32Params):
    """transformers' DeepseekV3TopkRouter: `weight` [E, D] and `e_score_correction_bias` [E] (a parameter here so
    that weight syncs and checkpoints carry it, trained by no gradient: it only chooses). Both held in fp32 whatever
    the model's dtype, and the logits computed in fp32 outside autocast, as transformers does (its
    `_keep_in_fp32_modules_strict`): a bias rounded to bf16 moves scores by ~4e-3 and changes which experts tokens
    pick."""

    fp32_params = ("weight", "e_score_correction_bias")

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.k, self.groups, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (router logits [N, E], scores [N, E], the router's own top-k [N, k]), in fp32."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        N, E = choice.shape
        group_scores = choice.view(N, self.groups, -1).topk(2, dim=-1).values.sum(-1)  # [N, G]
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.groups, dim=1), float("-inf"))
        return logits, scores, choice.topk(self.k, dim=-1, sorted=False).indices


class DeepseekMoE(nn.Module):
    """Routed experts (twinplane.model.moe.Experts, stacked) plus the shared experts. Routing replay as in
    `SparseMoE`: replayed experts replace the router's choice, their weights are the router's scores there."""

    def __init__(self, cfg, moe_index: int):
        super().__init__()
        self.moe_index, self.norm_topk, self.scaling = moe_index, cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.gate = GroupRouter(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor, routing: RoutingState | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        logits, scores, own = self.gate(x)
        idx = own if routing is None else routing.experts(self.moe_index, own, logits)
        w = scores.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        y = self.experts(x, idx, (w * self.scaling).to(x.dtype))
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y.reshape(shape)


def mlp(cfg, layer: int) -> nn.Module:
    return DeepseekMoE(cfg, cfg.moe_layers.index(layer)) if cfg.is_moe_layer(layer) else dense_mlp(cfg, layer)


def read(hf: dict) -> dict:
    mtp = hf.get("num_nextn_predict_layers")
    if mtp is not None and (not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0):
        raise ValueError(f"deepseek_v3: num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"deepseek_v3: num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads="
                         f"{heads}: latent attention has a key and a value per head")
    rope = hf.get("qk_rope_head_dim", 64)
    if hf.get("head_dim") not in (None, rope):  # (transformers ropes head_dim dims of the qk_rope_head_dim ones)
        raise ValueError(f"deepseek_v3: head_dim={hf['head_dim']} differs from qk_rope_head_dim={rope}")
    experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or 0
    bias = bool(hf.get("attention_bias", False))  # on q_a_proj, kv_a_proj_with_mqa and o_proj
    moe = hf.get("moe_intermediate_size", 2048)
    return dict(
        num_kv_heads=heads, head_dim=rope, qkv_bias=bias, o_bias=bias,
        kv_lora_rank=hf.get("kv_lora_rank", 512), q_lora_rank=hf.get("q_lora_rank", 1536),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128), v_head_dim=hf.get("v_head_dim", 128),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 8), moe_intermediate_size=moe,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), moe_scoring="sigmoid",
        shared_expert_intermediate_size=moe * (hf.get("n_shared_experts", 1) or 0),
        n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        first_k_dense_replace=hf.get("first_k_dense_replace", 3) or 0)


def write(cfg) -> dict:
    return dict(
        attention_bias=cfg.qkv_bias, qk_rope_head_dim=cfg.head_dim, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
        rope_interleave=cfg.rope_interleave, n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob, n_shared_experts=cfg.shared_expert_intermediate_size
        // max(cfg.moe_intermediate_size, 1), n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, first_k_dense_replace=cfg.first_k_dense_replace,
        num_nextn_predict_layers=0)  # (the multi-token-prediction layers are not saved)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def mtp_layers(cfg) -> int:
    return cfg.extra.get("num_nextn_predict_layers") or 0


def mtp_tensor(cfg, name: str) -> bool:
    """A tensor of the multi-token-prediction layers after the decoder's: `model.layers.{L + i}.*` with
    i < num_nextn_predict_layers. Layers past those are refused on load: a config naming fewer layers than the
    checkpoint holds must not load as a shallower model."""
    m = _LAYER.match(name)
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + mtp_layers(cfg)


def mtp_note(cfg) -> str | None:
    n = mtp_layers(cfg)
    return None if not n else (f"multi-token prediction: the checkpoint's {n} MTP layer(s) (model.layers."
                               f"{cfg.num_layers}{'' if n == 1 else f'-{cfg.num_layers + n - 1}'}.*) are skipped on "
                               "load, not trained and not saved")


UNSUPPORTED = DROPOUT | {
    "moe_layer_freq": Option(1, "experts on every moe_layer_freq-th layer only (DeepSeek's own code; "
                                "transformers' DeepseekV3 ignores it)"),
    "topk_method": Option("noaux_tc", "a routing other than noaux_tc (group-limited top-k with the correction bias)"),
    "scoring_func": Option("sigmoid", "router scores other than sigmoid"),
}

FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", read, write, mlp=mlp, decoder_layer=latent_layer,
                unsupported=UNSUPPORTED,
                from_checkpoint=expert_from_checkpoint, to_checkpoint=expert_to_checkpoint,
                ignored=Ignored(mtp_tensor, mtp_note))

"""Mixtral: Mistral's attention, routed experts of `intermediate_size` whose top-k gates always renormalise,
published as `block_sparse_moe.experts.E.w1/w3/w2` (gate/up/down)."""

import functools

from twinplane.model import moe
from twinplane.model.family import DROPOUT, Family, Option

NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def read(hf: dict) -> dict:
    return dict(sliding_window=hf.get("sliding_window"),
                **moe.read_moe(hf) | dict(moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True))


def write(cfg) -> dict:
    return dict(sliding_window=cfg.sliding_window, num_local_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok)


FAMILY = Family(
    "mixtral", "MixtralForCausalLM", read, write, mlp=moe.sparse_mlp,
    unsupported=DROPOUT | {"router_jitter_noise": Option(lambda v: not v, "noise on the router's input in training")},
    from_checkpoint=functools.partial(moe.expert_from_checkpoint, block="block_sparse_moe", names=NAMES),
    to_checkpoint=functools.partial(moe.expert_to_checkpoint, block="block_sparse_moe", names=NAMES))

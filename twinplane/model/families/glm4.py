"""GLM-4-0414 (`glm4`): GLM's layer (twinplane.model.families.glm: interleaved partial rope, q/k/v biases, fused
gate/up) with an RMSNorm on the attention's output and one on the MLP's, each before its residual add, besides the
input norms."""

from __future__ import annotations

from twinplane.model.blocks import RMSNorm, gate_up_mlp
from twinplane.model.families import glm
from twinplane.model.family import DROPOUT, Family


class Glm4Layer(glm.GlmLayer):
    def __init__(self, cfg, layer: int, mlp=gate_up_mlp):
        super().__init__(cfg, layer, mlp)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def block(self, x, cos, sin, meta, routing=None):
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x), routing))


FAMILY = Family("glm4", "Glm4ForCausalLM", glm.read, glm.write, mlp=gate_up_mlp, decoder_layer=Glm4Layer,
                unsupported=DROPOUT)

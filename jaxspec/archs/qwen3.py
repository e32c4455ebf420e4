"""Qwen3 (dense): the Llama layout with an RMSNorm on each query and key head before rope."""

from jaxspec.archs.base import (LAYER_NAMES, QK_NORM_NAMES, Arch, hf_rope, hf_theta,
                                refuse_biases, rope_scaling)
from jaxspec.errors import UserError


def from_hf(hf: dict, head_dim: int) -> dict:
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"unsupported activation {hf['hidden_act']!r} for qwen3")
    if hf.get("use_sliding_window"):
        raise UserError("Qwen3 checkpoints with a sliding window are not supported")
    refuse_biases(hf, "qwen3")
    theta, scaling = hf_theta(hf)
    return dict(arch="qwen3", rope_theta=theta, rope_scaling=rope_scaling(scaling),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def to_hf(c, out: dict) -> dict:
    scaling, rope = hf_rope(c)
    return {**out, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "hidden_act": "silu", "rope_theta": c.rope_theta, "rope_scaling": scaling,
            "rope_parameters": rope, "attention_bias": False, "use_sliding_window": False}


def from_gguf(meta, need, head_dim: int, tensors: set) -> dict:
    return dict(arch="qwen3")


ARCH = Arch(
    name="qwen3", hf_types=("qwen3",), gguf_types=("qwen3",),
    layer_names={**LAYER_NAMES, **QK_NORM_NAMES, "mlp_norm": "post_attention_layernorm.weight"},
    from_hf=from_hf, to_hf=to_hf, from_gguf=from_gguf, qk_norm=True)

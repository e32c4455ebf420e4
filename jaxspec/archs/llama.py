"""The Llama family: Llama 2/3, Mistral without a sliding window, and Qwen2 (q/k/v biases)."""

from jaxspec.archs.base import LAYER_NAMES, Arch, hf_rope, hf_theta, refuse_biases, rope_scaling
from jaxspec.errors import UserError


def from_hf(hf: dict, head_dim: int) -> dict:
    mtype = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"unsupported activation {hf['hidden_act']!r} for {mtype}")
    if mtype == "mistral" and hf.get("sliding_window"):
        raise UserError("Mistral checkpoints with a sliding window are not supported")
    if mtype != "qwen2":
        refuse_biases(hf, mtype)
    theta, scaling = hf_theta(hf)
    return dict(arch="llama", rope_theta=theta,
                rope_scaling=rope_scaling(scaling),
                tie_embeddings=bool(hf.get("tie_word_embeddings", mtype != "qwen2")),
                qkv_bias=mtype == "qwen2")


def to_hf(c, out: dict) -> dict:
    scaling, rope = hf_rope(c)
    common = {**out, "hidden_act": "silu", "rope_theta": c.rope_theta, "rope_scaling": scaling,
              "rope_parameters": rope}
    if c.qkv_bias:  # Llama's attention_bias would add an o_proj bias: q/k/v bias is Qwen2
        return {**common, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": False}
    return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "attention_bias": False, "mlp_bias": False}


def from_gguf(meta, need, head_dim: int, tensors: set) -> dict:
    return dict(arch="llama", qkv_bias="blk.0.attn_q.bias" in tensors)


ARCH = Arch(
    name="llama", hf_types=("llama", "mistral", "qwen2"), gguf_types=("llama", "mistral", "qwen2"),
    layer_names={**LAYER_NAMES, "mlp_norm": "post_attention_layernorm.weight"},
    from_hf=from_hf, to_hf=to_hf, from_gguf=from_gguf, gguf_permuted=("llama", "mistral"))
